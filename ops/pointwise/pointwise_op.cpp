// Pointwise ops: unary (relu, gelu, silu, tanh, exp, scale, sigmoid, softplus, leaky_relu,
// erf, sqrt, neg, abs, log, clamp), binary (add, sub, mul, div, pow, maximum, minimum,
// bias_add) and the ternary where, with numpy broadcasting. Rules, cpu kernels and backward.
//
// Layouts: a unary op keeps its input's layout (a non-linear one reduces Partial dims first).
// An op with several operands is led by the operand whose shape is the result's (the first
// such): operands of that shape move to its layout, smaller (broadcast) operands are replicated
// and each rank uses the slice matching its local box. Gradients of a broadcast operand are
// local sums over each rank's box: Partial(sum) along mesh dims that shard the lead.
//
// Devices: cpu kernels and backward run the typed loops of pointwise_cpu.hpp for f32 and f64
// (map_elements/zip_elements for f16 and bf16); on
// cuda the same ops run the kernels of pointwise_cuda.hpp on the rank's compute stream (the
// backward fused: one pass over the saved tensors and g).
#include <fmt/format.h>

#include <limits>

#include "core/autograd.hpp"
#include "ops/op_costs.hpp"
#include "ops/op_helpers.hpp"
#include "ops/pointwise/broadcast.hpp"
#include "ops/pointwise/pointwise_cpu.hpp"
#include "ops/pointwise/pointwise_cuda.hpp"
#include "ops/pointwise/pointwise_math.hpp"
#include "ops/pointwise/pointwise_ops.hpp"

