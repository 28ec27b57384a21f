// Plan of the conv bias gradient on cuda, db[c] = sum of dy[n, c, s..] over n and every spatial
// position, for dy of any strides (channels-first, channels-last, a box of a haloed buffer).
// cuDNN's legacy cudnnConvolutionBackwardBias does not take f16 or bf16, so every dtype runs
// this one reduction (ops/conv/conv_bias_cuda.cu). It reads dy once and uses no atomics: the
// plan is a function of the shape, the strides and the element size only, and so is the order
// of every sum, so one input gives bit-identical db on every run (whatever the addresses).
//
// Order of the sum of one channel: the reduced dims (extent-1 dims dropped, sorted by
// decreasing stride, adjacent ones merged) are walked as `groups` of `vector` consecutive
// elements (vector > 1 only when the innermost reduced dim is contiguous and a multiple of it
// long; a group is read with one 16-byte load when its address allows, else element by element,
// in the same order). The groups are cut into `chunks` ranges of `chunk_groups`; in a range,
// walker w of a block adds groups w, w + walkers, ... in order, the walkers are combined in a
// fixed binary tree, and (chunks > 1) a second pass adds the chunk sums in chunk order. A block
// serves `lanes` adjacent channels (lanes > 1 when channels are the innermost memory dim, so a
// warp reads adjacent channels).
//
// Plain C++17 with no project headers (the kernels include it); the index functions are
// host-and-device so that the cpu unit tests check the code the kernels run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define TESSERA_BIAS_HD __host__ __device__ __forceinline__
#else
#define TESSERA_BIAS_HD inline
#endif
// The index loops run over a fixed number of dims (skipping those past plan.ndim) and unroll in
// device code, so a walker's multi-index lives in registers, not in local memory.
#if defined(__CUDA_ARCH__)
#define TESSERA_BIAS_UNROLL _Pragma("unroll")
#else
#define TESSERA_BIAS_UNROLL
#endif

namespace tessera::ops {

/// Most reduced dims after merging: N and three spatial dims.
constexpr int kBiasGradMaxDims = 4;
/// Threads per block of the bias gradient kernel.
constexpr int kBiasGradThreads = 256;
/// Bytes of one vector load.
constexpr int kBiasGradVectorBytes = 16;
/// Elements (summed, all lanes together) one block reads per chunk, about.
constexpr int64_t kBiasGradBlockElements = 4096;
/// Most blocks of the first pass (more only when the channel groups alone exceed it).
constexpr int64_t kBiasGradMaxBlocks = 4096;

/// How the bias gradient of one dy is computed (see the file comment).
struct BiasGradPlan {
  int64_t channels = 0;
  int64_t channel_stride = 0;             ///< dy's stride of dim 1 (elements)
  int64_t out_stride = 1;                 ///< db's stride (elements)
  int ndim = 1;                           ///< reduced dims, outermost first, in group units
  int64_t extent[kBiasGradMaxDims] = {};  ///< innermost: groups per row
  int64_t stride[kBiasGradMaxDims] = {};  ///< element stride of one step of each dim
  /// Digits of one walker step (`walkers` groups) in the mixed radix of `extent` (the outermost
  /// digit unbounded): advancing is an add with carry, no division.
  int64_t step[kBiasGradMaxDims] = {};
  int vector = 1;                  ///< elements per group (contiguous when > 1)
  int64_t groups = 0;              ///< groups per channel (reduced elements / vector)
  int lanes = 1;                   ///< channels per block
  int walkers = kBiasGradThreads;  ///< threads per channel in a block (threads / lanes)
  int64_t channel_groups = 0;      ///< blocks per chunk: ceil(channels / lanes)
  int64_t chunks = 1;              ///< ranges of groups per channel (1: no second pass)
  int64_t chunk_groups = 0;        ///< groups per range
};

/// The plan for dy of `shape` [N, C, spatial..] (2 to 5 dims) and `strides` (elements, >= 0,
/// 0 included), db with stride `out_stride`, elements of `element_size` bytes. Throws
/// InvalidArgument (op conv) when dy has fewer than 2 dims, shape and strides disagree, or an
/// extent or stride is negative.
BiasGradPlan bias_grad_plan(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                            int64_t out_stride, size_t element_size);

/// Accumulators of the chunk-sum workspace (0 without a second pass).
inline int64_t bias_grad_workspace_elements(const BiasGradPlan& plan) {
  return plan.chunks > 1 ? plan.channels * plan.chunks : 0;
}

/// The multi-index (group units) of group `g` of a channel.
TESSERA_BIAS_HD void bias_grad_index(const BiasGradPlan& plan, int64_t g, int64_t* index) {
  TESSERA_BIAS_UNROLL
  for (int d = kBiasGradMaxDims - 1; d > 0; --d)
    if (d < plan.ndim) {
      index[d] = g % plan.extent[d];
      g /= plan.extent[d];
    }
  index[0] = g;
}

/// Element offset (from the channel's first element) of the group at `index`.
TESSERA_BIAS_HD int64_t bias_grad_offset(const BiasGradPlan& plan, const int64_t* index) {
  int64_t offset = 0;
  TESSERA_BIAS_UNROLL
  for (int d = 0; d < kBiasGradMaxDims; ++d)
    if (d < plan.ndim) offset += index[d] * plan.stride[d];
  return offset;
}

/// Moves `index` on by one walker step (plan.walkers groups).
TESSERA_BIAS_HD void bias_grad_advance(const BiasGradPlan& plan, int64_t* index) {
  int64_t carry = 0;
  TESSERA_BIAS_UNROLL
  for (int d = kBiasGradMaxDims - 1; d > 0; --d)
    if (d < plan.ndim) {
      index[d] += plan.step[d] + carry;
      carry = index[d] >= plan.extent[d] ? 1 : 0;
      if (carry != 0) index[d] -= plan.extent[d];
    }
  index[0] += plan.step[0] + carry;
}

}  // namespace tessera::ops
