// OnnxModel (onnx_model.hpp): every node is compiled once into a step (its attributes read and
// checked when the model is built), then run in the graph's order on values that are either
// data on the mesh (ShardTensors) or constants known without data (host arrays: shapes, scales,
// Constant nodes). A float initializer is both: its Parameter for the ops and its host values for
// the inputs that must be constants.
#include "ops/nn/onnx_model.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>

#include "core/agree.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/nn/onnx_host.hpp"
#include "ops/ops.hpp"

namespace tessera::nn {

namespace {

using io::OnnxNode;
using onnx::HostArray;

/// A value of the graph: data on the mesh, host values known without data, or both (a float
/// initializer: its Parameter and its values).
struct Value {
  std::optional<ShardTensor> sharded;
  std::optional<HostArray> constant;
};

/// What a step sees when it runs: the mesh, the model's float dtype and the device.
struct RunContext {
  const DeviceMesh& mesh;
  DType dtype;
  Device device;
};

using Values = std::vector<std::optional<Value>>;

/// Thrown by a step whose sharded op does not cover this call (a Slice with a step other than
/// 1): the node runs through the op fallback instead.
struct UseFallback {};
using Step = std::function<std::vector<Value>(const RunContext&, const Values&)>;

Value data_value(ShardTensor tensor) {
  return Value{std::move(tensor), std::nullopt};
}

/// Input `index` as data on the mesh: a constant becomes a replicated tensor in `like`'s dtype
/// (the model's dtype when there is none), no communication.
ShardTensor data_of(const RunContext& context, const OnnxNode& node, const Values& inputs,
                    size_t index, std::optional<DType> like = std::nullopt) {
  check_arg(index < inputs.size() && inputs[index], "onnx", "{}: needs input {}", node.where(),
            index);
  const Value& value = *inputs[index];
  if (value.sharded) return *value.sharded;
  const Tensor host = onnx::host_tensor(*value.constant, like.value_or(context.dtype));
  const Tensor values =
      host.dtype() == DType::i64 ? host.to_dtype(like.value_or(context.dtype)) : host;
  return ShardTensor::distribute(
      values.to(context.device), context.mesh,
      std::vector<Placement>(context.mesh.ndim(), Placement::replicate()));
}

std::optional<ShardTensor> optional_data(const RunContext& context, const OnnxNode& node,
                                         const Values& inputs, size_t index, DType like) {
  if (index >= inputs.size() || !inputs[index]) return std::nullopt;
  return data_of(context, node, inputs, index, like);
}

/// Input `index` as host values; data computed from the model's inputs cannot be one.
const HostArray& constant_of(const OnnxNode& node, const Values& inputs, size_t index,
                             const char* what) {
  check_arg(index < inputs.size() && inputs[index], "onnx", "{}: needs input {} ({})", node.where(),
            index, what);
  check_arg(inputs[index]->constant.has_value(), "onnx",
            "{}: input {} ('{}', {}) must be a constant (an initializer or computed from shapes "
            "only), not data",
            node.where(), index, node.inputs[index], what);
  return *inputs[index]->constant;
}

std::optional<HostArray> optional_constant(const OnnxNode& node, const Values& inputs, size_t index,
                                           const char* what) {
  if (index >= inputs.size() || !inputs[index]) return std::nullopt;
  return constant_of(node, inputs, index, what);
}

/// Checks that every integer of an attribute list lies in [lo, hi].
std::vector<int64_t> bounded(const OnnxNode& node, const std::string& attribute,
                             const std::vector<int64_t>& values, int64_t lo, int64_t hi) {
  for (int64_t value : values)
    check_arg(value >= lo && value <= hi, "onnx",
              "{}: attribute '{}' = [{}]: expected values from {} to {}", node.where(), attribute,
              fmt::join(values, ", "), lo, hi);
  return values;
}

/// Limit of kernel, stride, dilation and padding attributes: far beyond any real network, small
/// enough that no extent computed from them overflows.
constexpr int64_t kMaxWindow = int64_t{1} << 24;

void check_no_auto_pad(const OnnxNode& node) {
  const std::string auto_pad = node.text("auto_pad", "NOTSET");
  check_arg(auto_pad == "NOTSET" || auto_pad == "VALID", "onnx",
            "{}: auto_pad '{}' is not supported (expected NOTSET with explicit pads, as PyTorch "
            "exports, or VALID)",
            node.where(), auto_pad);
}

/// ONNX pads [b0, b1, ..., e0, e1, ...] split into begins and ends; VALID means none.
std::pair<std::vector<int64_t>, std::vector<int64_t>> split_pads(const OnnxNode& node) {
  std::vector<int64_t> pads = bounded(node, "pads", node.integers("pads"), 0, kMaxWindow);
  if (node.text("auto_pad", "NOTSET") == "VALID") pads.clear();
  check_arg(pads.size() % 2 == 0, "onnx", "{}: attribute 'pads' has odd length {}", node.where(),
            pads.size());
  const size_t half = pads.size() / 2;
  return {std::vector<int64_t>(pads.begin(), pads.begin() + half),
          std::vector<int64_t>(pads.begin() + half, pads.end())};
}

/// Pads as one list per spatial dim (0 when the attribute is absent), for ops with symmetric
/// padding only.
std::vector<int64_t> symmetric_pads(const OnnxNode& node) {
  const auto [begins, ends] = split_pads(node);
  check_arg(begins == ends, "onnx",
            "{}: asymmetric pads (begins [{}], ends [{}]) are not supported by this op",
            node.where(), fmt::join(begins, ", "), fmt::join(ends, ", "));
  return begins.empty() ? std::vector<int64_t>{0} : begins;
}

// ---- the node compilers: attributes read and checked once, a step returned ------------------

Step compile_conv(const OnnxNode& node) {
  check_no_auto_pad(node);
  ops::ConvOptions options;
  const auto [begins, ends] = split_pads(node);
  if (!begins.empty()) {
    options.padding = begins;
    options.padding_hi = ends;
  }
  options.stride = bounded(node, "strides", node.integers("strides", {1}), 1, kMaxWindow);
  options.dilation = bounded(node, "dilations", node.integers("dilations", {1}), 1, kMaxWindow);
  options.groups = node.integer("group", 1);
  check_arg(options.groups >= 1 && options.groups <= kMaxWindow, "onnx",
            "{}: attribute 'group' = {}", node.where(), options.groups);
  const std::vector<int64_t> kernel_shape = node.integers("kernel_shape");
  return [options, kernel_shape, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    const ShardTensor w = data_of(context, node, inputs, 1, x.dtype());
    const Shape& shape = w.global_shape();
    check_arg(kernel_shape.empty() ||
                  (shape.size() == kernel_shape.size() + 2 &&
                   std::equal(kernel_shape.begin(), kernel_shape.end(), shape.begin() + 2)),
              "onnx", "{}: kernel_shape [{}] does not match the weight's shape {}", node.where(),
              fmt::join(kernel_shape, ", "), shape);
    return std::vector<Value>{
        data_value(ops::conv(x, w, optional_data(context, node, inputs, 2, x.dtype()), options))};
  };
}

Step compile_conv_transpose(const OnnxNode& node) {
  check_no_auto_pad(node);
  check_arg(!node.has("output_shape"), "onnx",
            "{}: attribute 'output_shape' is not supported (give pads and output_padding)",
            node.where());
  ops::ConvTransposeOptions options;
  options.padding = symmetric_pads(node);
  options.stride = bounded(node, "strides", node.integers("strides", {1}), 1, kMaxWindow);
  options.dilation = bounded(node, "dilations", node.integers("dilations", {1}), 1, kMaxWindow);
  options.output_padding =
      bounded(node, "output_padding", node.integers("output_padding", {0}), 0, kMaxWindow);
  options.groups = node.integer("group", 1);
  check_arg(options.groups >= 1 && options.groups <= kMaxWindow, "onnx",
            "{}: attribute 'group' = {}", node.where(), options.groups);
  return [options, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    return std::vector<Value>{data_value(
        ops::conv_transpose(x, data_of(context, node, inputs, 1, x.dtype()),
                            optional_data(context, node, inputs, 2, x.dtype()), options))};
  };
}

Step compile_pool(const OnnxNode& node, bool max) {
  check_no_auto_pad(node);
  check_arg(node.outputs.size() == 1 || node.outputs[1].empty(), "onnx",
            "{}: the Indices output is not supported", node.where());
  ops::PoolOptions options;
  options.kernel_size = bounded(node, "kernel_shape", node.integers("kernel_shape"), 1, kMaxWindow);
  check_arg(!options.kernel_size.empty(), "onnx", "{}: needs attribute 'kernel_shape'",
            node.where());
  options.stride = bounded(
      node, "strides",
      node.integers("strides", std::vector<int64_t>(options.kernel_size.size(), 1)), 1, kMaxWindow);
  options.padding = symmetric_pads(node);
  options.ceil_mode = node.integer("ceil_mode", 0) != 0;
  if (max) {
    options.dilation = bounded(node, "dilations", node.integers("dilations", {1}), 1, kMaxWindow);
    check_arg(node.integer("storage_order", 0) == 0, "onnx", "{}: storage_order 1 is not supported",
              node.where());
  } else {
    options.count_include_pad = node.integer("count_include_pad", 0) != 0;
  }
  return [options, max, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    return std::vector<Value>{
        data_value(max ? ops::max_pool(x, options) : ops::avg_pool(x, options))};
  };
}

Step compile_resize(const OnnxNode& node) {
  const std::string mode = node.text("mode", "nearest");
  const std::string transform = node.text("coordinate_transformation_mode", "half_pixel");
  const std::string nearest_mode = node.text("nearest_mode", "round_prefer_floor");
  check_arg(node.integer("exclude_outside", 0) == 0, "onnx",
            "{}: exclude_outside 1 is not supported", node.where());
  std::optional<bool> align_corners;
  if (mode == "nearest") {
    check_arg(transform == "asymmetric" && nearest_mode == "floor", "onnx",
              "{}: nearest mode with coordinate_transformation_mode '{}' and nearest_mode '{}' "
              "is not supported (expected 'asymmetric' and 'floor', as F.interpolate's "
              "mode='nearest' exports)",
              node.where(), transform, nearest_mode);
  } else {
    check_arg(mode == "linear", "onnx",
              "{}: mode '{}' is not supported (expected nearest or linear)", node.where(), mode);
    check_arg(transform == "align_corners" || transform == "half_pixel" ||
                  transform == "pytorch_half_pixel",
              "onnx",
              "{}: linear mode with coordinate_transformation_mode '{}' is not supported "
              "(expected align_corners, half_pixel or pytorch_half_pixel)",
              node.where(), transform);
    align_corners = transform == "align_corners";
  }
  return [mode, align_corners, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    const Shape& shape = x.global_shape();
    const int64_t spatial = static_cast<int64_t>(shape.size()) - 2;
    check_arg(spatial >= 1 && spatial <= 3, "onnx",
              "{}: expected an input [N, C, 1 to 3 spatial dims], got shape {}", node.where(),
              shape);
    ops::InterpolateOptions options;
    options.mode = mode == "nearest" ? "nearest"
                   : spatial == 1    ? "linear"
                   : spatial == 2    ? "bilinear"
                                     : "trilinear";
    options.align_corners = align_corners;
    const std::optional<HostArray> scales = optional_constant(node, inputs, 2, "scales");
    const std::optional<HostArray> sizes = optional_constant(node, inputs, 3, "sizes");
    if (sizes && sizes->numel() > 0) {
      const std::vector<int64_t> extents = sizes->as_integers();
      check_arg(extents.size() == shape.size() && extents[0] == shape[0] && extents[1] == shape[1],
                "onnx", "{}: sizes [{}] must keep N and C of the input {}", node.where(),
                fmt::join(extents, ", "), shape);
      options.size.assign(extents.begin() + 2, extents.end());
    } else {
      check_arg(scales && scales->numel() == static_cast<int64_t>(shape.size()) &&
                    scales->values[0] == 1 && scales->values[1] == 1,
                "onnx", "{}: expected scales [1, 1, spatial..] for the input {} (or sizes)",
                node.where(), shape);
      options.scale_factor.assign(scales->values.begin() + 2, scales->values.end());
    }
    return std::vector<Value>{data_value(ops::interpolate(x, options))};
  };
}

Step compile_batch_norm(const OnnxNode& node, int64_t opset) {
  const double eps = node.real("epsilon", 1e-5);
  const double momentum = node.real("momentum", 0.9);
  // Opset 14 on says training with an attribute; opset 13 by asking for the statistics.
  const bool training =
      opset >= 14 ? node.integer("training_mode", 0) != 0 : node.outputs.size() > 1;
  return [eps, momentum, training, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    const DType dtype = x.dtype();
    ops::BatchNormOptions options;
    options.training = training;
    options.momentum = 1 - momentum;  // ONNX keeps `momentum` of the old value, PyTorch adds it
    options.eps = eps;
    ops::BatchNormResult result = ops::batch_norm(
        x, data_of(context, node, inputs, 3, dtype), data_of(context, node, inputs, 4, dtype),
        data_of(context, node, inputs, 1, dtype), data_of(context, node, inputs, 2, dtype),
        options);
    std::vector<Value> outputs{data_value(result.y)};
    if (result.running_mean) outputs.push_back(data_value(*result.running_mean));
    if (result.running_var) outputs.push_back(data_value(*result.running_var));
    return outputs;
  };
}

Step compile_instance_norm(const OnnxNode& node) {
  const double eps = node.real("epsilon", 1e-5);
  return [eps, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    return std::vector<Value>{
        data_value(ops::instance_norm(x, data_of(context, node, inputs, 1, x.dtype()),
                                      data_of(context, node, inputs, 2, x.dtype()), eps))};
  };
}

Step compile_layer_norm(const OnnxNode& node) {
  const double eps = node.real("epsilon", 1e-5);
  const int64_t axis = node.integer("axis", -1);
  check_arg(node.outputs.size() == 1 ||
                (node.outputs[1].empty() && (node.outputs.size() < 3 || node.outputs[2].empty())),
            "onnx", "{}: the Mean and InvStdDev outputs are not supported", node.where());
  return [eps, axis, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    const int64_t rank = static_cast<int64_t>(x.global_shape().size());
    const int64_t first = onnx::normalize_axis(node, axis, rank);
    return std::vector<Value>{
        data_value(ops::layer_norm(x, rank - first, data_of(context, node, inputs, 1, x.dtype()),
                                   optional_data(context, node, inputs, 2, x.dtype()), eps))};
  };
}

Step compile_gemm(const OnnxNode& node) {
  const double alpha = node.real("alpha", 1), beta = node.real("beta", 1);
  const bool trans_b = node.integer("transB", 0) != 0;
  check_arg(node.integer("transA", 0) == 0, "onnx", "{}: transA 1 is not supported", node.where());
  return [alpha, beta, trans_b, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor a = data_of(context, node, inputs, 0);
    const ShardTensor b = data_of(context, node, inputs, 1, a.dtype());
    std::optional<ShardTensor> c = optional_data(context, node, inputs, 2, a.dtype());
    if (c && beta == 0) c.reset();
    // F.linear's form (the bias a vector) in one op; anything else as its terms.
    if (trans_b && alpha == 1 && beta == 1 && (!c || c->global_shape().size() == 1))
      return std::vector<Value>{data_value(ops::linear(a, b, c))};
    ShardTensor y = trans_b ? ops::linear(a, b) : ops::matmul(a, b);
    if (alpha != 1) y = ops::scale(y, alpha);
    if (c) y = ops::add(y, beta == 1 ? *c : ops::scale(*c, beta));
    return std::vector<Value>{data_value(y)};
  };
}

Step compile_softmax(const OnnxNode& node, bool log) {
  const int64_t axis = node.integer("axis", -1);
  return [axis, log, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    const int64_t dim =
        onnx::normalize_axis(node, axis, static_cast<int64_t>(x.global_shape().size()));
    return std::vector<Value>{data_value(log ? ops::log_softmax(x, dim) : ops::softmax(x, dim))};
  };
}

Step compile_concat(const OnnxNode& node) {
  const int64_t axis = node.integer("axis", 0);
  return [axis, &node](const RunContext& context, const Values& inputs) {
    std::vector<ShardTensor> parts;
    std::optional<DType> dtype;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i] && inputs[i]->sharded) dtype = inputs[i]->sharded->dtype();
    for (size_t i = 0; i < inputs.size(); ++i)
      parts.push_back(data_of(context, node, inputs, i, dtype));
    const int64_t dim =
        onnx::normalize_axis(node, axis, static_cast<int64_t>(parts[0].global_shape().size()));
    // ops::concat takes at most kMaxConcatParts inputs: longer lists in rounds.
    while (parts.size() > 1) {
      std::vector<ShardTensor> next;
      for (size_t i = 0; i < parts.size(); i += ops::kMaxConcatParts) {
        const size_t end = std::min(parts.size(), i + ops::kMaxConcatParts);
        next.push_back(end - i == 1 ? parts[i]
                                    : ops::concat(std::vector<ShardTensor>(parts.begin() + i,
                                                                           parts.begin() + end),
                                                  dim));
      }
      parts = std::move(next);
    }
    return std::vector<Value>{data_value(parts[0])};
  };
}

