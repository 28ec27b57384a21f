// What the oneDNN CPU kernels report about themselves.
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

/// oneDNN version as "2.6.3", or "" when Tessera was built without oneDNN.
std::string dnnl_version();

/// C = alpha * op(A) op(B) + beta * C in f32, row-major, op = transpose where trans_* (oneDNN's
/// sgemm on `threads` OpenMP threads of the calling thread). Returns false, doing nothing, when
/// Tessera was built without oneDNN; throws when oneDNN reports an error.
bool dnnl_sgemm_row_major(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                          const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                          float* c, int64_t ldc, int threads);

}  // namespace tessera
