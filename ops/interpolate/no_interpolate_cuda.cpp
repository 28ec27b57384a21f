// The cuda bodies of interpolate in a build without CUDA: each throws NotAvailable.
#include "core/errors.hpp"
#include "ops/interpolate/interpolate_cuda.hpp"

namespace tessera::ops {

namespace {
[[noreturn]] void not_built() {
  throw NotAvailable("interpolate",
                     "cuda kernel asked for, but this Tessera was built without CUDA");
}
}  // namespace

Tensor interpolate_forward_cuda(const kernels::InterpPlan&, const Tensor&, const Shape&,
                                const Stream&) {
  not_built();
}

Tensor interpolate_backward_cuda(const kernels::InterpPlan&, const Shape&, const Tensor&,
                                 const Stream&) {
  not_built();
}

}  // namespace tessera::ops
