// The optimizers' updates of cuda parameters (optimizer_cuda.hpp): checks, then one launch on
// the parameter device's compute stream.
#include "ops/optim/optimizer_cuda.hpp"

#include "core/runtime/rank_context.hpp"
#include "ops/cuda_support.hpp"
#include "ops/optim/optimizer_cuda.cuh"

namespace tessera::optim {

namespace {

void require_operands(const std::vector<const Tensor*>& tensors, const Tensor& p) {
  for (const Tensor* tensor : tensors) {
    if (tensor == nullptr) continue;
    TESSERA_CHECK_ARG(tensor->device() == p.device() && tensor->dtype() == p.dtype() &&
                          tensor->shape() == p.shape() && tensor->is_contiguous(),
                      "optimizer",
                      "operand {} of the update of {} (expected contiguous, same shape, "
                      "dtype and device)",
                      tensor->str(), p.str());
  }
}

}  // namespace

template <typename T>
void sgd_update_cuda(const rules::Sgd<T>& rule, const Tensor& p, const Tensor& grad, Tensor* b) {
  require_operands({&p, &grad, b}, p);
  const Stream stream = compute_stream_for(p.device());
  ops::check_launch(
      kernels::launch_sgd<T>(rule, p.data<T>(), grad.data<T>(), b ? b->data<T>() : nullptr,
                             p.numel(), ops::stream_handle(stream)),
      "sgd", p.device(), "update");
}

template <typename T>
void adam_update_cuda(const rules::Adam<T>& rule, const Tensor& p, const Tensor& grad, Tensor& m,
                      Tensor& v, Tensor* v_max) {
  require_operands({&p, &grad, &m, &v, v_max}, p);
  const Stream stream = compute_stream_for(p.device());
  ops::check_launch(kernels::launch_adam<T>(rule, p.data<T>(), grad.data<T>(), m.data<T>(),
                                            v.data<T>(), v_max ? v_max->data<T>() : nullptr,
                                            p.numel(), ops::stream_handle(stream)),
                    rule.decoupled ? "adamw" : "adam", p.device(), "update");
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
