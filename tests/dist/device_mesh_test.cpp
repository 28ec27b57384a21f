// Distributed tests of DeviceMesh on every world size and every mesh factorization: agreed
// construction errors, row-major coordinates, sub-communicators over every set of dims, and the
// derived meshes (rename, split, flatten, submesh, slice).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

using ::testing::HasSubstr;

/// Row-major coordinate of `rank`, computed independently of coord_of.
std::vector<int> row_major_coord(int rank, const std::vector<int>& shape) {
  std::vector<int> coord(shape.size());
  int stride = 1;
  for (size_t m = shape.size(); m-- > 0;) {
    coord[m] = (rank / stride) % shape[m];
    stride *= shape[m];
  }
  return coord;
}

/// Every non-empty subset of {0, ..., ndim-1} in ascending order, plus each reversed.
std::vector<std::vector<int>> dim_sets(int ndim) {
  std::vector<std::vector<int>> sets;
  for (int mask = 1; mask < (1 << ndim); ++mask) {
    std::vector<int> dims;
    for (int m = 0; m < ndim; ++m)
      if (mask & (1 << m)) dims.push_back(m);
    sets.push_back(dims);
    if (dims.size() > 1) sets.emplace_back(dims.rbegin(), dims.rend());
  }
  return sets;
}

TEST(DeviceMesh, SizeMismatchThrowsTheSameAgreedErrorOnEveryRankNamingBothSizes) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int world = comm->size();
    for (const std::vector<int>& shape :
         {std::vector<int>{world + 1}, std::vector<int>{2, world}}) {
      std::string message;
      try {
        DeviceMesh mesh(comm, shape);
      } catch (const AgreedError& error) {
        message = error.what();
      }
      EXPECT_THAT(message, HasSubstr(fmt::format("has {} ranks", mesh_size(shape))));
      EXPECT_THAT(message, HasSubstr(fmt::format("communicator has {}", world)));
      for (const std::string& other : testing::all_gather_strings(*comm, message))
        EXPECT_EQ(other, message);
    }
  });
}

TEST(DeviceMesh, MalformedOrDisagreeingShapesThrowAgreedErrorOnEveryRank) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int world = comm->size();
    auto agreed_error_of = [&](std::vector<int> shape, std::vector<std::string> names) {
      try {
        DeviceMesh mesh(comm, std::move(shape), std::move(names));
      } catch (const AgreedError& error) {
        return std::string(error.what());
      }
      return std::string();
    };
    EXPECT_THAT(agreed_error_of({}, {}), HasSubstr("at least one dim"));
    EXPECT_THAT(agreed_error_of({world, 0}, {}), HasSubstr("non-positive"));
    EXPECT_THAT(agreed_error_of({world, 1}, {"x", "x"}), HasSubstr("'x' is used twice"));
    EXPECT_THAT(agreed_error_of({world}, {"a", "b"}), HasSubstr("2 names given for a 1-d mesh"));
    if (world > 1) {
      // Rank 0 asks for a 1-d mesh, the others for a 2-d one of the same size.
      const std::vector<int> shape =
          comm->rank() == 0 ? std::vector<int>{world} : std::vector<int>{1, world};
      const std::string message = agreed_error_of(shape, {});
      EXPECT_THAT(message, HasSubstr("ranks disagree"));
      for (const std::string& other : testing::all_gather_strings(*comm, message))
        EXPECT_EQ(other, message);
    }
  });
}

TEST(DeviceMesh, CoordIsRowMajorOverTheShape) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    for (const auto& shape : testing::mesh_factorizations(comm->size())) {
      DeviceMesh mesh(comm, shape);
      EXPECT_EQ(mesh.coord(), row_major_coord(comm->rank(), shape)) << testing::shape_str(shape);
      EXPECT_EQ(mesh.rank(), comm->rank());
      EXPECT_EQ(mesh.size(), comm->size());
      EXPECT_EQ(mesh.ndim(), static_cast<int>(shape.size()));
      EXPECT_EQ(mesh.names()[0], "d0");
      EXPECT_EQ(mesh.dim_index(fmt::format("d{}", mesh.ndim() - 1)), mesh.ndim() - 1);
      EXPECT_THROW(mesh.dim_index("nope"), InvalidArgument);
    }
  });
}