Step compile_split(const OnnxNode& node) {
  const int64_t axis = node.integer("axis", 0);
  const std::vector<int64_t> split_attribute = node.integers("split");
  return [axis, split_attribute, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    const Shape& shape = x.global_shape();
    const int64_t dim = onnx::normalize_axis(node, axis, static_cast<int64_t>(shape.size()));
    std::vector<int64_t> sizes = split_attribute;
    if (const std::optional<HostArray> split = optional_constant(node, inputs, 1, "split"))
      sizes = split->as_integers();
    const int64_t parts = static_cast<int64_t>(node.outputs.size());
    if (sizes.empty()) {
      const int64_t each = (shape[dim] + parts - 1) / parts;  // the last part may be smaller
      for (int64_t p = 0; p < parts; ++p)
        sizes.push_back(std::max<int64_t>(0, std::min(each, shape[dim] - p * each)));
    }
    check_arg(static_cast<int64_t>(sizes.size()) == parts, "onnx",
              "{}: {} split sizes for {} outputs", node.where(), sizes.size(), parts);
    std::vector<Value> outputs;
    for (ShardTensor& part : ops::split(x, sizes, dim)) outputs.push_back(data_value(part));
    return outputs;
  };
}

Step compile_pad(const OnnxNode& node) {
  const std::string mode = node.text("mode", "constant");
  check_arg(mode == "constant" || mode == "reflect" || mode == "edge", "onnx",
            "{}: mode '{}' is not supported (expected constant, reflect or edge)", node.where(),
            mode);
  return [mode, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    const int64_t rank = static_cast<int64_t>(x.global_shape().size());
    check_arg(inputs.size() < 4 || !inputs[3], "onnx", "{}: input 'axes' is not supported",
              node.where());
    const std::vector<int64_t> pads = constant_of(node, inputs, 1, "pads").as_integers();
    check_arg(static_cast<int64_t>(pads.size()) == 2 * rank, "onnx",
              "{}: {} pads for a {}-d input (expected {})", node.where(), pads.size(), rank,
              2 * rank);
    // PyTorch's order: (lo, hi) of the last dim first, up to the first dim padded.
    int64_t first_padded = rank;
    for (int64_t d = 0; d < rank; ++d)
      if (pads[d] != 0 || pads[d + rank] != 0) {
        first_padded = d;
        break;
      }
    if (first_padded == rank) return std::vector<Value>{data_value(x)};
    ops::PadOptions options;
    for (int64_t d = rank - 1; d >= first_padded; --d) {
      options.pad.push_back(pads[d]);
      options.pad.push_back(pads[d + rank]);
    }
    options.mode = mode == "edge" ? "replicate" : mode;
    if (const std::optional<HostArray> value = optional_constant(node, inputs, 2, "constant_value"))
      options.value = value->scalar(node.where() + " constant_value");
    return std::vector<Value>{data_value(ops::pad(x, options))};
  };
}

