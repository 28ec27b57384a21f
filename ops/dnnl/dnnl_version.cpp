// oneDNN version query and its sgemm.
#include <fmt/format.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include "core/errors.hpp"
#include "ops/dnnl/dnnl_support.hpp"

namespace tessera {

std::string dnnl_version() {
  const dnnl_version_t* version = ::dnnl_version();
  return fmt::format("{}.{}.{}", version->major, version->minor, version->patch);
}

bool dnnl_sgemm_row_major(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                          const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                          float* c, int64_t ldc, int threads) {
  // oneDNN's sgemm runs on as many OpenMP threads as the calling thread's next region would
  // get: the rank's share of the cores (or 1 inside a loop that is parallel already).
  omp_set_num_threads(threads);
  const dnnl_status_t status = ::dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k,
                                            alpha, a, lda, b, ldb, beta, c, ldc);
  if (status != dnnl_success)
    throw Error("matmul", fmt::format("oneDNN sgemm failed (status {})", static_cast<int>(status)));
  return true;
}

}  // namespace tessera
