// The cuda bodies of the pooling ops in a build without CUDA: each throws NotAvailable.
#include "core/errors.hpp"
#include "ops/pool/pool_cuda.hpp"

namespace tessera::ops {

namespace {
[[noreturn]] void not_built(const kernels::PoolWindows& windows) {
  throw NotAvailable(windows.kind == kernels::PoolKind::max ? "max_pool" : "avg_pool",
                     "cuda kernel asked for, but this Tessera was built without CUDA");
}
}  // namespace

std::vector<Tensor> pool_forward_cuda(const kernels::PoolWindows& windows, const Tensor&,
                                      const Shape&, const Stream&) {
  not_built(windows);
}

Tensor pool_backward_cuda(const kernels::PoolWindows& windows, const Tensor&, const Tensor&,
                          const Stream&) {
  not_built(windows);
}

}  // namespace tessera::ops
