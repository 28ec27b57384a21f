// The cuda bodies of pad in a build without CUDA: each throws NotAvailable.
#include "core/errors.hpp"
#include "ops/pad/pad_cuda.hpp"

namespace tessera::ops {

namespace {
[[noreturn]] void not_built() {
  throw NotAvailable("pad", "cuda kernel asked for, but this Tessera was built without CUDA");
}
}  // namespace

Tensor pad_forward_cuda(const kernels::PadPlan&, const Tensor&, const Shape&, const Stream&) {
  not_built();
}

Tensor pad_backward_cuda(const kernels::PadPlan&, const Shape&, const Tensor&, const Stream&) {
  not_built();
}

}  // namespace tessera::ops
