// The cuBLAS arguments of the cuda matmul (ops/linear/gemm_plan.hpp), checked on the cpu: a
// column-major strided batched GEMM written here after the BLAS definition, which rejects the
// arguments cuBLAS rejects (a leading dimension below max(1, stored rows)), runs every plan on
// random data, and the result must equal the row-major product C_i = op(A_i) op(B_i) (+ C_i)
// for every transpose pair, accumulate flag, batch step and extent of 0, 1 or more in m, n, k.
#include "ops/linear/gemm_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace tessera::ops {
namespace {

/// Column-major C_p = op(A_p) op(B_p) + beta C_p for p < batch (rows x cols, depth inner),
/// after BLAS's xGEMM; false (nothing written) where cuBLAS would report an illegal value.
bool column_major_gemm(bool trans_a, bool trans_b, int64_t rows, int64_t cols, int64_t depth,
                       const double* a, int64_t lda, int64_t stride_a, const double* b, int64_t ldb,
                       int64_t stride_b, double beta, double* c, int64_t ldc, int64_t stride_c,
                       int64_t batch) {
  if (rows < 0 || cols < 0 || depth < 0 || batch < 0) return false;
  if (lda < std::max<int64_t>(1, trans_a ? depth : rows)) return false;
  if (ldb < std::max<int64_t>(1, trans_b ? cols : depth)) return false;
  if (ldc < std::max<int64_t>(1, rows)) return false;
  for (int64_t p = 0; p < batch; ++p)
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t i = 0; i < rows; ++i) {
        double sum = 0;
        for (int64_t l = 0; l < depth; ++l) {
          const double x = trans_a ? a[p * stride_a + l + i * lda] : a[p * stride_a + i + l * lda];
          const double y = trans_b ? b[p * stride_b + j + l * ldb] : b[p * stride_b + l + j * ldb];
          sum += x * y;
        }
        double& out = c[p * stride_c + i + j * ldc];
        out = sum + (beta == 0 ? 0.0 : beta * out);
      }
  return true;
}

/// C as gemm_cuda computes it from `plan` (a memset, nothing, or the calls), run on the host.
std::vector<double> run_plan(const CublasGemmPlan& plan, const std::vector<double>& a,
                             const std::vector<double>& b, std::vector<double> c, bool accumulate,
                             bool* legal) {
  *legal = true;
  if (plan.action == CublasGemmPlan::Action::zero)
    std::fill(c.begin(), c.begin() + plan.zero_count, 0.0);
  if (plan.action != CublasGemmPlan::Action::gemm) return c;
  for (int64_t call = 0; call < plan.calls; ++call)
    *legal = *legal &&
             column_major_gemm(plan.trans_first, plan.trans_second, plan.rows, plan.cols,
                               plan.depth, b.data() + call * plan.call_step_first, plan.ld_first,
                               plan.stride_first, a.data() + call * plan.call_step_second,
                               plan.ld_second, plan.stride_second, accumulate ? 1.0 : 0.0, c.data(),
                               plan.ld_out, plan.stride_out, plan.per_call);
  return c;
}

/// The row-major products of linear_cuda.hpp's contract, directly.
std::vector<double> expected(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                             const std::vector<double>& a, int64_t a_step,
                             const std::vector<double>& b, int64_t b_step, std::vector<double> c,
                             int64_t batches, bool accumulate) {
  for (int64_t p = 0; p < batches; ++p) {
    double* out = c.data() + (accumulate ? 0 : p * m * n);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0;
        for (int64_t l = 0; l < k; ++l)
          sum += (trans_a ? a[p * a_step + l * m + i] : a[p * a_step + i * k + l]) *
                 (trans_b ? b[p * b_step + j * k + l] : b[p * b_step + l * n + j]);
        out[i * n + j] = (accumulate ? out[i * n + j] : 0.0) + sum;
      }
  }
  return c;
}

TEST(CublasGemmPlan, EveryShapeIncludingEmptyOnesIsLegalAndComputesTheRowMajorProduct) {
  std::mt19937 random(7);
  std::uniform_real_distribution<double> value(-2.0, 2.0);
  auto fill = [&](int64_t count) {
    std::vector<double> v(static_cast<size_t>(std::max<int64_t>(count, 1)));
    for (double& x : v) x = value(random);
    return v;
  };
  int gemms = 0, zeros = 0, nothings = 0;
  for (int64_t m : {0, 1, 3})
    for (int64_t n : {0, 1, 4})
      for (int64_t k : {0, 1, 5})
        for (int64_t batches : {0, 1, 3})
          for (bool shared_b : {false, true})
            for (int trans = 0; trans < 4; ++trans)
              for (bool accumulate : {false, true}) {
                const bool trans_a = trans & 1, trans_b = trans & 2;
                const int64_t a_step = m * k, b_step = shared_b ? 0 : k * n;
                const auto a = fill(std::max<int64_t>(batches, 1) * m * k);
                const auto b = fill(std::max<int64_t>(batches, 1) * k * n);
                const auto c = fill(std::max<int64_t>(batches, 1) * m * n);
                const std::string what = "m " + std::to_string(m) + " n " + std::to_string(n) +
                                         " k " + std::to_string(k) + " batches " +
                                         std::to_string(batches) + " trans " +
                                         std::to_string(trans) + (accumulate ? " accumulate" : "") +
                                         (shared_b ? " shared b" : "");
                const CublasGemmPlan plan = plan_cublas_gemm(trans_a, trans_b, m, n, k, a_step,
                                                             b_step, batches, accumulate);
                gemms += plan.action == CublasGemmPlan::Action::gemm;
                zeros += plan.action == CublasGemmPlan::Action::zero;
                nothings += plan.action == CublasGemmPlan::Action::nothing;
                if (plan.action == CublasGemmPlan::Action::gemm) {
                  EXPECT_GT(plan.rows, 0) << what;
                  EXPECT_GT(plan.cols, 0) << what;
                  EXPECT_GT(plan.depth, 0) << what;
                }
                bool legal = false;
                const auto got = run_plan(plan, a, b, c, accumulate, &legal);
                EXPECT_TRUE(legal) << what;
                const auto want = expected(trans_a, trans_b, m, n, k, a, a_step, b, b_step, c,
                                           batches, accumulate);
                ASSERT_EQ(got.size(), want.size()) << what;
                for (size_t i = 0; i < got.size(); ++i)
                  ASSERT_NEAR(got[i], want[i], 1e-12 * std::max(1.0, std::abs(want[i])))
                      << what << ": element " << i;
              }
  // Every action occurs.
  EXPECT_GT(gemms, 0);
  EXPECT_GT(zeros, 0);
  EXPECT_GT(nothings, 0);
}

TEST(CublasGemmPlan, AnEmptyContractionZeroesCOrLeavesItWhenAccumulating) {
  const CublasGemmPlan zero = plan_cublas_gemm(false, false, 3, 4, 0, 0, 0, 2, false);
  EXPECT_EQ(zero.action, CublasGemmPlan::Action::zero);
  EXPECT_EQ(zero.zero_count, 24);
  EXPECT_EQ(plan_cublas_gemm(true, true, 3, 4, 0, 0, 0, 2, true).action,
            CublasGemmPlan::Action::nothing);
}

TEST(CublasGemmPlan, ExtentsBeyondCublasIntAreRejected) {
  EXPECT_THROW(plan_cublas_gemm(false, false, int64_t{1} << 32, 1, 1, 0, 0, 1, false),
               std::exception);
}

}  // namespace
}  // namespace tessera::ops
