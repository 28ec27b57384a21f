// Cost functions of the built-in ops (ops/op_costs.hpp).
#include "ops/op_costs.hpp"

namespace tessera::ops {

namespace {

double numel(const Tensor& tensor) {
  return static_cast<double>(tensor.numel());
}

/// The product of a per-spatial-dim attribute over `spatial` dims (one value: for all).
double window_of(const OpAttrs& attrs, const char* name, size_t spatial) {
  if (!attrs.has(name)) return 1;
  const std::vector<int64_t>& values = attrs.get_ints(name);
  double window = 1;
  for (size_t d = 0; d < spatial; ++d)
    window *= static_cast<double>(values.size() == 1  ? values[0]
                                  : d < values.size() ? values[d]
                                                      : 1);
  return window;
}

/// Elements of `tensor` per index of its first dim (1 for an empty or 0-d tensor).
double per_leading(const Tensor& tensor) {
  const Shape& shape = tensor.shape();
  if (shape.empty() || shape[0] == 0) return 1;
  return numel(tensor) / static_cast<double>(shape[0]);
}

}  // namespace

double bytes_of(const std::vector<Tensor>& tensors) {
  double bytes = 0;
  for (const Tensor& tensor : tensors)
    bytes += numel(tensor) * static_cast<double>(tensor.element_size());
  return bytes;
}

OpCost conv_cost(const KernelContext&, const std::vector<Tensor>& inputs,
                 const std::vector<Tensor>& outputs) {
  // Each output element is a dot product over the weight's C/groups * prod(k) taps.
  return {2 * numel(outputs.at(0)) * per_leading(inputs.at(1)),
          bytes_of(inputs) + bytes_of(outputs)};
}

OpCost conv_transpose_cost(const KernelContext&, const std::vector<Tensor>& inputs,
                           const std::vector<Tensor>& outputs) {
  // Each input element scatters into Cout/groups * prod(k) outputs.
  return {2 * numel(inputs.at(0)) * per_leading(inputs.at(1)),
          bytes_of(inputs) + bytes_of(outputs)};
}

OpCost matmul_cost(const KernelContext&, const std::vector<Tensor>& inputs,
                   const std::vector<Tensor>& outputs) {
  const Shape& a = inputs.at(0).shape();
  const double k = a.empty() ? 1 : static_cast<double>(a.back());
  return {2 * numel(outputs.at(0)) * k, bytes_of(inputs) + bytes_of(outputs)};
}

OpCost na_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
               const std::vector<Tensor>& outputs) {
  // q [B, spatial.., heads, D]: rank - 3 spatial axes.
  const size_t rank = inputs.at(0).shape().size();
  const size_t spatial = rank >= 3 ? rank - 3 : 0;
  return {4 * numel(inputs.at(0)) * window_of(context.attrs, "kernel_size", spatial),
          bytes_of(inputs) + bytes_of(outputs)};
}

OpCost attention_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
                      const std::vector<Tensor>& outputs) {
  // q, k, v [B, S, heads, D]: every query meets every key of the global sequence.
  double keys = 1;
  if (context.input_specs.size() > 1 && context.input_specs[1].global_shape.size() > 1)
    keys = static_cast<double>(context.input_specs[1].global_shape[1]);
  return {4 * numel(inputs.at(0)) * keys, bytes_of(inputs) + bytes_of(outputs)};
}

OpCost norm_cost(const KernelContext&, const std::vector<Tensor>& inputs,
                 const std::vector<Tensor>& outputs) {
  return {8 * numel(inputs.at(0)), bytes_of(inputs) + bytes_of(outputs)};
}

OpCost pointwise_cost(const KernelContext&, const std::vector<Tensor>& inputs,
                      const std::vector<Tensor>& outputs) {
  double flops = 0;
  for (const Tensor& output : outputs) flops += numel(output) * static_cast<double>(inputs.size());
  return {flops, bytes_of(inputs) + bytes_of(outputs)};
}

OpCost pool_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
                 const std::vector<Tensor>& outputs) {
  const size_t rank = outputs.at(0).shape().size();
  return {numel(outputs.at(0)) * window_of(context.attrs, "kernel_size", rank >= 2 ? rank - 2 : 0),
          bytes_of(inputs) + bytes_of(outputs)};
}

}  // namespace tessera::ops