namespace tessera::ops {

namespace {

/// The attributes a unary op declares.
std::vector<OpAttr> unary_attrs(const std::string& name) {
  auto scalar = [](const char* attr, std::optional<double> value, const char* doc) {
    return OpAttr{.name = attr,
                  .type = AttrType::float_scalar,
                  .default_value = value ? std::optional<AttrValue>(*value) : std::nullopt,
                  .required = false,
                  .doc = doc};
  };
  if (name == "scale")
    return {
        {.name = "factor", .type = AttrType::float_scalar, .required = true, .doc = "the factor"}};
  if (name == "leaky_relu") return {scalar("negative_slope", 0.01, "the slope below 0")};
  if (name == "softplus")
    return {scalar("beta", 1.0, "the sharpness"),
            scalar("threshold", 20.0, "beta x above which the result is x")};
  if (name == "clamp")
    return {scalar("min", std::nullopt, "the lower bound (unset: none)"),
            scalar("max", std::nullopt, "the upper bound (unset: none)")};
  return {};
}

/// The parameters of a call of a unary op from its attributes (checked).
UnaryParams unary_params(const std::string& name, const OpAttrs& attrs) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  auto get = [&](const char* attr, double unset) {
    return attrs.has(attr) ? attrs.get_double(attr) : unset;
  };
  if (name == "scale") return {attrs.get_double("factor"), 0};
  if (name == "leaky_relu") return {get("negative_slope", 0.01), 0};
  if (name == "softplus") {
    const double beta = get("beta", 1.0);
    check_arg(beta != 0, name, "beta = 0");
    return {beta, get("threshold", 20.0)};
  }
  if (name == "clamp") {
    check_arg(attrs.has("min") || attrs.has("max"), name, "neither min nor max is set");
    return {get("min", -inf), get("max", inf)};
  }
  return {};
}

void register_unary(const UnaryMath& math) {
  const std::string name = math.name;
  RuleFn rule = [&math, name](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    unary_params(name, attrs);  // validates before any data moves
    const ShardSpec layout = math.linear ? inputs[0] : without_partial(inputs[0]);
    return OpRule{{layout}, {std::nullopt}, {layout}};
  };
  KernelFn cpu = [&math, name](const KernelContext& context, const std::vector<Tensor>& inputs) {
    require_floating_cpu(inputs[0], name);
    const UnaryParams p = unary_params(name, context.attrs);
    if (std::optional<Tensor> y = unary_forward_cpu(name, inputs[0], p.a, p.b))
      return std::vector<Tensor>{*y};
    return std::vector<Tensor>{
        map_elements(inputs[0], [&](double x) { return math.forward(x, p); })};
  };
  KernelFn cuda = [name](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const UnaryParams p = unary_params(name, context.attrs);
    return std::vector<Tensor>{unary_forward_cuda(name, inputs[0], p.a, p.b, context.stream)};
  };
  BackwardFn backward = [&math, name](const OpRecord& record,
                                      const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const UnaryParams p = unary_params(name, record.attrs);
    if (math.linear) {  // dx = f' g in g's own layout, f' a constant
      const ShardTensor& g = *grads[0];
      const Tensor& g_local = g.to_local();
      const double slope = math.derivative(0, 0, p);
      if (g_local.is_shape_only())  // estimate mode: the gradient's shape, no arithmetic
        return {ShardTensor(Tensor::empty(g_local.shape(), g_local.dtype(), g_local.device()),
                            g.mesh(), g.spec())};
      if (g_local.device().is_cuda())
        return {ShardTensor(unary_backward_cuda("scale", g_local, g_local, g_local, slope, 0,
                                                compute_stream_for(g_local.device())),
                            g.mesh(), g.spec())};
      std::optional<Tensor> dx = unary_backward_cpu("scale", g_local, g_local, slope, 0);
      if (!dx) dx = map_elements(g_local, [&](double v) { return slope * v; });
      return {ShardTensor(*dx, g.mesh(), g.spec())};
    }
    const ShardTensor& x = record.inputs[0];
    const ShardTensor g = grads[0]->redistribute_to(x.spec());
    const Tensor& x_local = x.to_local();
    const Tensor& y = record.outputs[0].to_local();
    if (g.to_local().is_shape_only())  // estimate mode: the gradient's shape, no arithmetic
      return {ShardTensor(Tensor::empty(x_local.shape(), g.dtype(), x_local.device()), x.mesh(),
                          x.spec())};
    if (x_local.device().is_cuda())
      return {ShardTensor(unary_backward_cuda(name, x_local, y, g.to_local(), p.a, p.b,
                                              compute_stream_for(x_local.device())),
                          x.mesh(), x.spec())};
    // One fused pass over the tensor the derivative reads and g.
    if (std::optional<Tensor> dx =
            unary_backward_cpu(name, math.reads_output ? y : x_local, g.to_local(), p.a, p.b))
      return {ShardTensor(*dx, x.mesh(), x.spec())};
    const Tensor xy =
        zip_elements(x_local, y, [&](double xv, double yv) { return math.derivative(xv, yv, p); });
    return {ShardTensor(zip_elements(xy, g.to_local(), [](double d, double gv) { return d * gv; }),
                        x.mesh(), x.spec())};
  };
  register_op(OpDef{.name = name,
                    .summary = math.summary,
                    .inputs = {{.name = "x"}},
                    .outputs = {"y"},
                    .attrs = unary_attrs(name),
                    .rule = std::move(rule),
                    .cpu = std::move(cpu),
                    .cuda = std::move(cuda),
                    .backward = std::move(backward),
                    .cost = pointwise_cost});
}

/// b seen over a's local box (the global box `a_box`): through stride 0 along broadcast dims,
/// or b itself when the operands share one shape.
OperandView operand_view(const Tensor& a, const Tensor& b, bool broadcast, const Box& a_box,
                         int offset, const std::string& op) {
  if (broadcast) return broadcast_operand_view(b.shape(), b.strides(), a_box.lo, offset);
  TESSERA_CHECK_ARG(a.shape() == b.shape(), op, "elementwise {} and {}", a.str(), b.str());
  return OperandView{b.strides(), 0};
}

/// numpy's broadcast shape of `shapes` (right-aligned; extents equal or 1).
Shape broadcast_shape(const std::vector<Shape>& shapes, const std::string& op) {
  size_t ndim = 0;
  for (const Shape& shape : shapes) ndim = std::max(ndim, shape.size());
  Shape result(ndim, 1);
  for (const Shape& shape : shapes)
    for (size_t i = 0; i < shape.size(); ++i) {
      int64_t& out = result[ndim - shape.size() + i];
      const int64_t extent = shape[i];
      check_arg(extent == out || extent == 1 || out == 1, op,
                "operands of shapes {} do not broadcast (dim {} from the right)",
                fmt::join(shapes, " and "), shape.size() - i);
      if (extent != 1) out = extent;
    }
  return result;
}

/// The operand whose shape is the result's (the first such): the one that lays out the result.
/// Throws InvalidArgument (tagged `op`) when none has it.
size_t lead_operand(const std::vector<Shape>& shapes, const std::string& op) {
  const Shape result = broadcast_shape(shapes, op);
  for (size_t i = 0; i < shapes.size(); ++i)
    if (shapes[i] == result) return i;
  throw InvalidArgument(op, fmt::format("no operand has the broadcast shape {} of {}; expand one "
                                        "of them to it first",
                                        result, fmt::join(shapes, " and ")));
}

/// The layout of every operand under a lead of layout `lead`: operands of its shape take it,
/// broadcast ones are replicated.
std::vector<ShardSpec> operand_layouts(const std::vector<ShardSpec>& inputs,
                                       const ShardSpec& lead) {
  std::vector<ShardSpec> layouts;
  for (const ShardSpec& input : inputs) {
    if (input.global_shape == lead.global_shape) {
      layouts.push_back(lead);
      continue;
    }
    layouts.push_back(
        ShardSpec::make(input.global_shape, input.mesh_shape,
                        std::vector<Placement>(input.mesh_shape.size(), Placement::replicate())));
  }
  return layouts;
}

/// One line per binary op, for `tessera ops`.
std::string binary_summary(const std::string& name) {
  if (name == "bias_add") return "x[N, C, ...] + b[C] (b replicated, aligned with dim 1)";
  if (name == "pow") return "a ** b (broadcast numpy-style)";
  if (name == "maximum" || name == "minimum")
    return fmt::format("Elementwise {} of a and b, NaN propagating (broadcast numpy-style)",
                       name == "maximum" ? "max" : "min");
  const char* symbol = name == "add" ? "+" : name == "sub" ? "-" : name == "mul" ? "*" : "/";
  return fmt::format("a {} b (broadcast numpy-style)", symbol);
}

/// How a call of a binary op lines its operands up: the lead (0 = a, 1 = b: the operand of the
/// result's shape), whether the other one broadcasts, and where its dims sit in the lead.
struct BinaryAlignment {
  int lead = 0;
  bool broadcast = false;
  int offset = 0;
};

/// The alignment of a call (an "align" attribute puts b's first dim at that dim of a).
BinaryAlignment binary_alignment(const Shape& a, const Shape& b, const OpAttrs& attrs,
                                 const std::string& op) {
  if (a == b && !attrs.has("align")) return {};
  if (attrs.has("align") && attrs.get_int("align") >= 0)
    return {0, true, broadcast_offset(a, b, attrs.get_int("align"), op)};
  if (lead_operand({a, b}, op) == 0) return {0, true, broadcast_offset(a, b, -1, op)};
  return {1, true, broadcast_offset(b, a, -1, op)};
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
    const ShardSpec& a = inputs[0];
    const ShardSpec& b = inputs[1];
    const BinaryAlignment al =
        binary_alignment(a.global_shape, b.global_shape, attrs_with_align(given), name);
    if (!al.broadcast) {
      const bool keep_partial = math.linear && a == b;
      const ShardSpec layout = keep_partial ? a : without_partial(a);
      return OpRule{{layout, layout}, {std::nullopt, std::nullopt}, {layout}};
    }
    const ShardSpec layout = without_partial(inputs[al.lead]);
    const ShardSpec& other = inputs[1 - al.lead];
    const ShardSpec replicated =
        ShardSpec::make(other.global_shape, other.mesh_shape,
                        std::vector<Placement>(other.mesh_shape.size(), Placement::replicate()));
    std::vector<ShardSpec> layouts = {layout, replicated};
    if (al.lead == 1) std::swap(layouts[0], layouts[1]);
    return OpRule{layouts, {std::nullopt, std::nullopt}, {layout}};
  };
  KernelFn cpu = [&math, name, attrs_with_align](const KernelContext& context,
                                                 const std::vector<Tensor>& inputs) {
    require_floating_cpu(inputs[0], name);
    check_arg(inputs[0].dtype() == inputs[1].dtype(), name, "operands of dtypes {} and {}",
              dtype_name(inputs[0].dtype()), dtype_name(inputs[1].dtype()));
    const BinaryAlignment al =
        binary_alignment(context.input_specs[0].global_shape, context.input_specs[1].global_shape,
                         attrs_with_align(context.attrs), name);
    const Tensor& lead = inputs[al.lead];
    // Typed loop reading a broadcast operand through stride 0 (nothing expanded).
    if (std::optional<Tensor> z =
            binary_forward_cpu(name, lead, inputs[1 - al.lead],
                               operand_view(lead, inputs[1 - al.lead], al.broadcast,
                                            context.input_boxes[al.lead], al.offset, name),
                               al.lead == 1))
      return std::vector<Tensor>{*z};
    Tensor other = inputs[1 - al.lead];
    if (al.broadcast) other = expand_to_box(other, context.input_boxes[al.lead], al.offset);
    return std::vector<Tensor>{al.lead == 0 ? zip_elements(lead, other, math.forward)
                                            : zip_elements(other, lead, math.forward)};
  };
  KernelFn cuda = [name, attrs_with_align](const KernelContext& context,
                                           const std::vector<Tensor>& inputs) {
    const BinaryAlignment al =
        binary_alignment(context.input_specs[0].global_shape, context.input_specs[1].global_shape,
                         attrs_with_align(context.attrs), name);
    const Tensor& lead = inputs[al.lead];
    const Tensor& other = inputs[1 - al.lead];
    return std::vector<Tensor>{binary_forward_cuda(
        name, lead, other,
        operand_view(lead, other, al.broadcast, context.input_boxes[al.lead], al.offset, name),
        al.lead == 1, context.stream)};
  };
  BackwardFn backward = [&math, name, attrs_with_align](
                            const OpRecord& record,
                            const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const BinaryAlignment al =
        binary_alignment(record.inputs[0].global_shape(), record.inputs[1].global_shape(),
                         attrs_with_align(record.attrs), name);
    const ShardTensor& lead = record.inputs[al.lead];
    const ShardTensor& other = record.inputs[1 - al.lead];
    // The gradient of every partial term is the gradient of the sum: no Partial layouts here.
    const ShardSpec layout = without_partial(record.outputs[0].spec());
    const ShardTensor g =
        grads[0]->spec() == layout ? *grads[0] : grads[0]->redistribute_to(layout);
    const Box box = lead.local_box();
    const Tensor& lead_local = lead.to_local();
    Tensor grad_lead, grad_other_local;
    if (g.to_local().is_shape_only()) {  // estimate mode: the gradients' shapes, no arithmetic
      const Tensor& g_local = g.to_local();
      grad_lead = Tensor::empty(g_local.shape(), g_local.dtype(), g_local.device());
      grad_other_local = Tensor::empty(al.broadcast ? other.global_shape() : g_local.shape(),
                                       g_local.dtype(), g_local.device());
    } else if (lead_local.device().is_cuda()) {
      const Stream stream = compute_stream_for(lead_local.device());
      const Tensor& other_raw = other.to_local();
      std::tie(grad_lead, grad_other_local) = binary_backward_cuda(
          name, lead_local, other_raw,
          operand_view(lead_local, other_raw, al.broadcast, box, al.offset, name), g.to_local(),
          al.lead == 1, stream);
      if (al.broadcast)
        grad_other_local =
            reduce_to_operand_cuda(grad_other_local, other.global_shape(), box, al.offset, stream);
    } else if ((name == "add" || name == "bias_add") &&
               g.to_local().dtype() == other.to_local().dtype() &&
               g.to_local().dtype() == lead_local.dtype() &&
               (!al.broadcast || g.to_local().dtype() == DType::f32 ||
                g.to_local().dtype() == DType::f64)) {
      // Both gradients of a sum are g. The lead's is g itself, shared as torch's add shares it
      // (gradients are never written in place: the tape and the parameters accumulate into new
      // tensors), and so is the other's when it has g's shape; a broadcast operand's is g summed
      // onto its shape straight from g (the values of the general path below, without writing
      // and reading back a full-size copy for the summation).
      grad_lead = g.to_local();
      if (!al.broadcast) {
        grad_other_local = g.to_local();
      } else {
        const Shape& other_shape = other.global_shape();
        const OperandView sums_view =
            broadcast_operand_view(other_shape, contiguous_strides(other_shape), box.lo, al.offset);
        std::optional<Tensor> summed = reduce_to_view_cpu(g.to_local(), other_shape, sums_view);
        grad_other_local =
            summed ? *summed : reduce_to_operand(g.to_local(), other_shape, box, al.offset);
      }
    } else if (std::optional<std::pair<Tensor, Tensor>> fused = binary_backward_cpu(
                   name, lead_local, other.to_local(),
                   operand_view(lead_local, other.to_local(), al.broadcast, box, al.offset, name),
                   g.to_local(), al.lead == 1)) {
      // One pass over both operands and g; a broadcast operand's gradient summed onto its shape.
      std::tie(grad_lead, grad_other_local) = *fused;
      if (al.broadcast) {
        const Shape& other_shape = other.global_shape();
        const OperandView sums_view =
            broadcast_operand_view(other_shape, contiguous_strides(other_shape), box.lo, al.offset);
        std::optional<Tensor> summed = reduce_to_view_cpu(grad_other_local, other_shape, sums_view);
        grad_other_local =
            summed ? *summed : reduce_to_operand(grad_other_local, other_shape, box, al.offset);
      }
    } else {
      const Tensor other_local =
          al.broadcast ? expand_to_box(other.to_local(), box, al.offset) : other.to_local();
      const Tensor& x = al.lead == 0 ? lead_local : other_local;
      const Tensor& y = al.lead == 0 ? other_local : lead_local;
      auto times_grad = [&](double (*partial)(double, double)) {
        const Tensor derivative = zip_elements(x, y, partial);
        return zip_elements(derivative, g.to_local(), [](double d, double gv) { return d * gv; });
      };
      grad_lead = times_grad(al.lead == 0 ? math.dx : math.dy);
      grad_other_local = times_grad(al.lead == 0 ? math.dy : math.dx);
      if (al.broadcast)
        grad_other_local =
            reduce_to_operand(grad_other_local, other.global_shape(), box, al.offset);
    }
    std::vector<std::optional<ShardTensor>> result(2);
    result[al.lead] = ShardTensor(grad_lead, lead.mesh(), g.spec());
    result[1 - al.lead] =
        al.broadcast ? ShardTensor(grad_other_local, other.mesh(),
                                   partial_over_sharding(lead.spec(), other.global_shape()))
                     : ShardTensor(grad_other_local, other.mesh(), g.spec());
    return result;
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
                              "numpy broadcasting, either operand may be the smaller)"}},
            .rule = std::move(rule),
            .cpu = std::move(cpu),
            .cuda = std::move(cuda),
            .backward = std::move(backward),
            .cost = pointwise_cost});
}

