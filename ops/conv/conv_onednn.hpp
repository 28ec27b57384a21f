// oneDNN conv kernels (f32). Implemented by conv_onednn.cpp, or by no_onednn_conv.cpp (which
// throws NotAvailable) when Tessera is built without oneDNN. Private to ops/conv.
#pragma once

#include "core/tensor.hpp"
#include "ops/conv/conv_problem.hpp"

namespace tessera::ops {

// Same preconditions as the reference kernels (conv_reference.hpp), and problem.dtype is f32.

/// y = conv of x (zero-padded as the problem says; oneDNN takes the padding itself) with w
/// (+ bias when bias != nullptr).
void conv_forward_onednn(const ConvProblem& problem, const Tensor& x, const Tensor& w,
                         const Tensor* bias, Tensor& y);
/// dx = adjoint of the forward conv in x, applied to dy.
void conv_backward_data_onednn(const ConvProblem& problem, const Tensor& dy, const Tensor& w,
                               Tensor& dx);
/// dw = adjoint of the forward conv in w, applied to dy.
void conv_backward_weight_onednn(const ConvProblem& problem, const Tensor& x, const Tensor& dy,
                                 Tensor& dw);

}  // namespace tessera::ops
