// The pointwise ops as plain functions (each is apply_op of a registered op): unary relu, gelu,
// silu, tanh, exp, scale and binary add, sub, mul, div, bias_add with a broadcast operand.
#pragma once

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
/// a + b (b of a's shape, or replicated and broadcast numpy-style).
ShardTensor add(const ShardTensor& a, const ShardTensor& b);
/// a - b (as add).
ShardTensor sub(const ShardTensor& a, const ShardTensor& b);
/// a * b (as add).
ShardTensor mul(const ShardTensor& a, const ShardTensor& b);
/// a / b (as add).
ShardTensor div(const ShardTensor& a, const ShardTensor& b);
/// x[N, C, ...] + b[C] (b replicated, aligned with the channel dim).
ShardTensor bias_add(const ShardTensor& x, const ShardTensor& b);

}  // namespace tessera::ops