/// where(cond, a, b): the three operands broadcast together, led by the first of a, b, cond
/// that has the result's shape. Returns the lead index (0 = cond, 1 = a, 2 = b).
size_t where_lead(const std::vector<Shape>& shapes) {
  const size_t lead = lead_operand({shapes[1], shapes[2], shapes[0]}, "where");
  return lead == 2 ? 0 : lead + 1;
}

/// Operand i of where seen over the lead's local box `box` (a contiguous copy when it
/// broadcasts; the operand itself when it has the lead's shape).
Tensor where_operand(const Tensor& operand, const Shape& operand_global, const Shape& lead_global,
                     const Box& box) {
  if (operand_global == lead_global) return operand;
  return expand_to_box(operand, box, broadcast_offset(lead_global, operand_global, -1, "where"));
}

/// out = cond != 0 ? a : b elementwise (same shapes; cond in any dtype, a and b floating; in a's
/// dtype).
Tensor select_cpu(const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (std::optional<Tensor> typed = select_typed_cpu(cond, a, b)) return *typed;
  const Tensor mask = cond.to_dtype(DType::f64).contiguous();
  const Tensor a64 = a.to_dtype(DType::f64).contiguous();
  const Tensor b64 = b.to_dtype(DType::f64).contiguous();
  Tensor out = Tensor::empty(a64.shape(), DType::f64);
  const double* m = mask.data<double>();
  const double* av = a64.data<double>();
  const double* bv = b64.data<double>();
  double* o = out.data<double>();
  for (int64_t i = 0; i < out.numel(); ++i) o[i] = m[i] != 0 ? av[i] : bv[i];
  return out.to_dtype(a.dtype());
}

