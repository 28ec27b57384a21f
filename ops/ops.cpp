// The built-in ops as plain functions, and their registration.
#include "ops/ops.hpp"

#include "core/op_registry.hpp"

namespace tessera {

namespace ops {
void register_pointwise_ops();
void register_reduce_ops();
void register_conv_op();
void register_na_op();

namespace {
ShardTensor unary(const char* name, const ShardTensor& x, const OpAttrs& attrs = {}) {
  return apply_op(name, {x}, attrs)[0];
}
ShardTensor binary(const char* name, const ShardTensor& a, const ShardTensor& b) {
  return apply_op(name, {a, b})[0];
}
ShardTensor reduction(const char* name, const ShardTensor& x, const std::vector<int64_t>& dims,
                      bool keepdim) {
  OpAttrs attrs;
  if (!dims.empty()) attrs.set("dims", dims);
  attrs.set("keepdim", int64_t{keepdim});
  return apply_op(name, {x}, attrs)[0];
}
}  // namespace

ShardTensor relu(const ShardTensor& x) {
  return unary("relu", x);
}
ShardTensor gelu(const ShardTensor& x) {
  return unary("gelu", x);
}
ShardTensor silu(const ShardTensor& x) {
  return unary("silu", x);
}
ShardTensor tanh(const ShardTensor& x) {
  return unary("tanh", x);
}
ShardTensor exp(const ShardTensor& x) {
  return unary("exp", x);
}
ShardTensor scale(const ShardTensor& x, double factor) {
  return unary("scale", x, OpAttrs().set("factor", factor));
}
ShardTensor add(const ShardTensor& a, const ShardTensor& b) {
  return binary("add", a, b);
}
ShardTensor sub(const ShardTensor& a, const ShardTensor& b) {
  return binary("sub", a, b);
}
ShardTensor mul(const ShardTensor& a, const ShardTensor& b) {
  return binary("mul", a, b);
}
ShardTensor div(const ShardTensor& a, const ShardTensor& b) {
  return binary("div", a, b);
}
ShardTensor bias_add(const ShardTensor& x, const ShardTensor& b) {
  return binary("bias_add", x, b);
}
ShardTensor sum(const ShardTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduction("sum", x, dims, keepdim);
}
ShardTensor mean(const ShardTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduction("mean", x, dims, keepdim);
}
ShardTensor mse_loss(const ShardTensor& a, const ShardTensor& b) {
  return binary("mse_loss", a, b);
}

}  // namespace ops

/// Registers the built-in ops through the same register_op a user calls (run once, lazily).
void register_builtin_ops() {
  ops::register_pointwise_ops();
  ops::register_reduce_ops();
  ops::register_conv_op();
  ops::register_na_op();
}

}  // namespace tessera
