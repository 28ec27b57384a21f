// Plan of a deterministic sum over some dims of a strided array (sum, mean, mse_loss, and the
// gradient of a broadcast operand): which dims reduce (merged where adjacent), how kept and
// reduced indices map to memory, and how the work is split. The split depends only on the
// shapes, never on the device or launch timing, so one input gives bit-identical sums on every
// run. Plain C++17 with no project headers (the cuda launch interfaces use the struct); defined
// in reduce_plan.cpp and tested on cpu.
//
// Order of the sum of one output element (what makes it reproducible):
//  - thread_per_output: one thread adds the reduced elements in row-major order of the reduced
//    dims;
//  - block_per_chunk: the reduced elements are cut into `chunks` ranges of `chunk_length`
//    (row-major order); within a range, thread t of a block of `threads` adds elements t,
//    t + threads, ... in order, then the block combines its threads in a fixed binary tree;
//    a second pass adds the chunk sums in chunk order.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/pointwise/elementwise_plan.hpp"

namespace tessera::ops {

/// Most operands a reduction reads per element (mse_loss reads two).
constexpr int kMaxReduceOperands = 2;

/// How a reduction's work is split over threads.
enum class ReduceStrategy : int {
  thread_per_output,  ///< one thread sums each output (short reductions or many outputs)
  block_per_chunk,    ///< one block per (output, chunk), then one pass over the chunk sums
};

/// A reduction of operands shaped alike to outputs at the kept indices.
struct ReducePlan {
  int operands = 1;  ///< 1 (sum of x) or 2 (sum of (a - b)^2)
  int kept_ndim = 0;
  int64_t kept_extent[kMaxKernelDims] = {};
  int64_t kept_stride[kMaxReduceOperands][kMaxKernelDims] = {};  ///< operand strides
  int64_t out_stride[kMaxKernelDims] = {};                       ///< output strides
  int reduced_ndim = 0;
  int64_t reduced_extent[kMaxKernelDims] = {};
  int64_t reduced_stride[kMaxReduceOperands][kMaxKernelDims] = {};
  int64_t outputs = 0;       ///< number of output elements (product of the kept extents)
  int64_t reduce_count = 0;  ///< elements summed into each output
  ReduceStrategy strategy = ReduceStrategy::thread_per_output;
  int threads = 256;         ///< threads per block
  int64_t chunks = 1;        ///< block_per_chunk: ranges per output (1: no second pass)
  int64_t chunk_length = 0;  ///< block_per_chunk: reduced elements per range
};

/// Largest reduction one thread sums alone.
constexpr int64_t kThreadReduceLimit = 256;
/// Outputs from which every output gets one thread whatever the reduction length.
constexpr int64_t kThreadPerOutputFrom = 65536;
/// Reduced elements one block sums per chunk, at least.
constexpr int64_t kElementsPerChunk = 8192;
/// Most blocks of the first pass (more chunks only when outputs alone exceed it).
constexpr int64_t kMaxReduceBlocks = 4096;

/// The plan of summing operands of `shape` (strides per operand, elements) over the dims where
/// `reduced[d]` is true into an output with strides `out_strides` (one entry per dim of
/// `shape`; entries of reduced dims are ignored). Extent-1 dims are dropped and adjacent dims of
/// one kind merged when every operand (and the output, for kept dims) steps over them as one.
/// Throws InvalidArgument when more than kMaxKernelDims kept or reduced dims remain.
ReducePlan reduce_plan(const std::vector<int64_t>& shape,
                       const std::vector<std::vector<int64_t>>& operand_strides,
                       const std::vector<bool>& reduced, const std::vector<int64_t>& out_strides);

/// Elements of the chunk-sum workspace the plan needs (0 without a second pass).
int64_t reduce_workspace_elements(const ReducePlan& plan);

}  // namespace tessera::ops
