// Distributed tests of entering and leaving a ShardTensor: scatter -> gather and distribute ->
// full_tensor are the identity bit for bit, over hundreds of seeded random layouts on every world
// size and mesh factorization (Partial layouts included: their reduction is exact).
#include <gtest/gtest.h>

#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

constexpr int cases_per_world = 96;

/// Checks this rank's piece of a tensor built from `full` by scatter or distribute.
void expect_local_piece(const ShardTensor& sharded, const Tensor& full,
                        const testing::ShardCase& shard_case) {
  const DeviceMesh& mesh = sharded.mesh();
  EXPECT_EQ(sharded.global_shape(), shard_case.global_shape);
  EXPECT_EQ(sharded.placements(), shard_case.placements);
  EXPECT_EQ(sharded.dtype(), shard_case.dtype);
  const Box box = sharded.local_box();
  EXPECT_EQ(sharded.to_local().shape(), box.shape());
  if (testing::holds_values(shard_case.placements, mesh.coord())) {
    EXPECT_TRUE(bitwise_equal(sharded.to_local(), full.view_box(box)))
        << "rank " << mesh.rank() << " box " << box.str();
  } else {
    EXPECT_TRUE(bitwise_equal(sharded.to_local(), Tensor::zeros(box.shape(), shard_case.dtype)))
        << "rank " << mesh.rank() << " should hold the zeros of a Partial(sum) copy";
  }
}

TEST(ShardTensor, ScatterThenGatherIsTheIdentityBitForBit) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    const int cases = testing::cases_per_mesh(comm->size(), cases_per_world);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < cases; ++index) {
        testing::CaseRng rng(testing::case_seed(1, comm->size(), mesh_index, index));
        const testing::ShardCase shard_case = testing::random_case(mesh.shape(), rng, true);
        SCOPED_TRACE(
            fmt::format("mesh {}: {}", testing::shape_str(mesh.shape()), shard_case.str()));
        // Partial layouts reduce on gather: small integers keep that exact in every dtype.
        const int64_t magnitude = shard_case.has_partial() ? 16 : 1000;
        const Tensor full = testing::integer_tensor(shard_case.global_shape, shard_case.dtype, rng,
                                                    -magnitude, magnitude);
        const int root = static_cast<int>(rng.uniform(0, comm->size() - 1));
        const int gather_root = static_cast<int>(rng.uniform(0, comm->size() - 1));
        const ShardTensor sharded =
            ShardTensor::scatter(comm->rank() == root ? full : Tensor(), mesh,
                                 shard_case.placements, shard_case.extents, root);
        expect_local_piece(sharded, full, shard_case);
        const Tensor gathered = sharded.gather(gather_root);
        if (comm->rank() == gather_root) {
          EXPECT_TRUE(bitwise_equal(gathered, full)) << "gathered on rank " << gather_root;
        } else {
          EXPECT_EQ(gathered.numel(), 0);
        }
      }
    }
  });
}

TEST(ShardTensor, DistributeThenFullTensorIsTheIdentityBitForBit) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    const int cases = testing::cases_per_mesh(comm->size(), cases_per_world);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < cases; ++index) {
        testing::CaseRng rng(testing::case_seed(2, comm->size(), mesh_index, index));
        const testing::ShardCase shard_case = testing::random_case(mesh.shape(), rng, true);
        SCOPED_TRACE(
            fmt::format("mesh {}: {}", testing::shape_str(mesh.shape()), shard_case.str()));
        const int64_t magnitude = shard_case.has_partial() ? 16 : 1000;
        const Tensor full = testing::integer_tensor(shard_case.global_shape, shard_case.dtype, rng,
                                                    -magnitude, magnitude);
        const ShardTensor sharded =
            ShardTensor::distribute(full, mesh, shard_case.placements, shard_case.extents);
        expect_local_piece(sharded, full, shard_case);
        EXPECT_TRUE(bitwise_equal(sharded.full_tensor(), full));
      }
    }
  });
}

TEST(ShardTensor, FromLocalInfersTheGlobalShapeAndExtentsFromTheLocalShapes) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    const int cases = testing::cases_per_mesh(comm->size(), 32);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < cases; ++index) {
        testing::CaseRng rng(testing::case_seed(3, comm->size(), mesh_index, index));
        const testing::ShardCase shard_case = testing::random_case(mesh.shape(), rng, false);
        SCOPED_TRACE(
            fmt::format("mesh {}: {}", testing::shape_str(mesh.shape()), shard_case.str()));
        const Tensor full =
            testing::integer_tensor(shard_case.global_shape, shard_case.dtype, rng, -100, 100);
        const ShardSpec spec = ShardSpec::make(shard_case.global_shape, mesh.shape(),
                                               shard_case.placements, shard_case.extents);
        const Tensor local = full.view_box(spec.local_box(mesh.coord())).clone();
        const ShardTensor inferred = ShardTensor::from_local(local, mesh, shard_case.placements);
        EXPECT_EQ(inferred.spec(), spec);
        const ShardTensor given = ShardTensor::from_local(
            local, mesh, shard_case.global_shape, shard_case.placements, shard_case.extents);
        EXPECT_EQ(given.spec(), spec);
        EXPECT_TRUE(bitwise_equal(inferred.full_tensor(), full));
      }
    }
  });
}

}  // namespace
}  // namespace tessera
