// Plain C++ conv kernels (the path without oneDNN, and the only path for f64). Private to
// ops/conv: callers go through conv_kernels.hpp, which validates and handles empty problems.
#pragma once

#include "core/tensor.hpp"
#include "ops/conv/conv_problem.hpp"

namespace tessera::ops {

// Preconditions of every function here: `problem` came from the dispatcher, no extent of it is
// zero, all tensors are contiguous cpu tensors of problem.dtype with the problem's shapes, and
// the output tensor is allocated (its contents are ignored and fully overwritten), and the
// problem is unpadded (the dispatcher writes a padded input out for the reference).

/// y = valid conv of x with w (+ bias when bias != nullptr).
void conv_forward_reference(const ConvProblem& problem, const Tensor& x, const Tensor& w,
                            const Tensor* bias, Tensor& y);
/// dx = adjoint of the forward conv in x, applied to dy.
void conv_backward_data_reference(const ConvProblem& problem, const Tensor& dy, const Tensor& w,
                                  Tensor& dx);
/// dw = adjoint of the forward conv in w, applied to dy.
void conv_backward_weight_reference(const ConvProblem& problem, const Tensor& x, const Tensor& dy,
                                    Tensor& dw);

}  // namespace tessera::ops