Step compile_binary(const OnnxNode& node) {
  using Binary = ShardTensor (*)(const ShardTensor&, const ShardTensor&);
  static const std::map<std::string, Binary> binaries = {
      {"Add", ops::add}, {"Sub", ops::sub},     {"Mul", ops::mul},    {"Div", ops::div},
      {"Pow", ops::pow}, {"Min", ops::minimum}, {"Max", ops::maximum}};
  const Binary binary = binaries.at(node.op_type);
  return [binary, &node](const RunContext& context, const Values& inputs) {
    check_arg(!inputs.empty(), "onnx", "{}: needs inputs", node.where());
    std::optional<DType> dtype;
    for (const std::optional<Value>& input : inputs)
      if (input && input->sharded) dtype = input->sharded->dtype();
    // Min and Max take any number of inputs: folded left to right.
    ShardTensor result = data_of(context, node, inputs, 0, dtype);
    for (size_t i = 1; i < inputs.size(); ++i)
      result = binary(result, data_of(context, node, inputs, i, dtype));
    return std::vector<Value>{data_value(result)};
  };
}

Step compile_where(const OnnxNode& node) {
  return [&node](const RunContext& context, const Values& inputs) {
    std::optional<DType> dtype;
    for (size_t i = 1; i < inputs.size(); ++i)
      if (inputs[i] && inputs[i]->sharded) dtype = inputs[i]->sharded->dtype();
    return std::vector<Value>{data_value(ops::where(data_of(context, node, inputs, 0, dtype),
                                                    data_of(context, node, inputs, 1, dtype),
                                                    data_of(context, node, inputs, 2, dtype)))};
  };
}

