// cuBLAS arguments of gemm_cuda's products (see gemm_plan.hpp).
#include "ops/linear/gemm_plan.hpp"

#include <algorithm>
#include <limits>

#include "core/errors.hpp"

namespace tessera::ops {

namespace {

void check_fits_int(int64_t value, const char* what) {
  check_arg(value <= std::numeric_limits<int>::max(), "matmul",
            "{} of {} exceeds cuBLAS's 32-bit arguments", what, value);
}

}  // namespace

CublasGemmPlan plan_cublas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                int64_t a_step, int64_t b_step, int64_t batches, bool accumulate) {
  CublasGemmPlan plan;
  if (m == 0 || n == 0 || batches == 0) return plan;
  if (k == 0) {
    // Empty products: C += 0 changes nothing, C = 0 is a memset. cuBLAS would reject the
    // leading dimension 0 of the operand whose stored rows are k.
    if (!accumulate) {
      plan.action = CublasGemmPlan::Action::zero;
      plan.zero_count = batches * m * n;
    }
    return plan;
  }
  plan.action = CublasGemmPlan::Action::gemm;
  plan.trans_first = trans_b;
  plan.trans_second = trans_a;
  plan.rows = n;
  plan.cols = m;
  plan.depth = k;
  // Column-major leading dims are the stored rows: B^T is n x k (k x n stored when B is
  // transposed), A^T is k x m (m x k stored), C^T is n x m. cuBLAS wants at least 1.
  plan.ld_first = std::max<int64_t>(1, trans_b ? k : n);
  plan.ld_second = std::max<int64_t>(1, trans_a ? m : k);
  plan.ld_out = std::max<int64_t>(1, n);
  // Accumulating every product into one C: one call per product (they would race in a batch).
  plan.calls = accumulate && batches > 1 ? batches : 1;
  plan.per_call = plan.calls == 1 ? batches : 1;
  plan.stride_first = b_step;
  plan.stride_second = a_step;
  plan.stride_out = accumulate ? 0 : m * n;
  plan.call_step_first = b_step;
  plan.call_step_second = a_step;
  check_fits_int(std::max({m, n, k}), "an extent");
  check_fits_int(std::max({plan.ld_first, plan.ld_second, plan.ld_out}), "a leading dimension");
  check_fits_int(plan.per_call, "a batch count");
  return plan;
}

}  // namespace tessera::ops
