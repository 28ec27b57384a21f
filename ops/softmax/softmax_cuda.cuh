// Launch interface of the softmax cuda kernels (device code in softmax_cuda.cu, C++17 for nvcc).
// A piece is [outer, length, inner] around the softmax dim. The per-slot statistics (peak, total
// and the gradient's total): with inner > 1 one thread per slot (outer, inner), adjacent threads
// on adjacent inner positions (coalesced), walking the dim in order; with inner == 1 (a slot is
// a contiguous row) one warp per row, its lanes on adjacent elements, reduced across the warp.
// Outputs and gradients element by element. Statistics are f64; elements f32, f64, f16 or bf16.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/pointwise/pointwise_cuda.cuh"

namespace tessera::ops::kernels {

/// The slots of a piece.
struct SoftmaxSlots {
  int64_t outer = 1, length = 1, inner = 1;
};

/// peak[slot] = the largest element of the slot (NaN wins; -inf for an empty slot).
cudaError_t launch_softmax_peak(ElementType type, SoftmaxSlots s, const void* x, double* peak,
                                cudaStream_t stream);
/// total[slot] = sum of exp(x - peak[slot]) over the slot.
cudaError_t launch_softmax_total(ElementType type, SoftmaxSlots s, const void* x,
                                 const double* peak, double* total, cudaStream_t stream);
/// total[slot] = log(total[slot]): log_softmax's norms, once per slot.
cudaError_t launch_softmax_log_totals(double* total, int64_t slots, cudaStream_t stream);
/// y = exp(x - peak) / norm, or x - peak - norm when `log` (norm: the totals, their logs for
/// log_softmax from launch_softmax_log_totals).
cudaError_t launch_softmax_output(ElementType type, SoftmaxSlots s, const void* x,
                                  const double* peak, const double* norm, bool log, void* y,
                                  cudaStream_t stream);
/// total[slot] = sum of g * y (softmax) or of g (log_softmax) over the slot.
cudaError_t launch_softmax_grad_total(ElementType type, SoftmaxSlots s, const void* y,
                                      const void* g, bool log, double* total, cudaStream_t stream);
/// dx = y (g - total) (softmax) or g - exp(y) total (log_softmax).
cudaError_t launch_softmax_grad(ElementType type, SoftmaxSlots s, const void* y, const void* g,
                                const double* total, bool log, void* dx, cudaStream_t stream);
/// out[i] = the largest (max) or the sum in row order of gathered[r * count + i], r < ranks.
cudaError_t launch_combine_rows(const double* gathered, int64_t ranks, int64_t count, bool max,
                                double* out, cudaStream_t stream);

}  // namespace tessera::ops::kernels