Step compile_unary(const OnnxNode& node) {
  using Unary = std::function<ShardTensor(const ShardTensor&)>;
  const std::string& op = node.op_type;
  Unary unary;
  if (op == "Sqrt") unary = ops::sqrt;
  if (op == "Erf") unary = ops::erf;
  if (op == "Tanh") unary = ops::tanh;
  if (op == "Sigmoid") unary = ops::sigmoid;
  if (op == "Relu") unary = ops::relu;
  if (op == "Exp") unary = ops::exp;
  if (op == "Log") unary = ops::log;
  if (op == "Neg") unary = ops::neg;
  if (op == "Abs") unary = ops::abs;
  if (op == "LeakyRelu") {
    const double alpha = node.real("alpha", 0.01);
    unary = [alpha](const ShardTensor& x) { return ops::leaky_relu(x, alpha); };
  }
  if (op == "Softplus") unary = [](const ShardTensor& x) { return ops::softplus(x); };
  return [unary, &node](const RunContext& context, const Values& inputs) {
    return std::vector<Value>{data_value(unary(data_of(context, node, inputs, 0)))};
  };
}

Step compile_clip(const OnnxNode& node) {
  return [&node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    std::optional<double> min, max;
    if (const std::optional<HostArray> low = optional_constant(node, inputs, 1, "min"))
      min = low->scalar(node.where() + " min");
    if (const std::optional<HostArray> high = optional_constant(node, inputs, 2, "max"))
      max = high->scalar(node.where() + " max");
    return std::vector<Value>{data_value(min || max ? ops::clamp(x, min, max) : x)};
  };
}

Step compile_reduce(const OnnxNode& node, bool mean) {
  const bool keepdims = node.integer("keepdims", 1) != 0;
  const bool noop_with_empty_axes = node.integer("noop_with_empty_axes", 0) != 0;
  const std::vector<int64_t> axes_attribute = node.integers("axes");
  return [=, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    std::vector<int64_t> axes = axes_attribute;
    if (const std::optional<HostArray> given = optional_constant(node, inputs, 1, "axes"))
      axes = given->as_integers();
    if (axes.empty() && noop_with_empty_axes) return std::vector<Value>{data_value(x)};
    const int64_t rank = static_cast<int64_t>(x.global_shape().size());
    std::vector<int64_t> dims;
    for (int64_t axis : axes) dims.push_back(onnx::normalize_axis(node, axis, rank));
    if (dims.empty())
      for (int64_t d = 0; d < rank; ++d) dims.push_back(d);
    return std::vector<Value>{
        data_value(mean ? ops::mean(x, dims, keepdims) : ops::sum(x, dims, keepdims))};
  };
}

