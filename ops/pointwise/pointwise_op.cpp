// Pointwise ops: unary (relu, gelu, silu, tanh, exp, scale) and binary (add, sub, mul, div,
// bias_add) with a replicated operand broadcast. Rules, cpu kernels and backward.
//
// Layouts: a unary op keeps its input's layout (a non-linear one reduces Partial dims first).
// A binary op of two tensors of one global shape moves b to a's layout; a broadcast operand b
// is replicated and each rank uses the slice matching its local box. Gradients of a broadcast
// operand are local sums over each rank's box: Partial(sum) along mesh dims that shard a.
//
// Devices: cpu kernels and backward compute through map_elements/zip_elements on the host; on
// cuda the same ops run the kernels of pointwise_cuda.hpp on the rank's compute stream (the
// backward fused: one pass over the saved tensors and g).
#include <fmt/format.h>

#include "core/autograd.hpp"
#include "ops/op_helpers.hpp"
#include "ops/pointwise/broadcast.hpp"
#include "ops/pointwise/pointwise_cuda.hpp"
#include "ops/pointwise/pointwise_math.hpp"
#include "ops/pointwise/pointwise_ops.hpp"

namespace tessera::ops {

namespace {

/// One line per unary op, for `tessera ops`.
std::string unary_summary(const std::string& name) {
  if (name == "relu") return "Elementwise max(x, 0)";
  if (name == "gelu") return "Elementwise GELU (exact, erf form)";
  if (name == "silu") return "Elementwise x * sigmoid(x)";
  if (name == "tanh") return "Elementwise tanh";
  if (name == "exp") return "Elementwise exp";
  if (name == "scale") return "Elementwise factor * x (keeps Partial layouts)";
  return "Elementwise " + name;
}

void register_unary(const UnaryMath& math) {
  std::vector<OpAttr> attrs;
  if (std::string(math.name) == "scale")
    attrs.push_back(
        {.name = "factor", .type = AttrType::float_scalar, .required = true, .doc = "the factor"});
  RuleFn rule = [&math](const std::vector<ShardSpec>& inputs, const OpAttrs&) {
    const ShardSpec layout = math.linear ? inputs[0] : without_partial(inputs[0]);
    return OpRule{{layout}, {std::nullopt}, {layout}};
  };
  KernelFn cpu = [&math](const KernelContext& context, const std::vector<Tensor>& inputs) {
    require_floating_cpu(inputs[0], math.name);
    const double a = context.attrs.has("factor") ? context.attrs.get_double("factor") : 1.0;
    return std::vector<Tensor>{
        map_elements(inputs[0], [&](double x) { return math.forward(x, a); })};
  };
  KernelFn cuda = [&math](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const double a = context.attrs.has("factor") ? context.attrs.get_double("factor") : 1.0;
    return std::vector<Tensor>{unary_forward_cuda(math.name, inputs[0], a, context.stream)};
  };
  BackwardFn backward = [&math](const OpRecord& record,
                                const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const double a = record.attrs.has("factor") ? record.attrs.get_double("factor") : 1.0;
    if (math.linear) {  // dx = f'(.) g in g's own layout
      const ShardTensor& g = *grads[0];
      const Tensor& g_local = g.to_local();
      const Tensor dx =
          g_local.device().is_cuda()
              ? unary_backward_cuda(math.name, g_local, g_local, g_local, a,
                                    compute_stream_for(g_local.device()))
              : map_elements(g_local, [&](double v) { return math.derivative(0, 0, a) * v; });
      return {ShardTensor(dx, g.mesh(), g.spec())};
    }
    const ShardTensor& x = record.inputs[0];
    const ShardTensor g = grads[0]->redistribute(x.placements(), x.spec().extents);
    const Tensor& x_local = x.to_local();
    const Tensor& y = record.outputs[0].to_local();
    if (x_local.device().is_cuda())
      return {ShardTensor(unary_backward_cuda(math.name, x_local, y, g.to_local(), a,
                                              compute_stream_for(x_local.device())),
                          x.mesh(), x.spec())};
    const Tensor xy =
        zip_elements(x_local, y, [&](double xv, double yv) { return math.derivative(xv, yv, a); });
    return {ShardTensor(zip_elements(xy, g.to_local(), [](double d, double gv) { return d * gv; }),
                        x.mesh(), x.spec())};
  };
  register_op(OpDef{.name = math.name,
                    .summary = unary_summary(math.name),
                    .inputs = {{.name = "x"}},
                    .outputs = {"y"},
                    .attrs = std::move(attrs),
                    .rule = std::move(rule),
                    .cpu = std::move(cpu),
                    .cuda = std::move(cuda),
                    .backward = std::move(backward)});
}

/// Offset of b's dims inside a, from the attrs ("align": -1 = numpy right alignment).
int operand_offset(const Shape& a, const Shape& b, const OpAttrs& attrs, const std::string& op) {
  return a == b && !attrs.has("align") ? 0 : broadcast_offset(a, b, attrs.get_int("align", -1), op);
}

/// b seen over a's local box (the global box `a_box`): through stride 0 along broadcast dims,
/// or b itself when the operands share one shape.
OperandView operand_view(const Tensor& a, const Tensor& b, bool broadcast, const Box& a_box,
                         int offset, const std::string& op) {
  if (broadcast) return broadcast_operand_view(b.shape(), b.strides(), a_box.lo, offset);
  check_arg(a.shape() == b.shape(), op, "elementwise {} and {}", a.str(), b.str());
  return OperandView{b.strides(), 0};
}

/// One line per binary op, for `tessera ops`.
std::string binary_summary(const std::string& name) {
  if (name == "bias_add") return "x[N, C, ...] + b[C] (b replicated, aligned with dim 1)";
  const char* symbol = name == "add" ? "+" : name == "sub" ? "-" : name == "mul" ? "*" : "/";
  return fmt::format("a {} b (b of a's shape, or broadcast numpy-style)", symbol);
}

void register_binary(const BinaryMath& math, const std::string& name, int64_t default_align) {
  const bool bias = name == "bias_add";
  auto attrs_with_align = [default_align](OpAttrs attrs) {
    if (default_align >= 0 && !attrs.has("align")) attrs.set("align", default_align);
    return attrs;
  };
  RuleFn rule = [&math, name, attrs_with_align](const std::vector<ShardSpec>& inputs,
                                                const OpAttrs& given) {
    check_arg(inputs.size() == 2, name, "expects 2 inputs, got {}", inputs.size());
    const OpAttrs attrs = attrs_with_align(given);
    const ShardSpec& a = inputs[0];
    const ShardSpec& b = inputs[1];
    if (a.global_shape == b.global_shape && !attrs.has("align")) {
      const bool keep_partial = math.linear && a == b;
      const ShardSpec layout = keep_partial ? a : without_partial(a);
      return OpRule{{layout, layout}, {std::nullopt, std::nullopt}, {layout}};
    }
    operand_offset(a.global_shape, b.global_shape, attrs, name);  // validates
    const ShardSpec layout = without_partial(a);
    const ShardSpec replicated =
        ShardSpec::make(b.global_shape, b.mesh_shape,
                        std::vector<Placement>(b.mesh_shape.size(), Placement::replicate()));
    return OpRule{{layout, replicated}, {std::nullopt, std::nullopt}, {layout}};
  };
  KernelFn cpu = [&math, name, attrs_with_align](const KernelContext& context,
                                                 const std::vector<Tensor>& inputs) {
    require_floating_cpu(inputs[0], name);
    const Tensor& a = inputs[0];
    Tensor b = inputs[1];
    check_arg(a.dtype() == b.dtype(), name, "operands of dtypes {} and {}", dtype_name(a.dtype()),
              dtype_name(b.dtype()));
    const OpAttrs attrs = attrs_with_align(context.attrs);
    const Shape& a_global = context.input_specs[0].global_shape;
    const Shape& b_global = context.input_specs[1].global_shape;
    if (!(a_global == b_global && !attrs.has("align")))
      b = expand_to_box(b, context.input_boxes[0], operand_offset(a_global, b_global, attrs, name));
    return std::vector<Tensor>{zip_elements(a, b, math.forward)};
  };
  KernelFn cuda = [name, attrs_with_align](const KernelContext& context,
                                           const std::vector<Tensor>& inputs) {
    const Tensor& a = inputs[0];
    const Tensor& b = inputs[1];
    const OpAttrs attrs = attrs_with_align(context.attrs);
    const Shape& a_global = context.input_specs[0].global_shape;
    const Shape& b_global = context.input_specs[1].global_shape;
    const bool broadcast = !(a_global == b_global && !attrs.has("align"));
    const int offset = broadcast ? operand_offset(a_global, b_global, attrs, name) : 0;
    return std::vector<Tensor>{binary_forward_cuda(
        name, a, b, operand_view(a, b, broadcast, context.input_boxes[0], offset, name),
        context.stream)};
  };
  BackwardFn backward = [&math, name, attrs_with_align](
                            const OpRecord& record,
                            const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const OpAttrs attrs = attrs_with_align(record.attrs);
    const ShardTensor& a = record.inputs[0];
    const ShardTensor& b = record.inputs[1];
    const bool broadcast = !(a.global_shape() == b.global_shape() && !attrs.has("align"));
    // The gradient of every partial term is the gradient of the sum: no Partial layouts here.
    const ShardSpec layout = without_partial(record.outputs[0].spec());
    const ShardTensor g = grads[0]->spec() == layout
                              ? *grads[0]
                              : grads[0]->redistribute(layout.placements, layout.extents);
    const int offset =
        broadcast ? operand_offset(a.global_shape(), b.global_shape(), attrs, name) : 0;
    const Box box = a.local_box();
    const Tensor& a_local = a.to_local();
    if (a_local.device().is_cuda()) {
      const Stream stream = compute_stream_for(a_local.device());
      const Tensor& b_raw = b.to_local();
      auto [grad_a, grad_b_local] = binary_backward_cuda(
          name, a_local, b_raw, operand_view(a_local, b_raw, broadcast, box, offset, name),
          g.to_local(), stream);
      ShardTensor grad_a_sharded(grad_a, a.mesh(), g.spec());
      if (!broadcast) return {grad_a_sharded, ShardTensor(grad_b_local, b.mesh(), g.spec())};
      return {
          grad_a_sharded,
          ShardTensor(reduce_to_operand_cuda(grad_b_local, b.global_shape(), box, offset, stream),
                      b.mesh(), partial_over_sharding(a.spec(), b.global_shape()))};
    }
    const Tensor b_local = broadcast ? expand_to_box(b.to_local(), box, offset) : b.to_local();
    auto times_grad = [&](double (*partial)(double, double)) {
      const Tensor derivative = zip_elements(a_local, b_local, partial);
      return zip_elements(derivative, g.to_local(), [](double d, double gv) { return d * gv; });
    };
    ShardTensor grad_a(times_grad(math.dx), a.mesh(), g.spec());
    const Tensor grad_b_local = times_grad(math.dy);
    if (!broadcast) return {grad_a, ShardTensor(grad_b_local, b.mesh(), g.spec())};
    return {grad_a, ShardTensor(reduce_to_operand(grad_b_local, b.global_shape(), box, offset),
                                b.mesh(), partial_over_sharding(a.spec(), b.global_shape()))};
  };
  register_op(
      OpDef{.name = name,
            .summary = binary_summary(name),
            .inputs = {{.name = bias ? "x" : "a"}, {.name = "b"}},
            .outputs = {"y"},
            .attrs = {{.name = "align",
                       .type = AttrType::int_scalar,
                       .default_value = default_align,
                       .doc = "the dim of the first input that b's first dim lines up with (-1: "
                              "numpy's right alignment)"}},
            .rule = std::move(rule),
            .cpu = std::move(cpu),
            .cuda = std::move(cuda),
            .backward = std::move(backward)});
}

}  // namespace

void register_pointwise_ops() {
  for (const UnaryMath& math : unary_math) register_unary(math);
  for (const BinaryMath& math : binary_math) register_binary(math, math.name, -1);
  // bias_add(x[N, C, ...], b[C]): add with b aligned to dim 1.
  register_binary(binary_math[0], "bias_add", 1);
}

ShardTensor relu(const ShardTensor& x) {
  return apply_op("relu", {x})[0];
}
ShardTensor gelu(const ShardTensor& x) {
  return apply_op("gelu", {x})[0];
}
ShardTensor silu(const ShardTensor& x) {
  return apply_op("silu", {x})[0];
}
ShardTensor tanh(const ShardTensor& x) {
  return apply_op("tanh", {x})[0];
}
ShardTensor exp(const ShardTensor& x) {
  return apply_op("exp", {x})[0];
}
ShardTensor scale(const ShardTensor& x, double factor) {
  return apply_op("scale", {x}, OpAttrs().set("factor", factor))[0];
}
ShardTensor add(const ShardTensor& a, const ShardTensor& b) {
  return apply_op("add", {a, b})[0];
}
ShardTensor sub(const ShardTensor& a, const ShardTensor& b) {
  return apply_op("sub", {a, b})[0];
}
ShardTensor mul(const ShardTensor& a, const ShardTensor& b) {
  return apply_op("mul", {a, b})[0];
}
ShardTensor div(const ShardTensor& a, const ShardTensor& b) {
  return apply_op("div", {a, b})[0];
}
ShardTensor bias_add(const ShardTensor& x, const ShardTensor& b) {
  return apply_op("bias_add", {x, b})[0];
}

}  // namespace tessera::ops