TEST(DeviceMesh, SubCommOfEverySetOfDimsHasTheExpectedSizeAndRowMajorRankOrder) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    for (const auto& shape : testing::mesh_factorizations(comm->size())) {
      DeviceMesh mesh(comm, shape);
      for (const std::vector<int>& dims : dim_sets(mesh.ndim())) {
        SCOPED_TRACE(
            fmt::format("mesh {} dims {}", testing::shape_str(shape), testing::shape_str(dims)));
        std::shared_ptr<Comm> sub = mesh.sub_comm(dims);
        std::vector<int> sizes;
        for (int m : dims) sizes.push_back(shape[m]);
        EXPECT_EQ(sub->size(), mesh_size(sizes));
        int expected_rank = 0;
        for (int m : dims) expected_rank = expected_rank * shape[m] + mesh.coord()[m];
        EXPECT_EQ(sub->rank(), expected_rank);
        // Member i of the sub-communicator is the rank that differs from this one only along
        // `dims`, where it sits at row-major position i.
        const auto members = testing::all_gather_strings(*sub, std::to_string(comm->rank()));
        for (int i = 0; i < static_cast<int>(members.size()); ++i) {
          std::vector<int> coord = mesh.coord();
          const std::vector<int> along = row_major_coord(i, sizes);
          for (size_t k = 0; k < dims.size(); ++k) coord[dims[k]] = along[k];
          EXPECT_EQ(std::stoi(members[i]), rank_of(coord, shape)) << "member " << i;
        }
        EXPECT_EQ(mesh.sub_comm(dims), sub) << "sub-communicators are cached";
      }
      EXPECT_EQ(mesh.dim_comm("d0"), mesh.sub_comm({0}));
    }
  });
}

TEST(DeviceMesh, RenameKeepsShapeCoordAndCommunicators) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1, comm->size()}, {"dp", "domain"});
    EXPECT_EQ(mesh.dim_index("domain"), 1);
    auto domain = mesh.dim_comm("domain");
    const DeviceMesh renamed = mesh.rename({"batch", "space"});
    EXPECT_EQ(renamed.names(), (std::vector<std::string>{"batch", "space"}));
    EXPECT_EQ(renamed.shape(), mesh.shape());
    EXPECT_EQ(renamed.coord(), mesh.coord());
    EXPECT_EQ(renamed.dim_comm("space"), domain);
    EXPECT_THROW(mesh.rename({"only_one"}), InvalidArgument);
    EXPECT_EQ(mesh.str(), fmt::format("mesh (dp=1, domain={}), rank {} at (0, {})", comm->size(),
                                      comm->rank(), comm->rank()));
  });
}

TEST(DeviceMesh, SplitAndFlattenKeepTheRowMajorRankOrder) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int world = comm->size();
    for (const auto& shape : testing::mesh_factorizations(world)) {
      DeviceMesh mesh(comm, shape);
      SCOPED_TRACE(testing::shape_str(shape));
      // Flattening everything gives the 1-d mesh of the communicator's ranks.
      const DeviceMesh flat = mesh.flatten(0, mesh.ndim() - 1, "all");
      EXPECT_EQ(flat.shape(), std::vector<int>{world});
      EXPECT_EQ(flat.coord(), std::vector<int>{comm->rank()});
      EXPECT_EQ(flat.names(), std::vector<std::string>{"all"});
      // Splitting the flat dim back into the shape restores the coordinates.
      std::vector<std::string> names;
      for (size_t m = 0; m < shape.size(); ++m) names.push_back(fmt::format("s{}", m));
      const DeviceMesh unflat = flat.split(0, shape, names);
      EXPECT_EQ(unflat.shape(), shape);
      EXPECT_EQ(unflat.coord(), mesh.coord());
      EXPECT_EQ(unflat.names(), names);
      // Splitting the last dim in two, then flattening those two, is the identity.
      const int last = mesh.ndim() - 1;
      for (const auto& parts : testing::mesh_factorizations(shape[last], 2)) {
        if (parts.size() != 2) continue;
        const DeviceMesh split = mesh.split(last, parts, {"hi", "lo"});
        std::vector<int> expected_shape(shape.begin(), shape.end() - 1);
        expected_shape.insert(expected_shape.end(), parts.begin(), parts.end());
        EXPECT_EQ(split.shape(), expected_shape);
        EXPECT_EQ(split.coord(), row_major_coord(comm->rank(), expected_shape));
        // The derived mesh has working sub-communicators (collective on every rank).
        EXPECT_EQ(split.dim_comm("lo")->size(), parts[1]);
        EXPECT_EQ(split.dim_comm("lo")->rank(), split.coord()[last + 1]);
        const DeviceMesh merged = split.flatten(last, last + 1, "merged");
        EXPECT_EQ(merged.shape(), shape);
        EXPECT_EQ(merged.coord(), mesh.coord());
      }
      EXPECT_THROW(mesh.split(0, {shape[0] + 1}, {"x"}), InvalidArgument);
      EXPECT_THROW(mesh.flatten(0, mesh.ndim(), "x"), InvalidArgument);
    }
  });
}