/// Slice with unit steps as ops::split along each sliced axis (each part keeps x's layout cut to
/// the rank's box: no communication); other steps through the op fallback.
Step compile_slice(const OnnxNode& node) {
  return [&node](const RunContext& context, const Values& inputs) {
    ShardTensor x = data_of(context, node, inputs, 0);
    const int64_t rank = static_cast<int64_t>(x.global_shape().size());
    const std::vector<int64_t> starts = constant_of(node, inputs, 1, "starts").as_integers();
    const std::vector<int64_t> ends = constant_of(node, inputs, 2, "ends").as_integers();
    std::vector<int64_t> axes, steps(starts.size(), 1);
    if (const std::optional<HostArray> given = optional_constant(node, inputs, 3, "axes")) {
      axes = given->as_integers();
    } else {
      for (size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<int64_t>(i));
    }
    if (const std::optional<HostArray> given = optional_constant(node, inputs, 4, "steps"))
      steps = given->as_integers();
    check_arg(ends.size() == starts.size() && axes.size() == starts.size() &&
                  steps.size() == starts.size(),
              "onnx", "{}: starts, ends, axes and steps differ in length", node.where());
    for (size_t i = 0; i < starts.size(); ++i) {
      if (steps[i] != 1) throw UseFallback{};
      const int64_t axis = onnx::normalize_axis(node, axes[i], rank);
      const int64_t extent = x.global_shape()[axis];
      auto clamp_index = [extent](int64_t index) {
        if (index < 0) index = index < -extent ? 0 : index + extent;
        return std::clamp<int64_t>(index, 0, extent);
      };
      const int64_t first = clamp_index(starts[i]);
      const int64_t last = std::max(first, clamp_index(ends[i]));
      if (first == 0 && last == extent) continue;
      // Parts before, kept, after (empty parts left out).
      std::vector<int64_t> sizes;
      size_t kept = 0;
      if (first > 0) sizes.push_back(first);
      kept = sizes.size();
      sizes.push_back(last - first);
      if (last < extent) sizes.push_back(extent - last);
      x = ops::split(x, sizes, axis)[kept];
    }
    return std::vector<Value>{data_value(x)};
  };
}

/// Dropout in inference (no training_mode, or a constant false): the identity.
Step compile_dropout(const OnnxNode& node) {
  check_arg(node.outputs.size() == 1 || node.outputs[1].empty(), "onnx",
            "{}: the mask output is not supported", node.where());
  return [&node](const RunContext&, const Values& inputs) {
    if (const std::optional<HostArray> training =
            optional_constant(node, inputs, 2, "training_mode"))
      check_arg(training->scalar(node.where()) == 0, "onnx",
                "{}: training mode is not supported (export in eval mode)", node.where());
    check_arg(!inputs.empty() && inputs[0], "onnx", "{}: needs input 0", node.where());
    return std::vector<Value>{*inputs[0]};
  };
}

/// Cast of data: to a float type the data keeps the model's dtype (the model computes in one
/// float type); to another type it goes through the fallback.
bool casts_to_float(const OnnxNode& node) {
  const int64_t to = node.integer("to", 1);
  return to == 1 || to == 10 || to == 11 || to == 16;
}

/// The nodes with a sharded op and their compilers.
std::optional<Step> compile_sharded(const OnnxNode& node, int64_t opset) {
  const std::string& op = node.op_type;
  if (op == "Conv") return compile_conv(node);
  if (op == "ConvTranspose") return compile_conv_transpose(node);
  if (op == "MaxPool") return compile_pool(node, true);
  if (op == "AveragePool") return compile_pool(node, false);
  if (op == "Resize") return compile_resize(node);
  if (op == "BatchNormalization") return compile_batch_norm(node, opset);
  if (op == "InstanceNormalization") return compile_instance_norm(node);
  if (op == "LayerNormalization") return compile_layer_norm(node);
  if (op == "Gemm") return compile_gemm(node);
  if (op == "MatMul")
    return Step([&node](const RunContext& context, const Values& inputs) {
      const ShardTensor a = data_of(context, node, inputs, 0);
      return std::vector<Value>{
          data_value(ops::matmul(a, data_of(context, node, inputs, 1, a.dtype())))};
    });
  if (op == "Softmax") return compile_softmax(node, false);
  if (op == "LogSoftmax") return compile_softmax(node, true);
  if (op == "Transpose") {
    // A relabelling of the layout (ops::permute): sharded dims move with the data.
    const std::vector<int64_t> perm = node.integers("perm");
    return Step([perm, &node](const RunContext& context, const Values& inputs) {
      const ShardTensor x = data_of(context, node, inputs, 0);
      std::vector<int64_t> dims = perm;
      if (dims.empty())
        for (int64_t d = static_cast<int64_t>(x.global_shape().size()) - 1; d >= 0; --d)
          dims.push_back(d);
      return std::vector<Value>{data_value(ops::permute(x, dims))};
    });
  }
  if (op == "Slice") return compile_slice(node);
  if (op == "Concat") return compile_concat(node);
  if (op == "Split") return compile_split(node);
  if (op == "Pad") return compile_pad(node);
  if (op == "Add" || op == "Sub" || op == "Mul" || op == "Div" || op == "Pow" || op == "Min" ||
      op == "Max")
    return compile_binary(node);
  if (op == "Where") return compile_where(node);
  if (op == "Sqrt" || op == "Erf" || op == "Tanh" || op == "Sigmoid" || op == "Relu" ||
      op == "Exp" || op == "Log" || op == "Neg" || op == "Abs" || op == "LeakyRelu" ||
      op == "Softplus")
    return compile_unary(node);
  if (op == "Clip") return compile_clip(node);
  if (op == "ReduceMean") return compile_reduce(node, true);
  if (op == "ReduceSum") return compile_reduce(node, false);
  if (op == "Dropout") return compile_dropout(node);
  if (op == "Identity")
    return Step([&node](const RunContext&, const Values& inputs) {
      check_arg(!inputs.empty() && inputs[0], "onnx", "{}: needs input 0", node.where());
      return std::vector<Value>{*inputs[0]};
    });
  if (op == "Cast" && casts_to_float(node))
    return Step([&node](const RunContext&, const Values& inputs) {
      check_arg(!inputs.empty() && inputs[0], "onnx", "{}: needs input 0", node.where());
      return std::vector<Value>{*inputs[0]};
    });
  return std::nullopt;
}

