// Distributed tests of Partial placements: each rank brings its own (rank-dependent) values
// through from_local with P(sum|avg|max|min); full_tensor, gather and the Partial -> Shard path
// (reduce_scatter) must all equal a reference reduction computed here in double.
#include <gtest/gtest.h>

#include <algorithm>

#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

constexpr int cases_per_world = 80;

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// A Partial case: the layout and what every rank contributes.
struct PartialCase {
  testing::ShardCase layout;
  uint64_t seed = 0;
  int partial_ranks = 1;  ///< product of the sizes of the Partial mesh dims

  /// Contribution of partial position `p` (row-major over the Partial mesh dims) to the global
  /// element at row-major position `flat`. Multiples of partial_ranks, so every average along
  /// the way is exact; small, so every sum is exact even in bf16 and fits u8.
  double contribution(int64_t flat, int p) const {
    const uint64_t h = mix(seed ^ mix(static_cast<uint64_t>(flat) * 1315423911ull + p));
    const int64_t small =
        layout.dtype == DType::u8 ? static_cast<int64_t>(h % 4) : static_cast<int64_t>(h % 9) - 4;
    return static_cast<double>(small * partial_ranks);
  }

  ReduceOp op() const {
    for (const Placement& placement : layout.placements)
      if (placement.is_partial()) return placement.reduce;
    return ReduceOp::sum;
  }
};

PartialCase random_partial_case(const DeviceMesh& mesh, testing::CaseRng& rng) {
  PartialCase partial_case;
  partial_case.layout = testing::random_case(mesh.shape(), rng, true);
  if (!partial_case.layout.has_partial()) {  // make one mesh dim Partial
    const int m = static_cast<int>(rng.uniform(0, mesh.ndim() - 1));
    partial_case.layout.placements[m] = Placement::partial(testing::partial_ops[rng.uniform(0, 3)]);
    if (!partial_case.layout.extents.empty()) partial_case.layout.extents[m].clear();
  }
  partial_case.seed = static_cast<uint64_t>(rng.uniform(0, int64_t{1} << 40));
  for (int m = 0; m < mesh.ndim(); ++m)
    if (partial_case.layout.placements[m].is_partial()) partial_case.partial_ranks *= mesh.size(m);
  return partial_case;
}

/// Row-major position of `coord` over the Partial mesh dims only (replicated dims do not
/// change what a rank holds).
int partial_position(const PartialCase& partial_case, const DeviceMesh& mesh,
                     const std::vector<int>& coord) {
  int position = 0;
  for (int m = 0; m < mesh.ndim(); ++m)
    if (partial_case.layout.placements[m].is_partial())
      position = position * mesh.size(m) + coord[m];
  return position;
}

/// Calls fn(global multi-index, row-major position) for every index of `box`.
template <typename Fn>
void for_each_in_box(const Box& box, const Shape& global_shape, Fn&& fn) {
  if (box.empty()) return;
  std::vector<int64_t> index = box.lo;
  while (true) {
    int64_t flat = 0;
    for (size_t d = 0; d < global_shape.size(); ++d) flat = flat * global_shape[d] + index[d];
    fn(index, flat);
    int d = static_cast<int>(index.size()) - 1;
    for (; d >= 0; --d) {
      if (++index[d] < box.hi[d]) break;
      index[d] = box.lo[d];
    }
    if (d < 0) return;
  }
}

/// This rank's local tensor: its contributions over its local box.
Tensor local_contributions(const PartialCase& partial_case, const ShardSpec& spec,
                           const DeviceMesh& mesh) {
  const Box box = spec.local_box(mesh.coord());
  const int p = partial_position(partial_case, mesh, mesh.coord());
  Tensor values = Tensor::empty(box.shape(), DType::f64);
  double* out = values.data<double>();
  for_each_in_box(box, spec.global_shape, [&](const std::vector<int64_t>&, int64_t flat) {
    *out++ = partial_case.contribution(flat, p);
  });
  return values.to_dtype(partial_case.layout.dtype);
}

/// The reduced global tensor, computed in double and converted (exactly) to the dtype.
Tensor reference(const PartialCase& partial_case) {
  const Shape& shape = partial_case.layout.global_shape;
  Tensor values = Tensor::empty(shape, DType::f64);
  double* out = values.data<double>();
  const ReduceOp op = partial_case.op();
  for_each_in_box(Box::of_shape(shape), shape, [&](const std::vector<int64_t>&, int64_t flat) {
    double result = partial_case.contribution(flat, 0);
    for (int p = 1; p < partial_case.partial_ranks; ++p) {
      const double value = partial_case.contribution(flat, p);
      if (op == ReduceOp::max)
        result = std::max(result, value);
      else if (op == ReduceOp::min)
        result = std::min(result, value);
      else
        result += value;
    }
    *out++ = op == ReduceOp::avg ? result / partial_case.partial_ranks : result;
  });
  return values.to_dtype(partial_case.layout.dtype);
}

