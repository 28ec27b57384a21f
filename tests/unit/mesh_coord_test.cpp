// Unit tests of the rank <-> mesh coordinate convention (row-major) and of the test helper that
// enumerates mesh factorizations.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "core/layout.hpp"
#include "tests/common/layout_cases.hpp"

namespace tessera {
namespace {

TEST(MeshCoord, CoordOfIsRowMajorWithTheLastDimFastest) {
  const std::vector<int> shape{2, 3, 4};
  EXPECT_EQ(coord_of(0, shape), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(coord_of(1, shape), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(coord_of(4, shape), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(coord_of(12, shape), (std::vector<int>{1, 0, 0}));
  EXPECT_EQ(coord_of(23, shape), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(rank_of({1, 2, 3}, shape), 23);
  EXPECT_EQ(rank_of({0, 1, 2}, shape), 6);
}

TEST(MeshCoord, RankOfInvertsCoordOfOnEveryMesh) {
  std::vector<std::vector<int>> shapes;
  for (int world = 1; world <= 24; ++world)
    for (const auto& shape : testing::mesh_factorizations(world)) shapes.push_back(shape);
  shapes.push_back({2, 1, 3, 2});
  shapes.push_back({1, 1, 1, 1});
  for (const auto& shape : shapes) {
    const int size = mesh_size(shape);
    for (int rank = 0; rank < size; ++rank) {
      const std::vector<int> coord = coord_of(rank, shape);
      ASSERT_EQ(coord.size(), shape.size());
      // Independent row-major formula: coord[m] = (rank / product of later dims) % shape[m].
      int stride = 1;
      for (size_t m = shape.size(); m-- > 0;) {
        EXPECT_EQ(coord[m], (rank / stride) % shape[m]);
        stride *= shape[m];
      }
      EXPECT_EQ(rank_of(coord, shape), rank);
    }
  }
}

TEST(MeshCoord, MeshSizeIsTheProductOfTheShape) {
  EXPECT_EQ(mesh_size({2, 3, 4}), 24);
  EXPECT_EQ(mesh_size({5}), 5);
  EXPECT_EQ(mesh_size({}), 1);
}

TEST(MeshFactorizations, EnumeratesEveryOrderedFactorizationOfFour) {
  const auto shapes = testing::mesh_factorizations(4);
  const std::set<std::vector<int>> found(shapes.begin(), shapes.end());
  const std::set<std::vector<int>> expected{{4},       {1, 4},    {2, 2},    {4, 1},    {1, 1, 4},
                                            {1, 2, 2}, {1, 4, 1}, {2, 1, 2}, {2, 2, 1}, {4, 1, 1}};
  EXPECT_EQ(shapes.size(), expected.size());
  EXPECT_EQ(found, expected);
}

TEST(MeshFactorizations, CountsMatchTheDivisorFunctions) {
  // 1 + d2(n) + d3(n) ordered factorizations into 1, 2 and 3 factors.
  const int expected[9] = {0, 3, 6, 6, 10, 6, 14, 6, 15};
  for (int world = 1; world <= 8; ++world) {
    const auto shapes = testing::mesh_factorizations(world);
    EXPECT_EQ(static_cast<int>(shapes.size()), expected[world]) << "world " << world;
    const std::set<std::vector<int>> unique(shapes.begin(), shapes.end());
    EXPECT_EQ(unique.size(), shapes.size());
    for (const auto& shape : shapes) EXPECT_EQ(mesh_size(shape), world);
  }
}

TEST(RandomExtents, SumToTheTotalAndIncludeZeros) {
  testing::CaseRng rng(7);
  int zeros = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int parts = static_cast<int>(rng.uniform(1, 8));
    const int64_t total = rng.uniform(0, 20);
    const auto extents = testing::random_extents(total, parts, rng);
    ASSERT_EQ(static_cast<int>(extents.size()), parts);
    int64_t sum = 0;
    for (int64_t extent : extents) {
      EXPECT_GE(extent, 0);
      sum += extent;
      zeros += extent == 0;
    }
    EXPECT_EQ(sum, total);
  }
  EXPECT_GT(zeros, 50);
}

}  // namespace
}  // namespace tessera
