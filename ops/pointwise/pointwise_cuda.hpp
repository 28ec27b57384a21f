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

/// y = f(x) for the unary op `name` with its parameters p0, p1 (UnaryParams of
/// pointwise_math.hpp: scale's factor, leaky_relu's slope, softplus's beta and threshold,
/// clamp's min and max).
Tensor unary_forward_cuda(const std::string& name, const Tensor& x, double p0, double p1,
                          const Stream& stream);

/// dx = f'(x, y) * g for the unary op `name` in one pass (x, y, g of one shape; the kernel reads
/// x or y, whichever the derivative needs, and g).
Tensor unary_backward_cuda(const std::string& name, const Tensor& x, const Tensor& y,
                           const Tensor& g, double p0, double p1, const Stream& stream);

/// lead (op) other, or other (op) lead when `swapped`, for the binary op `name` (add, sub, mul,
/// div, pow, maximum, minimum); `other` read over lead's shape through `other_view` (strides 0
/// where it broadcasts).
Tensor binary_forward_cuda(const std::string& name, const Tensor& lead, const Tensor& other,
                           const OperandView& other_view, bool swapped, const Stream& stream);

/// The gradients of lead and of other's view (both of lead's shape) of the binary op `name`
/// (operands ordered as in binary_forward_cuda) from g, in one pass over lead, other and g.
std::pair<Tensor, Tensor> binary_backward_cuda(const std::string& name, const Tensor& lead,
                                               const Tensor& other, const OperandView& other_view,
                                               const Tensor& g, bool swapped, const Stream& stream);

/// cond != 0 ? a : b for three tensors of one shape (cond of any dtype, a and b of one).
Tensor where_forward_cuda(const Tensor& cond, const Tensor& a, const Tensor& b,
                          const Stream& stream);

/// The gradients of where's a and b from g: cond != 0 ? g : 0 and cond != 0 ? 0 : g.
std::pair<Tensor, Tensor> where_backward_cuda(const Tensor& cond, const Tensor& g,
                                              const Stream& stream);

/// reduce_to_operand (ops/pointwise/broadcast.hpp) on the device: `grad` (a_box's shape) summed
/// onto b's shape, zero outside a_box along non-broadcast dims; deterministic.
Tensor reduce_to_operand_cuda(const Tensor& grad, const Shape& b_shape, const Box& a_box,
                              int offset, const Stream& stream);

}  // namespace tessera::ops