/// Inputs of these ops are read as constants (shapes, scales, pads, axes): a float initializer
/// in such a position is a constant, not a Parameter.
bool is_constant_position(const std::string& op, size_t index) {
  if (op == "Resize") return index >= 1;
  if (op == "Pad" || op == "Clip" || op == "Split" || op == "ReduceSum" || op == "ReduceMean" ||
      op == "Reshape" || op == "Expand" || op == "Unsqueeze" || op == "Squeeze" || op == "Dropout")
    return index >= 1;
  if (op == "Slice") return index >= 1;
  if (op == "ConstantOfShape" || op == "Shape") return true;
  return false;
}

void warn(const DeviceMesh& mesh, const std::string& message) {
  if (mesh.rank() == 0) std::fprintf(stderr, "tessera: warning: [onnx] %s\n", message.c_str());
}

}  // namespace

struct OnnxModel::State {
  io::OnnxGraph graph;
  DeviceMesh mesh;
  DType dtype;
  std::vector<std::pair<std::string, Parameter>> parameters;
  std::vector<std::pair<std::string, ShardTensor>> buffers;
  std::map<std::string, Value> initial;  ///< initializers by name
  struct Compiled {
    std::optional<Step> step;  ///< none: the node has host semantics only (folded or fallback)
    bool skip = false;         ///< consumed by a recognised pattern
    /// The value the step reads instead of the node's inputs (a recognised pattern's input).
    std::optional<std::string> input_override;
  };
  std::vector<Compiled> compiled;
  std::set<std::string> fallbacks, warned;

  State(io::OnnxGraph parsed, DeviceMesh on, DType as)
      : graph(std::move(parsed)), mesh(std::move(on)), dtype(as) {}
};

namespace {

/// The index of the node producing `name`, if a node does.
std::optional<size_t> producer_of(const io::OnnxGraph& graph, const std::string& name) {
  for (size_t i = 0; i < graph.nodes.size(); ++i)
    for (const std::string& output : graph.nodes[i].outputs)
      if (output == name) return i;
  return std::nullopt;
}

/// The nodes reading `name` (and whether it is a graph output).
std::vector<size_t> consumers_of(const io::OnnxGraph& graph, const std::string& name) {
  std::vector<size_t> consumers;
  for (size_t i = 0; i < graph.nodes.size(); ++i)
    for (const std::string& input : graph.nodes[i].inputs)
      if (input == name) {
        consumers.push_back(i);
        break;
      }
  for (const io::OnnxValue& output : graph.outputs)
    if (output.name == name) consumers.push_back(graph.nodes.size());
  return consumers;
}

/// The host values of `name` when it is an initializer or a Constant node's output.
std::optional<HostArray> known_constant(const io::OnnxGraph& graph, const std::string& name) {
  for (const auto& [initializer, tensor] : graph.initializers)
    if (initializer == name) return onnx::host_array(tensor);
  const std::optional<size_t> producer = producer_of(graph, name);
  if (producer && graph.nodes[*producer].op_type == "Constant")
    return onnx::run_host_op(graph.nodes[*producer], {})[0];
  return std::nullopt;
}

/// PyTorch's GroupNorm export: Reshape(x, [0, G, -1]) -> InstanceNormalization(scale 1, bias 0)
/// -> Reshape(., Shape(x)), the affine part following as Mul and Add of [C, 1, ..] constants.
/// Returns the index of the first Reshape's partner nodes and G when node `first` starts one.
struct GroupNormMatch {
  size_t instance_norm, reshape_back;
  int64_t groups;
  double eps;
};
std::optional<GroupNormMatch> match_group_norm(const io::OnnxGraph& graph, size_t first) {
  const OnnxNode& reshape = graph.nodes[first];
  if (reshape.op_type != "Reshape" || reshape.inputs.size() < 2 || reshape.outputs.size() != 1)
    return std::nullopt;
  const std::vector<size_t> norms = consumers_of(graph, reshape.outputs[0]);
  if (norms.size() != 1 || norms[0] >= graph.nodes.size()) return std::nullopt;
  const OnnxNode& norm = graph.nodes[norms[0]];
  if (norm.op_type != "InstanceNormalization" || norm.inputs.size() != 3 ||
      norm.inputs[0] != reshape.outputs[0] || norm.outputs.size() != 1)
    return std::nullopt;
  const std::vector<size_t> backs = consumers_of(graph, norm.outputs[0]);
  if (backs.size() != 1 || backs[0] >= graph.nodes.size()) return std::nullopt;
  const OnnxNode& back = graph.nodes[backs[0]];
  if (back.op_type != "Reshape" || back.inputs.size() < 2 || back.inputs[0] != norm.outputs[0])
    return std::nullopt;
  const std::optional<size_t> shape_node = producer_of(graph, back.inputs[1]);
  if (!shape_node || graph.nodes[*shape_node].op_type != "Shape" ||
      graph.nodes[*shape_node].inputs.empty() ||
      graph.nodes[*shape_node].inputs[0] != reshape.inputs[0] ||
      graph.nodes[*shape_node].has("start") || graph.nodes[*shape_node].has("end"))
    return std::nullopt;
  const std::optional<HostArray> target = known_constant(graph, reshape.inputs[1]);
  const std::optional<HostArray> scale = known_constant(graph, norm.inputs[1]);
  const std::optional<HostArray> bias = known_constant(graph, norm.inputs[2]);
  if (!target || !scale || !bias || target->numel() != 3) return std::nullopt;
  const std::vector<int64_t> shape = target->as_integers();
  const int64_t groups = scale->numel();
  if (shape[0] != 0 || shape[1] != groups || shape[2] != -1 || bias->numel() != groups)
    return std::nullopt;
  for (int64_t g = 0; g < groups; ++g)
    if (scale->values[g] != 1 || bias->values[g] != 0) return std::nullopt;
  return GroupNormMatch{norms[0], backs[0], groups, norm.real("epsilon", 1e-5)};
}

}  // namespace

