// The optimizers' cuda updates in a build without CUDA: each throws NotAvailable.
#include "core/errors.hpp"
#include "ops/optim/optimizer_cuda.hpp"

namespace tessera::optim {

namespace {
[[noreturn]] void not_built() {
  throw NotAvailable("optimizer",
                     "update of a cuda parameter asked for, but this Tessera was built without "
                     "CUDA");
}
}  // namespace

template <typename T>
void sgd_update_cuda(const rules::Sgd<T>&, const Tensor&, const Tensor&, Tensor*) {
  not_built();
}

template <typename T>
void adam_update_cuda(const rules::Adam<T>&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                      Tensor*) {
  not_built();
}

template void sgd_update_cuda<float>(const rules::Sgd<float>&, const Tensor&, const Tensor&,
                                     Tensor*);
template void sgd_update_cuda<double>(const rules::Sgd<double>&, const Tensor&, const Tensor&,
                                      Tensor*);
template void adam_update_cuda<float>(const rules::Adam<float>&, const Tensor&, const Tensor&,
                                      Tensor&, Tensor&, Tensor*);
template void adam_update_cuda<double>(const rules::Adam<double>&, const Tensor&, const Tensor&,
                                       Tensor&, Tensor&, Tensor*);

}  // namespace tessera::optim
