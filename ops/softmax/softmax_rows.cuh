// The per-row statistics of softmax and log_softmax along a contiguous dim (inner == 1: each
// slot is a row of `length` adjacent elements, as the last dim of attention scores), one warp per
// row: its lanes read adjacent elements (one thread per row would read `length` apart from its
// neighbours) and the warp's partial results are combined by a butterfly of shuffles, after which
// every lane holds the same bits (each step adds or compares the same two values on both
// sides). Device code for softmax_cuda.cu; kept in a header so that the unit tests run it on the
// cpu under tests/emu/cuda_block_emulator.hpp. Statistics in f64; elements f32, f64, f16, bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda_elements.cuh"
#include "ops/softmax/softmax_cuda.cuh"

namespace tessera::ops::kernels::rows {

#if defined(TESSERA_NA_EMULATE)
using std::exp;  // the device's math functions, for the host compiler of the emulated tests
using std::isnan;
#endif

/// An element widened to f64 (through its computation type).
template <typename T>
__device__ __forceinline__ double widen(T v) {
  return static_cast<double>(to_compute(v));
}

/// The largest of the warp's values (NaN if any lane's is NaN), on every lane.
__device__ __forceinline__ double warp_max(double v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const double other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = isnan(v) ? v : (isnan(other) || other > v ? other : v);
  }
  return v;
}

/// The sum of the warp's values, the same bits on every lane.
__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

/// Calls body(row, lane) for this warp's rows (a grid-stride loop over the warps); the row is
/// the same on all 32 lanes, so the shuffles inside body see the whole warp. Blocks of a multiple
/// of 32 threads.
template <typename Body>
__device__ __forceinline__ void for_warp_rows(int64_t rows, const Body& body) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t row = int64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32; row < rows;
       row += warps)
    body(row, lane);
}

/// peak[row] = the largest element of the row (NaN wins; -inf for an empty row).
template <typename T>
__global__ void row_peak_kernel(SoftmaxSlots s, const T* x, double* peak) {
  for_warp_rows(s.outer, [&](int64_t row, int lane) {
    const T* r = x + row * s.length;
    double best = -INFINITY;
    for (int64_t l = lane; l < s.length; l += 32) {
      const double v = widen(r[l]);
      if (isnan(v) || v > best) best = v;
    }
    best = warp_max(best);
    if (lane == 0) peak[row] = best;
  });
}

/// total[row] = the sum of exp(x - peak[row]) over the row.
template <typename T>
__global__ void row_total_kernel(SoftmaxSlots s, const T* x, const double* peak, double* total) {
  for_warp_rows(s.outer, [&](int64_t row, int lane) {
    const T* r = x + row * s.length;
    const double p = peak[row];
    double sum = 0;
    for (int64_t l = lane; l < s.length; l += 32) sum += exp(widen(r[l]) - p);
    sum = warp_sum(sum);
    if (lane == 0) total[row] = sum;
  });
}

/// total[row] = the sum of g (log_softmax) or of g * y (softmax) over the row.
template <typename T>
__global__ void row_grad_total_kernel(SoftmaxSlots s, const T* y, const T* g, bool log_output,
                                      double* total) {
  for_warp_rows(s.outer, [&](int64_t row, int lane) {
    const int64_t base = row * s.length;
    double sum = 0;
    for (int64_t l = lane; l < s.length; l += 32)
      sum += log_output ? widen(g[base + l]) : widen(g[base + l]) * widen(y[base + l]);
    sum = warp_sum(sum);
    if (lane == 0) total[row] = sum;
  });
}

}  // namespace tessera::ops::kernels::rows
