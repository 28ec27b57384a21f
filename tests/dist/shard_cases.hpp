// Seeded random ShardTensor cases for the distributed tests: a global shape (rank 1..4, small
// extents including zeros and extents smaller than the mesh dims), a dtype among all 7, random
// placements S(d) / R / P(op) and random uneven extents with zeros; plus integer-valued tensors
// whose reductions are exact in every dtype, so results can be compared bit for bit.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/tessera.hpp"
#include "tests/common/layout_cases.hpp"

namespace tessera::testing {

inline constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                       DType::i32, DType::i64, DType::u8};
inline constexpr ReduceOp partial_ops[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max,
                                           ReduceOp::min};

/// One layout of one global tensor on a mesh.
struct ShardCase {
  Shape global_shape;
  DType dtype = DType::f32;
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;  ///< empty: default split

  std::string str() const {
    std::vector<std::string> names;
    for (const Placement& placement : placements) names.push_back(placement.str());
    return fmt::format("{} {} placements [{}] extents {}", dtype_name(dtype), global_shape,
                       fmt::join(names, ", "), extents);
  }
  bool has_partial() const {
    for (const Placement& placement : placements)
      if (placement.is_partial()) return true;
    return false;
  }
};

/// Random placements of a tensor with `ndim` dims on a mesh of `mesh_ndim` dims: each mesh dim
/// shards a tensor dim no other mesh dim shards, replicates, or (with `partial_op`) is partial.
/// All partial dims share one op, so the order in which they are reduced does not matter.
inline std::vector<Placement> random_placements(int ndim, int mesh_ndim, CaseRng& rng,
                                                std::optional<ReduceOp> partial_op) {
  std::vector<bool> sharded(ndim, false);
  std::vector<Placement> placements;
  for (int m = 0; m < mesh_ndim; ++m) {
    const int64_t kind = rng.uniform(0, partial_op ? 3 : 2);
    const int dim = static_cast<int>(rng.uniform(0, ndim - 1));
    if (kind <= 1 && !sharded[dim]) {
      sharded[dim] = true;
      placements.push_back(Placement::shard(dim));
    } else if (kind == 3) {
      placements.push_back(Placement::partial(*partial_op));
    } else {
      placements.push_back(Placement::replicate());
    }
  }
  return placements;
}

/// Half the time the default split (empty), otherwise random extents with zeros for every
/// Shard mesh dim.
inline std::vector<std::vector<int64_t>> random_layout_extents(
    const Shape& global_shape, const std::vector<int>& mesh_shape,
    const std::vector<Placement>& placements, CaseRng& rng) {
  if (rng.chance(0.5)) return {};
  std::vector<std::vector<int64_t>> extents(mesh_shape.size());
  for (size_t m = 0; m < mesh_shape.size(); ++m)
    if (placements[m].is_shard())
      extents[m] = random_extents(global_shape[placements[m].dim], mesh_shape[m], rng);
  return extents;
}

/// A random case on `mesh_shape`; Partial placements only when `allow_partial`.
inline ShardCase random_case(const std::vector<int>& mesh_shape, CaseRng& rng, bool allow_partial) {
  ShardCase shard_case;
  const int ndim = static_cast<int>(rng.uniform(1, 4));
  constexpr int64_t max_extent = 9;
  shard_case.global_shape.resize(ndim);
  for (int64_t& extent : shard_case.global_shape) extent = rng.uniform(0, max_extent);
  shard_case.dtype = all_dtypes[rng.uniform(0, 6)];
  std::optional<ReduceOp> partial_op;
  if (allow_partial) partial_op = partial_ops[rng.uniform(0, 3)];
  shard_case.placements =
      random_placements(ndim, static_cast<int>(mesh_shape.size()), rng, partial_op);
  shard_case.extents =
      random_layout_extents(shard_case.global_shape, mesh_shape, shard_case.placements, rng);
  return shard_case;
}

/// A contiguous cpu tensor of `dtype` holding random integers in [lo, hi] (lo raised to 0 for
/// u8), the same on every rank for the same rng state.
inline Tensor integer_tensor(const Shape& shape, DType dtype, CaseRng& rng, int64_t lo,
                             int64_t hi) {
  if (dtype == DType::u8) lo = std::max<int64_t>(lo, 0);
  Tensor values = Tensor::empty(shape, DType::f64);
  double* data = values.data<double>();
  for (int64_t i = 0; i < values.numel(); ++i) data[i] = static_cast<double>(rng.uniform(lo, hi));
  return values.to_dtype(dtype);
}

/// True when the rank at `coord` holds the values of a tensor made Partial from a full one:
/// only coordinate 0 of Partial(sum) dims does (the others hold zeros).
inline bool holds_values(const std::vector<Placement>& placements, const std::vector<int>& coord) {
  for (size_t m = 0; m < placements.size(); ++m)
    if (placements[m].is_partial() && placements[m].reduce == ReduceOp::sum && coord[m] != 0)
      return false;
  return true;
}

/// TESSERA_TEST_SWEEP_DIVISOR: a positive integer D (default 1); the GPU tests' seeded sweeps
/// then run about 1/D of their cases (through sweep_cases and sweep_takes). scripts/gpu-check.sh
/// sets it for its compute-sanitizer runs, under which every kernel runs 10-100 times slower, so
/// that each sweep still finishes and reaches every kernel on every mesh. Another value throws (the
/// test fails saying so).
inline int sweep_divisor() {
  static const int divisor = [] {
    const char* value = std::getenv("TESSERA_TEST_SWEEP_DIVISOR");
    if (value == nullptr || *value == '\0') return 1;
    char* end = nullptr;
    const long parsed = std::strtol(value, &end, 10);
    if (*end != '\0' || parsed < 1 || parsed > 1000000)
      throw std::invalid_argument(
          fmt::format("TESSERA_TEST_SWEEP_DIVISOR='{}' (expected a positive integer)", value));
    return static_cast<int>(parsed);
  }();
  return divisor;
}

/// How many of a sweep's `cases` to run: all of them, or 1/sweep_divisor() of them (at least 1).
inline int sweep_cases(int cases) {
  return std::max(1, cases / sweep_divisor());
}

/// Whether a sweep that visits its combinations in a fixed order takes combination number
/// `counter` (every one, or every sweep_divisor()-th).
inline bool sweep_takes(int counter) {
  return counter % sweep_divisor() == 0;
}

/// How many random cases each mesh of a world gets, so that every world size runs about
/// `cases_per_world` cases spread over its factorizations.
inline int cases_per_mesh(int world_size, int cases_per_world) {
  const int meshes = static_cast<int>(mesh_factorizations(world_size).size());
  return (cases_per_world + meshes - 1) / meshes;
}

/// A seed for case `index` on mesh `mesh_index` of world `world_size` in test `test_id`.
inline uint64_t case_seed(int test_id, int world_size, int mesh_index, int index) {
  return (static_cast<uint64_t>(test_id) << 40) ^ (static_cast<uint64_t>(world_size) << 32) ^
         (static_cast<uint64_t>(mesh_index) << 16) ^ static_cast<uint64_t>(index);
}

}  // namespace tessera::testing
