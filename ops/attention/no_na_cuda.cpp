// The cuda bodies of neighborhood attention in a build without CUDA: they throw NotAvailable.
#include "core/errors.hpp"
#include "ops/attention/na_cuda.hpp"

namespace tessera::ops {

namespace {
[[noreturn]] void not_built() {
  throw NotAvailable("na", "cuda kernel asked for, but this Tessera was built without CUDA");
}
}  // namespace

kernels::NaKernel na_cuda_kernel_for(const Tensor&) {
  not_built();
}

int na_cuda_mma_forward_blocks() {
  not_built();
}

NaForward na_cuda_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor*,
                          const NaGeometry&, const NaPieces&, const Stream&,
                          std::optional<kernels::NaKernel>) {
  not_built();
}

NaGradients na_cuda_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor*,
                             const Tensor*, const Tensor&, const Tensor&, const Tensor*,
                             const NaGeometry&, const NaPieces&, const Stream&,
                             std::optional<kernels::NaKernel>) {
  not_built();
}

}  // namespace tessera::ops