TEST(Partial, FromLocalOfRankDependentValuesReducesLikeTheReference) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    const int cases = testing::cases_per_mesh(comm->size(), cases_per_world);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < cases; ++index) {
        testing::CaseRng rng(testing::case_seed(20, comm->size(), mesh_index, index));
        const PartialCase partial_case = random_partial_case(mesh, rng);
        const testing::ShardCase& layout = partial_case.layout;
        SCOPED_TRACE(fmt::format("mesh {}: {}", testing::shape_str(mesh.shape()), layout.str()));
        const ShardSpec spec =
            ShardSpec::make(layout.global_shape, mesh.shape(), layout.placements, layout.extents);
        const ShardTensor partial =
            ShardTensor::from_local(local_contributions(partial_case, spec, mesh), mesh,
                                    layout.global_shape, layout.placements, layout.extents);
        const Tensor expected = reference(partial_case);
        EXPECT_TRUE(bitwise_equal(partial.full_tensor(), expected))
            << "max |diff| " << max_abs_diff(partial.full_tensor(), expected);
        const int root = static_cast<int>(rng.uniform(0, comm->size() - 1));
        const Tensor gathered = partial.gather(root);
        if (comm->rank() == root) {
          EXPECT_TRUE(bitwise_equal(gathered, expected));
        }
      }
    }
  });
}

TEST(Partial, ReducingToShardGivesEachRankItsPieceOfTheReference) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    const int cases = testing::cases_per_mesh(comm->size(), cases_per_world);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < cases; ++index) {
        testing::CaseRng rng(testing::case_seed(21, comm->size(), mesh_index, index));
        const PartialCase partial_case = random_partial_case(mesh, rng);
        const testing::ShardCase& layout = partial_case.layout;
        // Target: every Partial mesh dim shards a tensor dim nobody shards yet (with random
        // extents), or replicates when none is left.
        std::vector<Placement> target = layout.placements;
        std::vector<bool> sharded(layout.global_shape.size(), false);
        for (const Placement& placement : target)
          if (placement.is_shard()) sharded[placement.dim] = true;
        std::vector<std::vector<int64_t>> extents(mesh.ndim());
        const ShardSpec from =
            ShardSpec::make(layout.global_shape, mesh.shape(), layout.placements, layout.extents);
        for (int m = 0; m < mesh.ndim(); ++m) {
          if (target[m].is_shard()) extents[m] = from.extents[m];
          if (!target[m].is_partial()) continue;
          target[m] = Placement::replicate();
          for (int dim = 0; dim < static_cast<int>(sharded.size()); ++dim) {
            if (sharded[dim]) continue;
            sharded[dim] = true;
            target[m] = Placement::shard(dim);
            extents[m] = testing::random_extents(layout.global_shape[dim], mesh.size(m), rng);
            break;
          }
        }
        testing::ShardCase target_case = layout;
        target_case.placements = target;
        target_case.extents = extents;
        SCOPED_TRACE(fmt::format("mesh {}: {} -> {}", testing::shape_str(mesh.shape()),
                                 layout.str(), target_case.str()));
        const ShardTensor partial =
            ShardTensor::from_local(local_contributions(partial_case, from, mesh), mesh,
                                    layout.global_shape, layout.placements, layout.extents);
        const ShardTensor reduced = partial.redistribute(target, extents);
        const Tensor expected = reference(partial_case);
        EXPECT_FALSE(reduced.spec().has_partial());
        EXPECT_TRUE(bitwise_equal(reduced.to_local(), expected.view_box(reduced.local_box())))
            << "rank " << comm->rank() << " box " << reduced.local_box().str();
        EXPECT_TRUE(bitwise_equal(reduced.full_tensor(), expected));
      }
    }
  });
}

TEST(Partial, AvgOverAMeshDimIsExactOnEveryDType) {
  // Ranks contribute 0, 1, ..., world-1 times world: the exact average (world-1)*world/2 comes
  // out on every rank, for every dtype, through all_reduce and through reduce_scatter.
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int world = comm->size();
    DeviceMesh mesh(comm, {world});
    for (DType dtype : testing::all_dtypes) {
      Tensor local = Tensor::empty({3}, dtype);
      local.fill(static_cast<double>(comm->rank() * world));
      const ShardTensor partial =
          ShardTensor::from_local(local, mesh, {3}, {Placement::partial(ReduceOp::avg)});
      const Tensor result = partial.full_tensor();
      for (int64_t i = 0; i < 3; ++i)
        EXPECT_EQ(result.item_as_double({i}), (world - 1) * world / 2.0) << dtype_name(dtype);
      const ShardTensor sharded = partial.redistribute({Placement::shard(0)});
      for (int64_t i = 0; i < sharded.to_local().shape(0); ++i)
        EXPECT_EQ(sharded.to_local().item_as_double({i}), (world - 1) * world / 2.0)
            << dtype_name(dtype);
    }
  });
}

}  // namespace
}  // namespace tessera