OnnxModel::OnnxModel(io::OnnxGraph graph, const DeviceMesh& mesh, DType dtype)
    : state_(std::make_shared<State>(std::move(graph), mesh, dtype)) {
  State& state = *state_;
  check_arg(
      dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 || dtype == DType::bf16,
      "onnx", "dtype {} (expected f32, f64, f16 or bf16)", dtype_name(dtype));
  const io::OnnxGraph& g = state.graph;
  const int64_t opset = g.opset;
  // Compile every node first: an unsupported node or a bad attribute is refused before anything
  // is allocated on the mesh.
  state.compiled.resize(g.nodes.size());
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const OnnxNode& node = g.nodes[i];
    if (state.compiled[i].skip) continue;
    if (const std::optional<GroupNormMatch> match = match_group_norm(g, i)) {
      state.compiled[i].skip = true;
      state.compiled[match->instance_norm].skip = true;
      const OnnxNode& back = g.nodes[match->reshape_back];
      const int64_t groups = match->groups;
      const double eps = match->eps;
      state.compiled[match->reshape_back].input_override = node.inputs[0];
      state.compiled[match->reshape_back].step =
          Step([&back, groups, eps](const RunContext& context, const Values& inputs) {
            return std::vector<Value>{data_value(ops::group_norm(
                data_of(context, back, inputs, 0), groups, std::nullopt, std::nullopt, eps))};
          });
      continue;
    }
    if (state.compiled[i].step) continue;  // a pattern's last node, compiled above
    state.compiled[i].step = compile_sharded(node, opset);
    const bool host = onnx::has_host_op(node.op_type) || node.op_type == "Shape";
    check_arg(state.compiled[i].step || host, "onnx",
              "{}: op type '{}' is not supported (no sharded op and no fallback; see "
              "docs/models.md)",
              node.where(), node.op_type);
  }

  // Float initializers in data positions become Parameters; BatchNormalization's running
  // statistics buffers; the rest (shapes, scales, integer tensors) constants.
  std::set<std::string> statistics, data_inputs;
  for (const OnnxNode& node : g.nodes)
    for (size_t k = 0; k < node.inputs.size(); ++k) {
      if (node.op_type == "BatchNormalization" && k >= 3) statistics.insert(node.inputs[k]);
      if (!is_constant_position(node.op_type, k)) data_inputs.insert(node.inputs[k]);
    }
  const Device device = current_rank_context().device();
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  for (const auto& [name, tensor] : g.initializers) {
    Value value;
    value.constant = onnx::host_array(tensor);
    if (is_floating(tensor.dtype()) && data_inputs.count(name) > 0) {
      ShardTensor values =
          ShardTensor::distribute(tensor.to_dtype(dtype).to(device), mesh, replicated);
      if (statistics.count(name) > 0) {
        state.buffers.emplace_back(name, values);
        value.sharded = values;
      } else {
        Parameter parameter(values, name);
        state.parameters.emplace_back(name, parameter);
        value.sharded = parameter.tensor();
      }
    }
    state.initial[name] = std::move(value);
  }
}

OnnxModel OnnxModel::load(const std::string& file, const DeviceMesh& mesh, DType dtype) {
  return OnnxModel(io::read_onnx(file), mesh, dtype);
}

const std::vector<io::OnnxValue>& OnnxModel::inputs() const {
  return state_->graph.inputs;
}

const std::vector<io::OnnxValue>& OnnxModel::outputs() const {
  return state_->graph.outputs;
}

std::vector<std::pair<std::string, Parameter>> OnnxModel::named_parameters() const {
  return state_->parameters;
}

std::vector<std::pair<std::string, ShardTensor>> OnnxModel::named_buffers() const {
  return state_->buffers;
}

std::vector<std::string> OnnxModel::fallback_nodes() const {
  return {state_->fallbacks.begin(), state_->fallbacks.end()};
}

