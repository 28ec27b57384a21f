// Unit tests of ShardSpec: validation errors of make(), placement parsing, and the property that
// the local boxes of a layout tile the global box exactly.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/errors.hpp"
#include "core/layout.hpp"
#include "tests/common/layout_cases.hpp"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

/// The message of the InvalidArgument that `make` throws ("" when it does not throw).
template <typename Make>
std::string error_of(Make&& make) {
  try {
    make();
  } catch (const InvalidArgument& error) {
    return error.what();
  }
  return "";
}

TEST(ShardSpec, MissingExtentsGetTheDefaultSplit) {
  const ShardSpec spec =
      ShardSpec::make({10, 3}, {4, 2}, {Placement::shard(0), Placement::replicate()});
  EXPECT_EQ(spec.extents[0], (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_TRUE(spec.extents[1].empty());
  EXPECT_EQ(spec.mesh_dim_sharding(0), 0);
  EXPECT_EQ(spec.mesh_dim_sharding(1), -1);
  EXPECT_FALSE(spec.has_partial());
  EXPECT_EQ(spec.str(), "global [10, 3] on mesh [4, 2]: S(0)[3, 3, 2, 2] R");
}

TEST(ShardSpec, ExtentsThatDoNotSumToTheGlobalExtentAreRefusedNamingBoth) {
  const std::string message = error_of([] {
    ShardSpec::make({10}, {2}, {Placement::shard(0)}, {{4, 5}});
  });
  EXPECT_THAT(message, HasSubstr("sum to 9"));
  EXPECT_THAT(message, HasSubstr("10"));
}

TEST(ShardSpec, WrongNumberOfExtentsIsRefused) {
  const std::string message = error_of([] {
    ShardSpec::make({10}, {3}, {Placement::shard(0)}, {{5, 5}});
  });
  EXPECT_THAT(message, HasSubstr("3 ranks but 2 extents"));
  EXPECT_NE(
      error_of([] {
        ShardSpec::make({10}, {2, 1}, {Placement::shard(0), Placement::replicate()}, {{5, 5}});
      }),
      "");
}

TEST(ShardSpec, NegativeExtentsAreRefused) {
  EXPECT_THAT(error_of([] {
                ShardSpec::make({4}, {2}, {Placement::shard(0)}, {{6, -2}});
              }),
              HasSubstr("negative"));
  EXPECT_THAT(error_of([] { ShardSpec::make({-1}, {2}, {Placement::replicate()}); }),
              HasSubstr("negative"));
}

TEST(ShardSpec, ATensorDimShardedByTwoMeshDimsIsRefusedWithAClearMessage) {
  const std::string message = error_of([] {
    ShardSpec::make({8, 8}, {2, 2}, {Placement::shard(1), Placement::shard(1)});
  });
  EXPECT_THAT(message, HasSubstr("tensor dim 1 is sharded by mesh dims 0 and 1"));
  EXPECT_THAT(message, HasSubstr("flatten"));
}

TEST(ShardSpec, PlacementCountDifferentFromTheMeshRankIsRefused) {
  const std::string message = error_of([] { ShardSpec::make({8}, {2, 2}, {Placement::shard(0)}); });
  EXPECT_THAT(message, HasSubstr("1 placements given for a 2-d mesh"));
}

TEST(ShardSpec, OtherMalformedLayoutsAreRefused) {
  EXPECT_THAT(error_of([] { ShardSpec::make({8}, {2}, {Placement::shard(1)}); }),
              HasSubstr("the tensor has 1 dims"));
  EXPECT_THAT(error_of([] {
                ShardSpec::make({8}, {2}, {Placement::replicate()}, {{4, 4}});
              }),
              HasSubstr("was given extents"));
  EXPECT_THAT(error_of([] { ShardSpec::make({8}, {0}, {Placement::replicate()}); }),
              HasSubstr("non-positive"));
}

TEST(ShardSpec, ErrorsAreTaggedWithTheCallersOp) {
  const std::string message = error_of([] {
    ShardSpec::make({10}, {2}, {Placement::shard(0)}, {{1, 1}}, "redistribute");
  });
  EXPECT_THAT(message, StartsWith("[redistribute] "));
}

TEST(Placement, StrRoundTripsThroughParse) {
  for (const Placement& placement :
       {Placement::shard(0), Placement::shard(3), Placement::replicate(),
        Placement::partial(ReduceOp::sum), Placement::partial(ReduceOp::avg),
        Placement::partial(ReduceOp::max), Placement::partial(ReduceOp::min),
        Placement::partial(ReduceOp::prod)})
    EXPECT_EQ(parse_placement(placement.str()), placement) << placement.str();
  EXPECT_EQ(Placement::shard(2).str(), "S(2)");
  EXPECT_EQ(Placement::partial(ReduceOp::avg).str(), "P(avg)");
  EXPECT_THROW(parse_placement("X(1)"), InvalidArgument);
  EXPECT_THROW(parse_placement("P(mean)"), InvalidArgument);
  EXPECT_THROW(parse_placement(""), InvalidArgument);
}

/// A random valid layout of a random tensor (rank 1..4, extents 0..9) on `mesh_shape`.
ShardSpec random_spec(const std::vector<int>& mesh_shape, testing::CaseRng& rng) {
  const int ndim = static_cast<int>(rng.uniform(1, 4));
  Shape global_shape(ndim);
  for (int64_t& extent : global_shape) extent = rng.uniform(0, 9);
  std::vector<bool> used(ndim, false);
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents(mesh_shape.size());
  const bool explicit_extents = rng.chance(0.7);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    const int dim = static_cast<int>(rng.uniform(0, ndim - 1));
    const int64_t kind = rng.uniform(0, 3);
    if (kind <= 1 && !used[dim]) {
      used[dim] = true;
      placements.push_back(Placement::shard(dim));
      if (explicit_extents)
        extents[m] = testing::random_extents(global_shape[dim], mesh_shape[m], rng);
    } else if (kind == 2) {
      placements.push_back(Placement::replicate());
    } else {
      placements.push_back(Placement::partial(ReduceOp::sum));
    }
  }
  return ShardSpec::make(global_shape, mesh_shape, placements,
                         explicit_extents ? extents : std::vector<std::vector<int64_t>>{});
}

TEST(ShardSpecLocalBox, BoxesOfTheCanonicalRanksTileTheGlobalBoxExactly) {
  testing::CaseRng rng(1234);
  int cases = 0;
  for (int world = 1; world <= 12; ++world) {
    for (const auto& mesh_shape : testing::mesh_factorizations(world)) {
      for (int trial = 0; trial < 12; ++trial, ++cases) {
        const ShardSpec spec = random_spec(mesh_shape, rng);
        SCOPED_TRACE(spec.str());
        const Box global = Box::of_shape(spec.global_shape);
        std::vector<Box> tiles;
        for (int rank = 0; rank < world; ++rank) {
          const std::vector<int> coord = coord_of(rank, mesh_shape);
          const Box box = spec.local_box(coord);
          EXPECT_EQ(spec.local_box_of_rank(rank), box);
          EXPECT_EQ(spec.local_shape(coord), box.shape());
          EXPECT_EQ(intersect(box, global), box) << "box " << box.str() << " leaves the tensor";
          // Replicated and partial mesh dims do not change the box: compare with coordinate 0.
          std::vector<int> canonical = coord;
          bool is_canonical = true;
          for (size_t m = 0; m < mesh_shape.size(); ++m) {
            if (spec.placements[m].is_shard()) continue;
            is_canonical = is_canonical && coord[m] == 0;
            canonical[m] = 0;
          }
          EXPECT_EQ(box, spec.local_box(canonical));
          if (is_canonical) tiles.push_back(box);
        }
        int64_t volume = 0;
        for (size_t a = 0; a < tiles.size(); ++a) {
          volume += tiles[a].volume();
          for (size_t b = a + 1; b < tiles.size(); ++b)
            EXPECT_TRUE(intersect(tiles[a], tiles[b]).empty())
                << tiles[a].str() << " and " << tiles[b].str() << " overlap";
        }
        EXPECT_EQ(volume, global.volume());
      }
    }
  }
  EXPECT_GT(cases, 1000);
}

TEST(ShardSpecLocalBox, OffsetsArePrefixSumsOfTheExtents) {
  const ShardSpec spec = ShardSpec::make({7, 5}, {3, 2}, {Placement::shard(0), Placement::shard(1)},
                                         {{0, 7, 0}, {5, 0}});
  EXPECT_EQ(spec.local_box({0, 0}), (Box{{0, 0}, {0, 5}}));
  EXPECT_EQ(spec.local_box({1, 0}), (Box{{0, 0}, {7, 5}}));
  EXPECT_EQ(spec.local_box({1, 1}), (Box{{0, 5}, {7, 5}}));
  EXPECT_EQ(spec.local_box({2, 1}), (Box{{7, 5}, {7, 5}}));
}

}  // namespace
}  // namespace tessera