TEST(DeviceMesh, SubmeshOverDimsHoldsThisRanksLine) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    for (const auto& shape : testing::mesh_factorizations(comm->size())) {
      DeviceMesh mesh(comm, shape);
      for (const std::vector<int>& dims : dim_sets(mesh.ndim())) {
        const DeviceMesh sub = mesh.submesh(dims);
        std::vector<int> sizes, coord;
        for (int m : dims) {
          sizes.push_back(shape[m]);
          coord.push_back(mesh.coord()[m]);
        }
        EXPECT_EQ(sub.shape(), sizes);
        EXPECT_EQ(sub.coord(), coord);
        EXPECT_EQ(sub.comm().size(), mesh_size(sizes));
        EXPECT_EQ(sub.names()[0], mesh.names()[dims[0]]);
      }
    }
  });
}

TEST(DeviceMesh, SliceGivesTheBlockAMeshAndEveryOtherRankNothing) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    for (const auto& shape : testing::mesh_factorizations(comm->size())) {
      DeviceMesh mesh(comm, shape);
      for (int dim = 0; dim < mesh.ndim(); ++dim) {
        const int n = shape[dim];
        for (const auto& [start, stop] :
             std::vector<std::pair<int, int>>{{0, n}, {0, 1}, {n / 2, n}, {n - 1, n}}) {
          SCOPED_TRACE(fmt::format("mesh {} slice [{}, {}) of dim {}", testing::shape_str(shape),
                                   start, stop, dim));
          const std::optional<DeviceMesh> block = mesh.slice(dim, start, stop);
          const bool inside = mesh.coord()[dim] >= start && mesh.coord()[dim] < stop;
          EXPECT_EQ(block.has_value(), inside);
          if (!inside || !block) continue;
          std::vector<int> block_shape = shape, block_coord = mesh.coord();
          block_shape[dim] = stop - start;
          block_coord[dim] -= start;
          EXPECT_EQ(block->shape(), block_shape);
          EXPECT_EQ(block->coord(), block_coord);
          EXPECT_EQ(block->rank(), rank_of(block_coord, block_shape));
          EXPECT_EQ(block->comm().size(), mesh_size(block_shape));
          EXPECT_EQ(block->comm().rank(), block->rank());
          // The block's communicator holds the block's ranks in row-major order.
          const auto members =
              testing::all_gather_strings(block->comm(), std::to_string(comm->rank()));
          for (int i = 0; i < static_cast<int>(members.size()); ++i) {
            std::vector<int> member_coord = row_major_coord(i, block_shape);
            member_coord[dim] += start;
            EXPECT_EQ(std::stoi(members[i]), rank_of(member_coord, shape)) << "member " << i;
          }
        }
      }
      EXPECT_THROW(mesh.slice(0, 0, shape[0] + 1), InvalidArgument);
    }
  });
}

}  // namespace
}  // namespace tessera
