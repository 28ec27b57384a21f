// Plan of the conv bias gradient on cuda (see conv_bias_plan.hpp for the summation order).
#include "ops/conv/conv_bias_plan.hpp"

#include <algorithm>

#include "core/errors.hpp"

namespace tessera::ops {

namespace {

constexpr const char* kOp = "conv";

struct ReducedDim {
  int64_t extent;
  int64_t stride;
};

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

BiasGradPlan bias_grad_plan(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                            int64_t out_stride, size_t element_size) {
  check_arg(shape.size() >= 2 && shape.size() <= 1 + kBiasGradMaxDims, kOp,
            "bias gradient of a {}-d dy, expected [N, C, spatial..] with 0 to 3 spatial dims",
            shape.size());
  check_arg(strides.size() == shape.size(), kOp, "dy has {} strides for {} dims", strides.size(),
            shape.size());
  for (size_t d = 0; d < shape.size(); ++d)
    check_arg(shape[d] >= 0 && strides[d] >= 0, kOp,
              "dy dim {} has extent {} and stride {}, expected both >= 0", d, shape[d], strides[d]);
  check_arg(element_size > 0 && element_size <= kBiasGradVectorBytes, kOp, "elements of {} bytes",
            element_size);

  BiasGradPlan plan;
  plan.channels = shape[1];
  plan.channel_stride = strides[1];
  plan.out_stride = out_stride;

  // Every dim but C is summed; the order among them is free, so they are walked by decreasing
  // stride (stride 0, a broadcast dim, outermost): the innermost then has the smallest stride,
  // which is what vector loads and merging need.
  std::vector<ReducedDim> dims;
  for (size_t d = 0; d < shape.size(); ++d)
    if (d != 1 && shape[d] != 1) dims.push_back({shape[d], strides[d]});
  std::stable_sort(dims.begin(), dims.end(), [](const ReducedDim& a, const ReducedDim& b) {
    if (a.stride == 0 || b.stride == 0) return a.stride == 0 && b.stride != 0;
    return a.stride > b.stride;
  });
  std::vector<ReducedDim> merged;
  for (const ReducedDim& dim : dims) {
    if (!merged.empty() && merged.back().stride == dim.extent * dim.stride) {
      merged.back().extent *= dim.extent;
      merged.back().stride = dim.stride;
    } else {
      merged.push_back(dim);
    }
  }
  if (merged.empty()) merged.push_back({1, 0});  // one element per channel
  int64_t count = 1;
  for (const ReducedDim& dim : merged) count *= dim.extent;
  plan.channel_groups = plan.channels;
  if (count == 0) {  // N or a spatial extent 0: db = 0, nothing is read
    plan.ndim = 1;
    plan.groups = 0;
    return plan;
  }

  // Channels are the innermost memory dim (channels-last, or no spatial extent): a block takes
  // adjacent channels on its lanes, so a warp reads one contiguous run.
  ReducedDim& inner = merged.back();
  if (plan.channels > 1 && plan.channel_stride < inner.stride) {
    plan.lanes = 1;
    while (plan.lanes < 32 && plan.lanes < plan.channels) plan.lanes *= 2;
  }
  plan.walkers = kBiasGradThreads / plan.lanes;

  // One channel per block with contiguous rows: groups of 16 bytes, when every row holds a
  // whole number of them (a group never spans two rows).
  const int vector = kBiasGradVectorBytes / static_cast<int>(element_size);
  if (plan.lanes == 1 && vector > 1 && inner.stride == 1 && inner.extent % vector == 0) {
    plan.vector = vector;
    inner.extent /= vector;
    inner.stride = vector;
  }

  plan.ndim = static_cast<int>(merged.size());
  for (int d = 0; d < plan.ndim; ++d) {
    plan.extent[d] = merged[d].extent;
    plan.stride[d] = merged[d].stride;
  }
  int64_t rest = plan.walkers;
  for (int d = plan.ndim - 1; d > 0; --d) {
    plan.step[d] = rest % plan.extent[d];
    rest /= plan.extent[d];
  }
  plan.step[0] = rest;

  plan.groups = count / plan.vector;
  plan.channel_groups = ceil_div(plan.channels, plan.lanes);
  if (plan.channels == 0) return plan;
  // Enough blocks to keep every SM streaming, never so few elements per block that the second
  // pass matters; a function of the shape alone (never of the device) so the order is fixed.
  int64_t chunks = ceil_div(count * plan.lanes, kBiasGradBlockElements);
  chunks = std::min(chunks, std::max<int64_t>(1, kBiasGradMaxBlocks / plan.channel_groups));
  chunks = std::min(chunks, ceil_div(plan.groups, plan.walkers));
  chunks = std::max<int64_t>(chunks, 1);
  plan.chunk_groups = ceil_div(plan.groups, chunks);
  plan.chunks = ceil_div(plan.groups, plan.chunk_groups);
  return plan;
}

}  // namespace tessera::ops
