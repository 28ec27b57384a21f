// The cuda matrix products of linear and matmul: cuBLAS's strided batched GEMM on the rank's
// compute stream (linear_cuda.cpp), or a stub that throws NotAvailable in builds without CUDA
// (no_linear_cuda.cpp).
#pragma once

#include <cstdint>

#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"

namespace tessera::ops {

/// For i < batches: C_i = op(A_i) op(B_i) (+ C_i when `accumulate`), row-major, contiguous f32
/// or f64 cuda tensors of one dtype; A_i starts at element i * a_step of a (B_i likewise, a step
/// of 0 reuses one matrix), C_i at i * m * n of c (at 0 for every i when accumulating into one
/// C). m, n: C's rows and columns; k: the contracted extent. f32 computes in f32 (no TF32), f64
/// in f64. Queued on `stream`; nothing synchronizes.
void gemm_cuda(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const Tensor& a,
               int64_t a_step, const Tensor& b, int64_t b_step, Tensor& c, int64_t batches,
               bool accumulate, const Stream& stream);

}  // namespace tessera::ops
