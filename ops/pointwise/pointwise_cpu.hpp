// The cpu bodies of the pointwise ops for f32 and f64: one typed, vectorised loop per op (f32 in
// float with vector_math.hpp, f64 in double with <cmath>, the formulas of pointwise_math.hpp),
// the backward fused into one pass over the saved tensor and g. Other dtypes return nullopt (the
// caller falls back to map_elements/zip_elements).
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "core/tensor.hpp"
#include "ops/pointwise/elementwise_plan.hpp"

namespace tessera::ops {

/// y = f(x) of the unary op `name` with parameters (a, b) (UnaryParams); contiguous result.
std::optional<Tensor> unary_forward_cpu(const std::string& name, const Tensor& x, double a,
                                        double b);

/// dx = f'(v) g, where v is y for the ops whose derivative reads the output
/// (UnaryMath::reads_output) and x for the others.
std::optional<Tensor> unary_backward_cpu(const std::string& name, const Tensor& v, const Tensor& g,
                                         double a, double b);

/// z = f(lead, other) (or f(other, lead) when `swapped`) of the binary op `name`, where `other` is
/// read through `view` over lead's shape (strides 0 along broadcast dims: nothing is expanded).
std::optional<Tensor> binary_forward_cpu(const std::string& name, const Tensor& lead,
                                         const Tensor& other, const OperandView& view,
                                         bool swapped);

/// The gradients {of lead, of other seen over lead's shape (full size)} of the binary op `name`
/// from g, in one pass over lead, other (through `view`) and g.
std::optional<std::pair<Tensor, Tensor>> binary_backward_cpu(const std::string& name,
                                                             const Tensor& lead,
                                                             const Tensor& other,
                                                             const OperandView& view,
                                                             const Tensor& g, bool swapped);

/// The sum of `grad` (contiguous, f32 or f64) over the dims where `view` has stride 0, into a
/// zeroed tensor of `operand_shape` read through `view` (the gradient of a broadcast operand);
/// sums in f64. Returns nullopt for other dtypes.
std::optional<Tensor> reduce_to_view_cpu(const Tensor& grad, const Shape& operand_shape,
                                         const OperandView& view);

/// cond != 0 ? a : b elementwise for operands of one shape and one dtype (f32 or f64); nullopt
/// otherwise.
std::optional<Tensor> select_typed_cpu(const Tensor& cond, const Tensor& a, const Tensor& b);

}  // namespace tessera::ops