void register_where() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs&) {
    check_arg(inputs.size() == 3, "where", "expects 3 inputs (cond, a, b), got {}", inputs.size());
    const size_t lead =
        where_lead({inputs[0].global_shape, inputs[1].global_shape, inputs[2].global_shape});
    const ShardSpec layout = without_partial(inputs[lead]);
    return OpRule{
        operand_layouts(inputs, layout), {std::nullopt, std::nullopt, std::nullopt}, {layout}};
  };
  auto operands = [](const std::vector<ShardSpec>& specs, const std::vector<Box>& boxes,
                     const std::vector<Tensor>& inputs) {
    const size_t lead =
        where_lead({specs[0].global_shape, specs[1].global_shape, specs[2].global_shape});
    std::vector<Tensor> seen;
    for (size_t i = 0; i < 3; ++i)
      seen.push_back(
          where_operand(inputs[i], specs[i].global_shape, specs[lead].global_shape, boxes[lead]));
    return seen;
  };
  KernelFn cpu = [operands](const KernelContext& context, const std::vector<Tensor>& inputs) {
    require_floating_cpu(inputs[1], "where");
    check_arg(inputs[1].dtype() == inputs[2].dtype(), "where", "a and b of dtypes {} and {}",
              dtype_name(inputs[1].dtype()), dtype_name(inputs[2].dtype()));
    const std::vector<Tensor> seen = operands(context.input_specs, context.input_boxes, inputs);
    return std::vector<Tensor>{select_cpu(seen[0], seen[1], seen[2])};
  };
  KernelFn cuda = [operands](const KernelContext& context, const std::vector<Tensor>& inputs) {
    check_arg(inputs[1].dtype() == inputs[2].dtype(), "where", "a and b of dtypes {} and {}",
              dtype_name(inputs[1].dtype()), dtype_name(inputs[2].dtype()));
    const std::vector<Tensor> seen = operands(context.input_specs, context.input_boxes, inputs);
    return std::vector<Tensor>{where_forward_cuda(seen[0], seen[1], seen[2], context.stream)};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    std::vector<Shape> shapes;
    for (const ShardTensor& input : record.inputs) shapes.push_back(input.global_shape());
    const size_t lead_index = where_lead(shapes);
    const ShardTensor& lead = record.inputs[lead_index];
    const ShardSpec layout = without_partial(record.outputs[0].spec());
    const ShardTensor g =
        grads[0]->spec() == layout ? *grads[0] : grads[0]->redistribute_to(layout);
    const Box box = lead.local_box();
    const Tensor cond =
        where_operand(record.inputs[0].to_local(), shapes[0], lead.global_shape(), box);
    const Tensor& g_local = g.to_local();
    Tensor da, db;
    if (g_local.device().is_cuda()) {
      std::tie(da, db) = where_backward_cuda(cond, g_local, compute_stream_for(g_local.device()));
    } else {
      const Tensor zeros = Tensor::zeros(g_local.shape(), g_local.dtype());
      da = select_cpu(cond, g_local, zeros);
      db = select_cpu(cond, zeros, g_local);
    }
    std::vector<std::optional<ShardTensor>> result(3);
    const Tensor local_grads[] = {da, db};
    for (size_t i = 1; i < 3; ++i) {
      const ShardTensor& input = record.inputs[i];
      if (input.global_shape() == lead.global_shape()) {
        result[i] = ShardTensor(local_grads[i - 1], input.mesh(), g.spec());
        continue;
      }
      const int offset = broadcast_offset(lead.global_shape(), input.global_shape(), -1, "where");
      const Tensor summed =
          g_local.device().is_cuda()
              ? reduce_to_operand_cuda(local_grads[i - 1], input.global_shape(), box, offset,
                                       compute_stream_for(g_local.device()))
              : reduce_to_operand(local_grads[i - 1], input.global_shape(), box, offset);
      result[i] = ShardTensor(summed, input.mesh(),
                              partial_over_sharding(lead.spec(), input.global_shape()));
    }
    return result;
  };
  register_op(OpDef{.name = "where",
                    .summary = "cond != 0 ? a : b elementwise (broadcast numpy-style)",
                    .inputs = {{.name = "cond"}, {.name = "a"}, {.name = "b"}},
                    .outputs = {"y"},
                    .rule = std::move(rule),
                    .cpu = std::move(cpu),
                    .cuda = std::move(cuda),
                    .backward = std::move(backward),
                    .cost = pointwise_cost});
}

}  // namespace

