// Launch interface of the pooling cuda kernels (device code in pool_cuda.cu, C++17 for nvcc):
// max and avg forward, and their backward as a gather (each input cell sums the gradient of the
// windows that route to it), deterministic without atomics. Every launch is queued on `stream`
// and returns the launch status; none synchronizes. Elements are f32, f64, f16 or bf16 (f16/bf16
// compute in float); operands are contiguous [planes, in..] / [planes, out..].
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/pointwise/pointwise_cuda.cuh"
#include "ops/pool/pool_windows.hpp"

namespace tessera::ops::kernels {

/// y = the pooling of x over `windows`; max also writes `indices` (one per output: the
/// pool_global_index of its window's maximum, -1 for a window with no real cell).
cudaError_t launch_pool_forward(const PoolWindows& windows, ElementType type, const void* x,
                                void* y, int64_t* indices, cudaStream_t stream);

/// dx = the gradient of x from gy (dx is fully written). Max pooling first writes every window's
/// argmax (a local input index, or -1) into `argmax` (one per output), then gathers.
cudaError_t launch_pool_backward(const PoolWindows& windows, ElementType type, const void* x,
                                 const void* gy, void* dx, int64_t* argmax, cudaStream_t stream);

}  // namespace tessera::ops::kernels
