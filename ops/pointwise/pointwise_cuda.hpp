// The cuda bodies of the pointwise ops (host side): pointwise_cuda.cpp launches the kernels of
// pointwise_cuda.cu on the given stream; a build without CUDA gets no_pointwise_cuda.cpp, where
// every function throws NotAvailable. Results are new contiguous tensors on the inputs' device;
// nothing synchronizes.
#pragma once

#include <string>
#include <utility>

#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"
#include "ops/pointwise/elementwise_plan.hpp"

namespace tessera::ops {

/// y = f(x) for the unary op `name` (relu, gelu, silu, tanh, exp, scale: factor * x).
Tensor unary_forward_cuda(const std::string& name, const Tensor& x, double factor,
                          const Stream& stream);

/// dx = f'(x, y) * g for the unary op `name` in one pass (x, y, g of one shape; the kernel reads
/// x or y, whichever the derivative needs, and g).
Tensor unary_backward_cuda(const std::string& name, const Tensor& x, const Tensor& y,
                           const Tensor& g, double factor, const Stream& stream);

/// a (op) b for the binary op `name` (add, sub, mul, div), b read over a's shape through
/// `b_view` (strides 0 where it broadcasts).
Tensor binary_forward_cuda(const std::string& name, const Tensor& a, const Tensor& b,
                           const OperandView& b_view, const Stream& stream);

/// The gradients of a and of b's view (both of a's shape) of the binary op `name` from g, in
/// one pass over a, b and g.
std::pair<Tensor, Tensor> binary_backward_cuda(const std::string& name, const Tensor& a,
                                               const Tensor& b, const OperandView& b_view,
                                               const Tensor& g, const Stream& stream);

/// reduce_to_operand (ops/pointwise/broadcast.hpp) on the device: `grad` (a_box's shape) summed
/// onto b's shape, zero outside a_box along non-broadcast dims; deterministic.
Tensor reduce_to_operand_cuda(const Tensor& grad, const Shape& b_shape, const Box& a_box,
                              int offset, const Stream& stream);

}  // namespace tessera::ops
