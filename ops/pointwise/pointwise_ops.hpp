// The pointwise ops as plain functions (each is apply_op of a registered op): unary relu, gelu,
// silu, tanh, exp, scale, sigmoid, softplus, leaky_relu, erf, sqrt, neg, abs, log, clamp; binary
// add, sub, mul, div, pow, maximum, minimum with numpy broadcasting (either operand may be the
// smaller), bias_add; and where(cond, a, b). PyTorch's formulas and gradients throughout.
#pragma once

#include <optional>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Elementwise max(x, 0).
ShardTensor relu(const ShardTensor& x);
/// Elementwise GELU (exact, erf form).
ShardTensor gelu(const ShardTensor& x);
/// Elementwise x * sigmoid(x).
ShardTensor silu(const ShardTensor& x);
/// Elementwise tanh.
ShardTensor tanh(const ShardTensor& x);
/// Elementwise exp.
ShardTensor exp(const ShardTensor& x);
/// Elementwise factor * x (keeps Partial layouts).
ShardTensor scale(const ShardTensor& x, double factor);
/// Elementwise 1 / (1 + exp(-x)).
ShardTensor sigmoid(const ShardTensor& x);
/// Elementwise log(1 + exp(beta x)) / beta, x itself where beta x > threshold.
ShardTensor softplus(const ShardTensor& x, double beta = 1, double threshold = 20);
/// Elementwise x where x > 0, negative_slope * x elsewhere.
ShardTensor leaky_relu(const ShardTensor& x, double negative_slope = 0.01);
/// Elementwise error function.
ShardTensor erf(const ShardTensor& x);
/// Elementwise square root.
ShardTensor sqrt(const ShardTensor& x);
/// Elementwise -x (keeps Partial layouts).
ShardTensor neg(const ShardTensor& x);
/// Elementwise |x| (gradient sign(x), 0 at 0).
ShardTensor abs(const ShardTensor& x);
/// Elementwise natural logarithm.
ShardTensor log(const ShardTensor& x);
/// Elementwise min(max(x, min), max); at least one bound is set.
ShardTensor clamp(const ShardTensor& x, std::optional<double> min, std::optional<double> max);
/// a + b (same shape, or broadcast numpy-style: the operand of the result's shape leads).
ShardTensor add(const ShardTensor& a, const ShardTensor& b);
/// a - b (as add).
ShardTensor sub(const ShardTensor& a, const ShardTensor& b);
/// a * b (as add).
ShardTensor mul(const ShardTensor& a, const ShardTensor& b);
/// a / b (as add).
ShardTensor div(const ShardTensor& a, const ShardTensor& b);
/// a ** b (as add).
ShardTensor pow(const ShardTensor& a, const ShardTensor& b);
/// Elementwise max of a and b, NaN propagating; a tie splits the gradient (as add).
ShardTensor maximum(const ShardTensor& a, const ShardTensor& b);
/// Elementwise min of a and b (as maximum).
ShardTensor minimum(const ShardTensor& a, const ShardTensor& b);
/// x[N, C, ...] + b[C] (b replicated, aligned with the channel dim).
ShardTensor bias_add(const ShardTensor& x, const ShardTensor& b);
/// cond != 0 ? a : b elementwise, the three broadcast together (cond of any dtype, no gradient).
ShardTensor where(const ShardTensor& cond, const ShardTensor& a, const ShardTensor& b);

}  // namespace tessera::ops
