// The cuda products of linear and matmul in a build without CUDA: they throw NotAvailable.
#include "core/errors.hpp"
#include "ops/linear/linear_cuda.hpp"

namespace tessera::ops {

void gemm_cuda(bool, bool, int64_t, int64_t, int64_t, const Tensor&, int64_t, const Tensor&,
               int64_t, Tensor&, int64_t, bool, const Stream&) {
  throw NotAvailable("matmul", "cuda kernel asked for, but this Tessera was built without CUDA");
}

}  // namespace tessera::ops
