// Distributed tests of ShardTensor::redistribute: for hundreds of seeded random pairs of layouts
// A and B (Shard/Replicate/Partial, uneven extents with zeros, tensor dims smaller than the mesh
// dims, every dtype) on every world size and mesh factorization, A -> B keeps the global tensor
// and A -> B -> A gives back bit-identical local tensors; plus a few named layouts.
#include <gtest/gtest.h>

#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

constexpr int cases_per_world = 200;

TEST(Redistribute, RandomLayoutRoundTripIsBitIdenticalAndKeepsTheGlobalTensor) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    const int cases = testing::cases_per_mesh(comm->size(), cases_per_world);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < cases; ++index) {
        testing::CaseRng rng(testing::case_seed(10, comm->size(), mesh_index, index));
        const testing::ShardCase from = testing::random_case(mesh.shape(), rng, true);
        // The target: same tensor, its own placements, extents and partial op.
        testing::ShardCase to = from;
        std::optional<ReduceOp> to_op;
        if (rng.chance(0.5)) to_op = testing::partial_ops[rng.uniform(0, 3)];
        to.placements = testing::random_placements(static_cast<int>(from.global_shape.size()),
                                                   mesh.ndim(), rng, to_op);
        to.extents =
            testing::random_layout_extents(to.global_shape, mesh.shape(), to.placements, rng);
        SCOPED_TRACE(fmt::format("mesh {}: {} -> placements {} extents {}",
                                 testing::shape_str(mesh.shape()), from.str(),
                                 testing::ShardCase{to}.str(), to.extents));
        const int64_t magnitude = from.has_partial() || to.has_partial() ? 16 : 1000;
        const Tensor full =
            testing::integer_tensor(from.global_shape, from.dtype, rng, -magnitude, magnitude);

        const ShardTensor a = ShardTensor::distribute(full, mesh, from.placements, from.extents);
        const ShardTensor b = a.redistribute(to.placements, to.extents);
        EXPECT_EQ(b.spec(),
                  ShardSpec::make(to.global_shape, mesh.shape(), to.placements, to.extents));
        EXPECT_EQ(b.to_local().shape(), b.local_box().shape());
        EXPECT_EQ(b.dtype(), from.dtype);
        if (!to.has_partial()) {
          EXPECT_TRUE(bitwise_equal(b.to_local(), full.view_box(b.local_box())))
              << "rank " << comm->rank() << " box " << b.local_box().str();
        }
        EXPECT_TRUE(bitwise_equal(b.full_tensor(), full));
        const ShardTensor back = b.redistribute(from.placements, from.extents);
        EXPECT_EQ(back.spec(), a.spec());
        EXPECT_TRUE(bitwise_equal(back.to_local(), a.to_local())) << "rank " << comm->rank();
      }
    }
  });
}

TEST(Redistribute, NonContiguousLocalTensorsMoveLikeContiguousOnes) {
  // from_local accepts any strided view: each rank's piece lives inside a padded buffer.
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    const int cases = testing::cases_per_mesh(comm->size(), 32);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < cases; ++index) {
        testing::CaseRng rng(testing::case_seed(11, comm->size(), mesh_index, index));
        const testing::ShardCase from = testing::random_case(mesh.shape(), rng, false);
        const std::vector<Placement> to_placements = testing::random_placements(
            static_cast<int>(from.global_shape.size()), mesh.ndim(), rng, std::nullopt);
        const auto to_extents =
            testing::random_layout_extents(from.global_shape, mesh.shape(), to_placements, rng);
        SCOPED_TRACE(fmt::format(
            "mesh {}: {} -> {}", testing::shape_str(mesh.shape()), from.str(),
            testing::ShardCase{from.global_shape, from.dtype, to_placements, to_extents}.str()));
        const Tensor full =
            testing::integer_tensor(from.global_shape, from.dtype, rng, -1000, 1000);
        const ShardSpec spec =
            ShardSpec::make(from.global_shape, mesh.shape(), from.placements, from.extents);
        const Box box = spec.local_box(mesh.coord());
        Shape padded_shape = box.shape();
        for (int64_t& extent : padded_shape) extent += 2;
        Tensor padded = Tensor::zeros(padded_shape, from.dtype);
        Box inner = Box::of_shape(box.shape());
        inner = inner.shifted(std::vector<int64_t>(inner.ndim(), 1));
        Tensor local = padded.view_box(inner);
        local.copy_from(full.view_box(box));
        const ShardTensor sharded =
            ShardTensor::from_local(local, mesh, from.global_shape, from.placements, from.extents);
        const ShardTensor moved = sharded.redistribute(to_placements, to_extents);
        EXPECT_TRUE(bitwise_equal(moved.to_local(), full.view_box(moved.local_box())))
            << "rank " << comm->rank();
        EXPECT_TRUE(bitwise_equal(moved.full_tensor(), full));
      }
    }
  });
}

TEST(Redistribute, UnevenRoundTripIsIdentity) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int world = comm->size();
    DeviceMesh mesh(comm, {world});
    testing::CaseRng rng(77 + world);
    const int64_t n = 2 * world + 1;
    const Tensor full = testing::integer_tensor({n, 3}, DType::f32, rng, -50, 50);
    // Everything on the last rank, then balanced, then back.
    std::vector<int64_t> lopsided(world, 0);
    lopsided.back() = n;
    const ShardTensor uneven =
        ShardTensor::distribute(full, mesh, {Placement::shard(0)}, {lopsided});
    EXPECT_EQ(uneven.to_local().shape(0), comm->rank() == world - 1 ? n : 0);
    const ShardTensor balanced = uneven.redistribute({Placement::shard(0)});
    EXPECT_EQ(balanced.spec().extents[0], default_split(n, world));
    EXPECT_TRUE(bitwise_equal(balanced.to_local(), full.view_box(balanced.local_box())));
    const ShardTensor back = balanced.redistribute({Placement::shard(0)}, {lopsided});
    EXPECT_TRUE(bitwise_equal(back.to_local(), uneven.to_local()));
  });
}

TEST(Redistribute, TensorDimsSmallerThanTheMeshDimLeaveEmptyShards) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int world = comm->size();
    DeviceMesh mesh(comm, {world});
    testing::CaseRng rng(500 + world);
    const int64_t n = std::max(world - 3, 1);  // fewer rows than ranks (when world > 1)
    const Tensor full = testing::integer_tensor({n, 2}, DType::bf16, rng, -10, 10);
    const ShardTensor rows = ShardTensor::distribute(full, mesh, {Placement::shard(0)});
    EXPECT_EQ(rows.to_local().shape(0), comm->rank() < n ? 1 : 0);
    const ShardTensor columns = rows.redistribute({Placement::shard(1)});
    EXPECT_EQ(columns.to_local().shape(), (Shape{n, default_split(2, world)[comm->rank()]}));
    EXPECT_TRUE(bitwise_equal(columns.to_local(), full.view_box(columns.local_box())));
    EXPECT_TRUE(bitwise_equal(columns.full_tensor(), full));
  });
}

TEST(Redistribute, SameLayoutReturnsTheSameLocalTensor) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {comm->size()});
    const Tensor full = Tensor::zeros({5}, DType::i64);
    const ShardTensor sharded = ShardTensor::distribute(full, mesh, {Placement::shard(0)});
    const ShardTensor same =
        sharded.redistribute({Placement::shard(0)}, {default_split(5, comm->size())});
    EXPECT_EQ(same.to_local().raw_data(), sharded.to_local().raw_data());
  });
}

}  // namespace
}  // namespace tessera
