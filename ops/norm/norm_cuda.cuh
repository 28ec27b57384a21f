// Launch interface of the normalization cuda kernels (device code in norm_cuda.cu, C++17 for
// nvcc). Statistics are f64 arrays as norm_kernels.hpp lays them out (moments [slots, 3],
// statistics [slots, 4], sums [slots, 2]); reductions run one block per slot (or channel, or
// column) with a fixed tree, so results are deterministic without atomics. Every launch is queued
// on `stream` and returns the launch status; none synchronizes. Elements are f32, f64, f16 or
// bf16 (f16/bf16 elementwise in float); operands are contiguous.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/norm/norm_geometry.hpp"
#include "ops/pointwise/pointwise_cuda.cuh"

namespace tessera::ops::kernels {

/// moments [slots, 3] (count, mean, M2) of the local piece x.
cudaError_t launch_norm_moments(const NormGeometry& g, ElementType type, const void* x,
                                double* moments, cudaStream_t stream);

/// statistics [slots, 4] from gathered [ranks, slots, 3], combined in rank order.
cudaError_t launch_norm_statistics(const double* gathered, int64_t ranks, int64_t slots, double eps,
                                   double* statistics, cudaStream_t stream);

/// statistics [channels, 4] from the running mean and variance (elements of `type`).
cudaError_t launch_norm_running_statistics(ElementType type, const void* mean, const void* var,
                                           int64_t channels, double eps, double* statistics,
                                           cudaStream_t stream);

/// The running statistics after a training step (momentum; the variance unbiased).
cudaError_t launch_norm_update_running(ElementType type, const double* statistics, const void* mean,
                                       const void* var, int64_t channels, double momentum,
                                       void* new_mean, void* new_var, cudaStream_t stream);

/// y = (x - mean) * rstd * w + b; w, b may be null.
cudaError_t launch_norm_forward(const NormGeometry& g, ElementType type, const void* x,
                                const double* statistics, const void* w, const void* b, void* y,
                                cudaStream_t stream);

/// sums [slots, 2] of dxhat and dxhat * xhat; dw, db (may be null) of the piece's channels
/// (per-plane affine) or positions (layer_norm).
cudaError_t launch_norm_backward_sums(const NormGeometry& g, ElementType type, const void* x,
                                      const void* dy, const double* statistics, const void* w,
                                      double* sums, void* dw, void* db, cudaStream_t stream);

/// out[i] = sum over r in order of gathered[r * count + i].
cudaError_t launch_norm_sum_ranks(const double* gathered, int64_t ranks, int64_t count, double* out,
                                  cudaStream_t stream);

/// dx from dy with the global sums (null: constant statistics, dx = rstd * dxhat).
cudaError_t launch_norm_backward_dx(const NormGeometry& g, ElementType type, const void* x,
                                    const void* dy, const double* statistics, const double* sums,
                                    const void* w, void* dx, cudaStream_t stream);

}  // namespace tessera::ops::kernels
