// The optimizers' updates of cuda parameters (host side): optimizer_cuda.cpp launches the kernels
// of optimizer_cuda.cu on the parameter's compute stream; a build without CUDA gets
// no_optimizer_cuda.cpp, which throws NotAvailable. Operands are contiguous tensors of one dtype
// (float or double) on one device, updated in place; nothing synchronizes.
#pragma once

#include "core/tensor.hpp"
#include "ops/optim/update_rules.hpp"

namespace tessera::optim {

/// rules::Sgd over p (in place), grad and the momentum buffer b (nullptr without momentum).
template <typename T>
void sgd_update_cuda(const rules::Sgd<T>& rule, const Tensor& p, const Tensor& grad, Tensor* b);

/// rules::Adam over p (in place), grad, m, v and v_max (nullptr without amsgrad).
template <typename T>
void adam_update_cuda(const rules::Adam<T>& rule, const Tensor& p, const Tensor& grad, Tensor& m,
                      Tensor& v, Tensor* v_max);

}  // namespace tessera::optim