std::map<std::string, ShardTensor> OnnxModel::forward(
    const std::map<std::string, ShardTensor>& inputs) {
  State& state = *state_;
  const io::OnnxGraph& g = state.graph;
  std::map<std::string, Value> values = state.initial;
  for (const io::OnnxValue& input : g.inputs) {
    const auto found = inputs.find(input.name);
    check_arg(found != inputs.end(), "onnx", "{}: no value given for graph input '{}'", g.source,
              input.name);
    check_arg(found->second.global_shape().size() == input.shape.size() || input.shape.empty(),
              "onnx", "{}: graph input '{}' is {}-d, got shape {}", g.source, input.name,
              input.shape.size(), found->second.global_shape());
    values[input.name] = data_value(found->second);
  }
  const RunContext context{state.mesh, state.dtype, current_rank_context().device()};
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const OnnxNode& node = g.nodes[i];
    const State::Compiled& compiled = state.compiled[i];
    if (compiled.skip) continue;
    Values node_inputs;
    if (compiled.input_override) {
      // A recognised GroupNorm runs on the first Reshape's input x.
      node_inputs = {values.at(*compiled.input_override)};
    } else {
      for (const std::string& name : node.inputs) {
        if (name.empty()) {
          node_inputs.emplace_back();
          continue;
        }
        node_inputs.push_back(values.at(name));
      }
    }
    std::vector<Value> results;
    try {
      // Pure constants (no data, no Parameter) fold on the host.
      const bool all_constant = std::all_of(node_inputs.begin(), node_inputs.end(),
                                            [](const std::optional<Value>& input) {
                                              return !input || (input->constant && !input->sharded);
                                            });
      bool handled = true;
      if (compiled.input_override) {
        results = (*compiled.step)(context, node_inputs);
      } else if (node.op_type == "Shape" && !node_inputs.empty() && node_inputs[0] &&
                 node_inputs[0]->sharded) {
        // The global shape: known on every rank without data.
        HostArray shape;
        shape.integral = true;
        const Shape& global = node_inputs[0]->sharded->global_shape();
        const int64_t rank = static_cast<int64_t>(global.size());
        int64_t start = node.integer("start", 0), end = node.integer("end", rank);
        start = std::clamp(start < 0 ? start + rank : start, int64_t{0}, rank);
        end = std::clamp(end < 0 ? end + rank : end, int64_t{0}, rank);
        for (int64_t d = start; d < end; ++d)
          shape.values.push_back(static_cast<double>(global[d]));
        shape.shape = {static_cast<int64_t>(shape.values.size())};
        results.push_back(Value{std::nullopt, shape});
      } else if (node.op_type == "Identity" && !node_inputs.empty() && node_inputs[0]) {
        results.push_back(*node_inputs[0]);
      } else if (onnx::has_host_op(node.op_type) && all_constant) {
        // Shape arithmetic: folded on the host, on every rank alike.
        std::vector<std::optional<HostArray>> constants;
        for (const std::optional<Value>& input : node_inputs)
          constants.push_back(input ? input->constant : std::nullopt);
        for (HostArray& result : onnx::run_host_op(node, constants))
          results.push_back(Value{std::nullopt, std::move(result)});
      } else {
        handled = false;
      }
      bool fallback = !handled && !compiled.step;
      if (!handled && compiled.step) {
        try {
          results = (*compiled.step)(context, node_inputs);
        } catch (const UseFallback&) {
          fallback = true;
        }
      }
      if (fallback) {
        // The op fallback: gather the inputs, compute the node on every rank, re-shard like
        // the first sharded input.
        std::vector<std::optional<HostArray>> gathered;
        std::optional<ShardSpec> lead;
        bool sharded = false;
        for (const std::optional<Value>& input : node_inputs) {
          if (!input) {
            gathered.emplace_back();
          } else if (input->constant) {
            gathered.push_back(input->constant);
          } else {
            if (!lead) lead = input->sharded->spec();
            for (const Placement& placement : input->sharded->placements())
              sharded = sharded || !placement.is_replicate();
            gathered.push_back(onnx::host_array(input->sharded->full_tensor()));
          }
        }
        if (sharded && state.warned.insert(node.name).second) {
          state.fallbacks.insert(node.name);
          warn(state.mesh, fmt::format("{}: no sharded op; running through the fallback (inputs "
                                       "gathered on every rank, the result re-sharded)",
                                       node.where()));
        }
        const std::vector<Placement> replicated(state.mesh.ndim(), Placement::replicate());
        for (HostArray& result : onnx::run_host_op(node, gathered)) {
          if (result.integral) {
            results.push_back(Value{std::nullopt, std::move(result)});
            continue;
          }
          std::vector<Placement> placements = replicated;
          if (lead)
            for (size_t m = 0; m < placements.size(); ++m) {
              const Placement& placement = lead->placements[m];
              if (placement.is_shard() && placement.dim < static_cast<int>(result.shape.size()))
                placements[m] = placement;
            }
          const Tensor full = onnx::host_tensor(result, state.dtype).to(context.device);
          results.push_back(data_value(ShardTensor::distribute(full, state.mesh, placements)));
        }
      }
    } catch (const AgreedError& error) {
      throw AgreedError("onnx", fmt::format("{}: {}", node.where(), error.what()));
    } catch (const InvalidArgument& error) {
      if (error.op() == "onnx") throw;
      throw InvalidArgument("onnx", fmt::format("{}: {}", node.where(), error.what()));
    }
    check_arg(results.size() <= node.outputs.size() || node.op_type == "BatchNormalization", "onnx",
              "{}: {} results for {} outputs", node.where(), results.size(), node.outputs.size());
    for (size_t k = 0; k < node.outputs.size(); ++k) {
      if (node.outputs[k].empty()) continue;
      check_arg(k < results.size(), "onnx", "{}: output {} ('{}') is not computed", node.where(), k,
                node.outputs[k]);
      values[node.outputs[k]] = results[k];
    }
  }
  std::map<std::string, ShardTensor> outputs;
  for (const io::OnnxValue& output : g.outputs) {
    const Value& value = values.at(output.name);
    outputs.emplace(output.name,
                    value.sharded
                        ? *value.sharded
                        : data_of(context, g.nodes.empty() ? OnnxNode{} : g.nodes[0], {value}, 0));
  }
  return outputs;
}

ShardTensor OnnxModel::forward(const ShardTensor& x) {
  const io::OnnxGraph& g = state_->graph;
  check_arg(g.inputs.size() == 1, "onnx", "{}: the graph has {} inputs; call forward with a map",
            g.source, g.inputs.size());
  return forward({{g.inputs[0].name, x}}).at(g.outputs[0].name);
}

void OnnxModel::save(const std::string& file) const {
  const State& state = *state_;
  // Parameters and buffers are replicated: every rank's piece is the whole value (full_tensor
  // moves nothing then), and only rank 0 writes.
  std::vector<std::pair<std::string, Tensor>> values;
  for (const auto& [name, parameter] : state.parameters)
    values.emplace_back(name, parameter.tensor().full_tensor());
  for (const auto& [name, buffer] : state.buffers) values.emplace_back(name, buffer.full_tensor());
  std::optional<std::string> problem;
  if (state.mesh.rank() == 0) {
    try {
      io::write_onnx(state.graph, values, file);
    } catch (const Error& error) {
      const std::string text = error.what();
      problem = text.substr(std::min(text.size(), text.find("] ") + 2));
    }
  }
  agree_on_error(state.mesh.comm(), "onnx", problem);
}

}  // namespace tessera::nn
