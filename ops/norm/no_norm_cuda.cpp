// The cuda bodies of the normalizations in a build without CUDA: each throws NotAvailable.
#include "core/errors.hpp"
#include "ops/norm/norm_kernels.hpp"

namespace tessera::ops {

namespace {
[[noreturn]] void not_built() {
  throw NotAvailable("norm", "cuda kernel asked for, but this Tessera was built without CUDA");
}
}  // namespace

Tensor norm_moments_cuda(const kernels::NormGeometry&, const Tensor&, const Stream&) {
  not_built();
}

Tensor norm_statistics_cuda(const Tensor&, double, const Stream&) {
  not_built();
}

Tensor norm_running_statistics_cuda(const Tensor&, const Tensor&, double, const Stream&) {
  not_built();
}

std::pair<Tensor, Tensor> norm_update_running_cuda(const Tensor&, const Tensor&, const Tensor&,
                                                   double, const Stream&) {
  not_built();
}

Tensor norm_forward_cuda(const kernels::NormGeometry&, const Tensor&, const Tensor&,
                         const std::optional<Tensor>&, const std::optional<Tensor>&,
                         const Stream&) {
  not_built();
}

Tensor norm_backward_sums_cuda(const kernels::NormGeometry&, const Tensor&, const Tensor&,
                               const Tensor&, const std::optional<Tensor>&, bool, bool,
                               NormParamGrads&, const Stream&) {
  not_built();
}

Tensor norm_sum_ranks_cuda(const Tensor&, const Stream&) {
  not_built();
}

Tensor norm_backward_dx_cuda(const kernels::NormGeometry&, const Tensor&, const Tensor&,
                             const Tensor&, const std::optional<Tensor>&,
                             const std::optional<Tensor>&, const Stream&) {
  not_built();
}

}  // namespace tessera::ops
