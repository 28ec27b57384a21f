// Launch interface of the interpolate cuda kernels (device code in interpolate_cuda.cu, C++17 for
// nvcc): the forward with one thread per output, the backward with one thread per gradient cell
// adding into dx atomically (not deterministic in the last bits). Every launch is queued on
// `stream` and returns the launch status; none synchronizes. Elements are f32, f64, f16 or bf16
// (f16/bf16 compute in float); operands are contiguous [planes, in..] / [planes, out..].
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/interpolate/interpolate_taps.hpp"
#include "ops/pointwise/pointwise_cuda.cuh"

namespace tessera::ops::kernels {

/// y = the interpolation of x under `plan`.
cudaError_t launch_interpolate_forward(const InterpPlan& plan, ElementType type, const void* x,
                                       void* y, cudaStream_t stream);

/// dx += the gradient of x from gy of `type`; dx is in the computation type (f32 for f16/bf16
/// gradients, gy's type otherwise) and must be zeroed by the caller.
cudaError_t launch_interpolate_backward(const InterpPlan& plan, ElementType type, const void* gy,
                                        void* dx, cudaStream_t stream);

}  // namespace tessera::ops::kernels