void register_pointwise_ops() {
  for (const UnaryMath& math : unary_math) register_unary(math);
  for (const BinaryMath& math : binary_math) register_binary(math, math.name, -1);
  // bias_add(x[N, C, ...], b[C]): add with b aligned to dim 1.
  register_binary(binary_math[0], "bias_add", 1);
  register_where();
}

namespace {

ShardTensor unary(const char* name, const ShardTensor& x, OpAttrs attrs = {}) {
  return apply_op(name, {x}, attrs)[0];
}
ShardTensor binary(const char* name, const ShardTensor& a, const ShardTensor& b) {
  return apply_op(name, {a, b})[0];
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
ShardTensor sigmoid(const ShardTensor& x) {
  return unary("sigmoid", x);
}
ShardTensor softplus(const ShardTensor& x, double beta, double threshold) {
  return unary("softplus", x, OpAttrs().set("beta", beta).set("threshold", threshold));
}
ShardTensor leaky_relu(const ShardTensor& x, double negative_slope) {
  return unary("leaky_relu", x, OpAttrs().set("negative_slope", negative_slope));
}
ShardTensor erf(const ShardTensor& x) {
  return unary("erf", x);
}
ShardTensor sqrt(const ShardTensor& x) {
  return unary("sqrt", x);
}
ShardTensor neg(const ShardTensor& x) {
  return unary("neg", x);
}
ShardTensor abs(const ShardTensor& x) {
  return unary("abs", x);
}
ShardTensor log(const ShardTensor& x) {
  return unary("log", x);
}
ShardTensor clamp(const ShardTensor& x, std::optional<double> min, std::optional<double> max) {
  OpAttrs attrs;
  if (min) attrs.set("min", *min);
  if (max) attrs.set("max", *max);
  return unary("clamp", x, attrs);
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
ShardTensor pow(const ShardTensor& a, const ShardTensor& b) {
  return binary("pow", a, b);
}
ShardTensor maximum(const ShardTensor& a, const ShardTensor& b) {
  return binary("maximum", a, b);
}
ShardTensor minimum(const ShardTensor& a, const ShardTensor& b) {
  return binary("minimum", a, b);
}
ShardTensor bias_add(const ShardTensor& x, const ShardTensor& b) {
  return binary("bias_add", x, b);
}
ShardTensor where(const ShardTensor& cond, const ShardTensor& a, const ShardTensor& b) {
  return apply_op("where", {cond, a, b})[0];
}

}  // namespace tessera::ops
