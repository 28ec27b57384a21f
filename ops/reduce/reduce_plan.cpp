// Plans of the deterministic reductions (see reduce_plan.hpp for the summation order).
#include "ops/reduce/reduce_plan.hpp"

#include <algorithm>

#include "core/errors.hpp"

namespace tessera::ops {

namespace {

/// Dims of one kind (kept or reduced), innermost first, merged where every stride list walks
/// two neighbours as one.
struct DimGroup {
  std::vector<int64_t> extents;
  std::vector<std::vector<int64_t>> strides;  // per stride list (operands, then the output)
  int last_position = -2;  // position (among the extent > 1 dims) of the dim added last

  explicit DimGroup(size_t lists) : strides(lists) {}

  /// Adds the dim at `position`, counted outward from the innermost dim of extent > 1.
  void add(int position, int64_t extent, const std::vector<int64_t>& dim_strides) {
    // Merge only with the group's previous dim when it is the neighbour once extent-1 dims are
    // dropped (a dim of the other kind in between breaks the merge).
    bool merge = !extents.empty() && last_position + 1 == position;
    for (size_t k = 0; k < strides.size() && merge; ++k)
      merge = dim_strides[k] == strides[k].back() * extents.back();
    last_position = position;
    if (merge) {
      extents.back() *= extent;
      return;
    }
    extents.push_back(extent);
    for (size_t k = 0; k < strides.size(); ++k) strides[k].push_back(dim_strides[k]);
  }
};

}  // namespace

ReducePlan reduce_plan(const std::vector<int64_t>& shape,
                       const std::vector<std::vector<int64_t>>& operand_strides,
                       const std::vector<bool>& reduced, const std::vector<int64_t>& out_strides) {
  const int operands = static_cast<int>(operand_strides.size());
  check_arg(operands >= 1 && operands <= kMaxReduceOperands, "reduce", "{} operands (1 to {})",
            operands, kMaxReduceOperands);
  check_arg(reduced.size() == shape.size() && out_strides.size() == shape.size(), "reduce",
            "{} reduce flags and {} output strides for a {}-d shape", reduced.size(),
            out_strides.size(), shape.size());
  for (const std::vector<int64_t>& strides : operand_strides)
    check_arg(strides.size() == shape.size(), "reduce",
              "operand strides of rank {} for a {}-d shape", strides.size(), shape.size());

  DimGroup kept(operands + 1), summed(operands);
  ReducePlan plan;
  plan.operands = operands;
  plan.outputs = 1;
  plan.reduce_count = 1;
  int position = 0;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    (reduced[d] ? plan.reduce_count : plan.outputs) *= shape[d];
    if (shape[d] == 1) continue;
    std::vector<int64_t> dim_strides;
    for (int k = 0; k < operands; ++k) dim_strides.push_back(operand_strides[k][d]);
    if (reduced[d]) {
      summed.add(position, shape[d], dim_strides);
    } else {
      dim_strides.push_back(out_strides[d]);
      kept.add(position, shape[d], dim_strides);
    }
    ++position;
  }
  plan.kept_ndim = static_cast<int>(kept.extents.size());
  plan.reduced_ndim = static_cast<int>(summed.extents.size());
  check_arg(plan.kept_ndim <= kMaxKernelDims && plan.reduced_ndim <= kMaxKernelDims, "reduce",
            "{} kept and {} reduced dims remain after merging (at most {} each)", plan.kept_ndim,
            plan.reduced_ndim, kMaxKernelDims);
  for (int i = 0; i < plan.kept_ndim; ++i) {
    const int d = plan.kept_ndim - 1 - i;  // row-major order, innermost last
    plan.kept_extent[d] = kept.extents[i];
    for (int k = 0; k < operands; ++k) plan.kept_stride[k][d] = kept.strides[k][i];
    plan.out_stride[d] = kept.strides[operands][i];
  }
  for (int i = 0; i < plan.reduced_ndim; ++i) {
    const int d = plan.reduced_ndim - 1 - i;
    plan.reduced_extent[d] = summed.extents[i];
    for (int k = 0; k < operands; ++k) plan.reduced_stride[k][d] = summed.strides[k][i];
  }

  // The split: a function of the two counts only (no outputs: nothing to split).
  if (plan.outputs == 0 || plan.reduce_count <= kThreadReduceLimit ||
      plan.outputs >= kThreadPerOutputFrom) {
    plan.strategy = ReduceStrategy::thread_per_output;
    plan.chunks = 1;
    plan.chunk_length = plan.reduce_count;
    return plan;
  }
  plan.strategy = ReduceStrategy::block_per_chunk;
  const int64_t wanted = (plan.reduce_count + kElementsPerChunk - 1) / kElementsPerChunk;
  const int64_t room = std::max<int64_t>(1, kMaxReduceBlocks / plan.outputs);
  const int64_t chunks = std::clamp<int64_t>(wanted, 1, room);
  plan.chunk_length = (plan.reduce_count + chunks - 1) / chunks;
  plan.chunks = (plan.reduce_count + plan.chunk_length - 1) / plan.chunk_length;  // none empty
  return plan;
}

int64_t reduce_workspace_elements(const ReducePlan& plan) {
  return plan.strategy == ReduceStrategy::block_per_chunk && plan.chunks > 1
             ? plan.outputs * plan.chunks
             : 0;
}

}  // namespace tessera::ops
