// The arguments of cuBLAS's strided batched GEMM for the row-major products of gemm_cuda, as a
// plain function (tested on cpu): every degenerate shape (an extent of 0 in m, n or k) becomes
// an action cuBLAS never sees, and every leading dimension it does see obeys its rules.
#pragma once

#include <cstdint>

namespace tessera::ops {

/// How gemm_cuda computes C_i = op(A_i) op(B_i) (+ C_i when accumulating) for i < batches.
/// Row-major C (m x n) is the column-major C^T (n x m) = op(B)^T op(A)^T, so cuBLAS's first
/// operand is B and its second is A.
struct CublasGemmPlan {
  enum class Action {
    nothing,  ///< no element of C changes (m, n or batches is 0, or k is 0 while accumulating)
    zero,     ///< k is 0: every product is empty, C's first zero_count elements become 0
    gemm,     ///< `calls` cuBLAS calls of `per_call` products each
  };
  Action action = Action::nothing;
  int64_t zero_count = 0;
  bool trans_first = false, trans_second = false;   ///< op of cuBLAS's A (our B) and B (our A)
  int64_t rows = 0, cols = 0, depth = 0;            ///< cuBLAS's m, n, k: our n, m, k
  int64_t ld_first = 1, ld_second = 1, ld_out = 1;  ///< at least 1 and the stored rows
  int64_t stride_first = 0, stride_second = 0, stride_out = 0;  ///< between products of a call
  int64_t calls = 0, per_call = 0;
  int64_t call_step_first = 0, call_step_second = 0;  ///< elements between calls' first products
};

/// The plan of gemm_cuda's arguments (see linear_cuda.hpp). Throws InvalidArgument tagged
/// matmul when an extent, leading dimension or batch count does not fit cuBLAS's int.
CublasGemmPlan plan_cublas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                int64_t a_step, int64_t b_step, int64_t batches, bool accumulate);

}  // namespace tessera::ops
