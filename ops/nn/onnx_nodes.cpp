// The node compilers of nn::OnnxModel (onnx_nodes.hpp): one per ONNX op type with a sharded op,
// each reading and checking its node's attributes once and returning the step that runs it.
#include "ops/nn/onnx_nodes.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "ops/ops.hpp"

namespace tessera::nn::onnx {

using io::OnnxNode;

Value data_value(ShardTensor tensor) {
  return Value{std::move(tensor), nullptr, {}};
}

Value constant_value(HostArray array) {
  return Value{std::nullopt, std::make_shared<const HostArray>(std::move(array)), {}};
}

/// Input `index` as data on the mesh: a constant becomes a replicated tensor in `like`'s dtype
/// (the model's dtype when there is none), no communication: a constant of the model is the
/// same on every rank, so its replicated layout needs no agreement.
ShardTensor data_of(const RunContext& context, const OnnxNode& node, const Values& inputs,
                    size_t index, std::optional<DType> like) {
  check_arg(index < inputs.size() && inputs[index], "onnx", "{}: needs input {}", node.where(),
            index);
  const Value& value = *inputs[index];
  if (value.sharded) return *value.sharded;
  check_arg(value.parts.empty(), "onnx",
            "{}: input {} ('{}') is the output of a fused projection split over tp part by part; "
            "only Shape, and Slice or Split taking whole parts, may read it",
            node.where(), index, node.inputs[index]);
  const Tensor host = host_tensor(*value.constant, like.value_or(context.dtype));
  const Tensor values =
      host.dtype() == DType::i64 ? host.to_dtype(like.value_or(context.dtype)) : host;
  const Tensor local = values.to(context.device);
  return ShardTensor(
      local, context.mesh,
      ShardSpec::make(local.shape(), context.mesh.shape(),
                      std::vector<Placement>(context.mesh.ndim(), Placement::replicate()), {},
                      "onnx"));
}

namespace {

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
  check_arg(inputs[index]->constant != nullptr, "onnx",
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

/// True when the tensor-parallel plan split `w` on tensor dim `dim` over some mesh dim.
bool split_on(const ShardTensor& w, int dim) {
  for (const Placement& placement : w.placements())
    if (placement.is_shard() && placement.dim == dim) return true;
  return false;
}

/// `y` with every Partial(sum) reduced: the one all-reduce after a row-parallel (channel-
/// parallel) product, before its bias and the ops that follow.
ShardTensor reduced(const ShardTensor& y) {
  std::vector<Placement> placements = y.placements();
  std::vector<std::vector<int64_t>> extents = y.spec().extents;
  bool partial = false;
  for (size_t m = 0; m < placements.size(); ++m)
    if (placements[m].is_partial()) {
      placements[m] = Placement::replicate();
      if (m < extents.size()) extents[m].clear();
      partial = true;
    }
  // Derived from y's agreed layout: no agreement needed (redistribute_to).
  return partial ? y.redistribute_to(ShardSpec::make(y.global_shape(), y.spec().mesh_shape,
                                                     placements, extents, "onnx"))
                 : y;
}

/// The global shape of a fused projection's output: its parts side by side on the last dim.
Shape parts_shape(const std::vector<ShardTensor>& parts) {
  Shape shape = parts[0].global_shape();
  shape.back() *= static_cast<int64_t>(parts.size());
  return shape;
}

/// a @ b for a 2-d weight b [in, out]: the linear op with b's transpose, whose rule knows a
/// weight split over a tp dim (column- or row-parallel), when the plan split b; matmul otherwise.
ShardTensor weighted_matmul(const ShardTensor& a, const ShardTensor& b) {
  if (b.global_shape().size() == 2 && (split_on(b, 0) || split_on(b, 1)))
    return reduced(ops::linear(a, ops::permute(b, {1, 0})));
  return ops::matmul(a, b);
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
    const std::optional<ShardTensor> b = optional_data(context, node, inputs, 2, x.dtype());
    if (split_on(w, 1)) {  // channel-parallel: the channel sum reduced once, then the bias
      const ShardTensor y = reduced(ops::conv(x, w, std::nullopt, options));
      return std::vector<Value>{data_value(b ? ops::bias_add(y, *b) : y)};
    }
    return std::vector<Value>{data_value(ops::conv(x, w, b, options))};
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
    const ShardTensor w = data_of(context, node, inputs, 1, x.dtype());
    const std::optional<ShardTensor> b = optional_data(context, node, inputs, 2, x.dtype());
    if (split_on(w, 0) && options.groups == 1) {  // channel-parallel: reduce, then the bias
      const ShardTensor y = reduced(ops::conv_transpose(x, w, std::nullopt, options));
      return std::vector<Value>{data_value(b ? ops::bias_add(y, *b) : y)};
    }
    return std::vector<Value>{data_value(ops::conv_transpose(x, w, b, options))};
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
    const int64_t first = normalize_axis(node, axis, rank);
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
    // A row-parallel b (split on its in features) gets its bias after the reduction.
    const bool row_parallel = split_on(b, trans_b ? 1 : 0);
    if (trans_b && alpha == 1 && beta == 1 && (!c || c->global_shape().size() == 1) &&
        !row_parallel)
      return std::vector<Value>{data_value(ops::linear(a, b, c))};
    ShardTensor y = trans_b ? reduced(ops::linear(a, b)) : weighted_matmul(a, b);
    if (alpha != 1) y = ops::scale(y, alpha);
    if (c) y = ops::add(y, beta == 1 ? *c : ops::scale(*c, beta));
    return std::vector<Value>{data_value(y)};
  };
}

Step compile_softmax(const OnnxNode& node, bool log) {
  const int64_t axis = node.integer("axis", -1);
  return [axis, log, &node](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    const int64_t dim = normalize_axis(node, axis, static_cast<int64_t>(x.global_shape().size()));
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
        normalize_axis(node, axis, static_cast<int64_t>(parts[0].global_shape().size()));
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
    const bool fused = !inputs.empty() && inputs[0] && !inputs[0]->parts.empty();
    const ShardTensor x = fused ? inputs[0]->parts[0] : data_of(context, node, inputs, 0);
    const Shape shape = fused ? parts_shape(inputs[0]->parts) : x.global_shape();
    const int64_t dim = normalize_axis(node, axis, static_cast<int64_t>(shape.size()));
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
    if (fused) {
      // A fused projection's output: each output one whole part, as it is held.
      const int64_t width = x.global_shape().back();
      check_arg(dim == static_cast<int64_t>(shape.size()) - 1 &&
                    parts == static_cast<int64_t>(inputs[0]->parts.size()) &&
                    std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == width; }),
                "onnx",
                "{}: splits dim {} of '{}' into [{}], but it is the output of a fused projection "
                "split over tp part by part ({} parts of {} features on the last dim); only its "
                "whole parts can be taken",
                node.where(), dim, node.inputs[0], fmt::join(sizes, ", "), inputs[0]->parts.size(),
                width);
      std::vector<Value> outputs;
      for (const ShardTensor& part : inputs[0]->parts) outputs.push_back(data_value(part));
      return outputs;
    }
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
    for (int64_t axis : axes) dims.push_back(normalize_axis(node, axis, rank));
    if (dims.empty())
      for (int64_t d = 0; d < rank; ++d) dims.push_back(d);
    return std::vector<Value>{
        data_value(mean ? ops::mean(x, dims, keepdims) : ops::sum(x, dims, keepdims))};
  };
}

/// A Slice node's starts, ends, axes (default 0..) and steps (default 1), checked to agree in
/// length.
struct SliceArgs {
  std::vector<int64_t> starts, ends, axes, steps;
};

SliceArgs slice_args(const OnnxNode& node, const Values& inputs) {
  SliceArgs args;
  args.starts = constant_of(node, inputs, 1, "starts").as_integers();
  args.ends = constant_of(node, inputs, 2, "ends").as_integers();
  args.steps.assign(args.starts.size(), 1);
  if (const std::optional<HostArray> given = optional_constant(node, inputs, 3, "axes")) {
    args.axes = given->as_integers();
  } else {
    for (size_t i = 0; i < args.starts.size(); ++i) args.axes.push_back(static_cast<int64_t>(i));
  }
  if (const std::optional<HostArray> given = optional_constant(node, inputs, 4, "steps"))
    args.steps = given->as_integers();
  const size_t n = args.starts.size();
  check_arg(args.ends.size() == n && args.axes.size() == n && args.steps.size() == n, "onnx",
            "{}: starts, ends, axes and steps differ in length", node.where());
  return args;
}

/// A Slice start or end clamped into [0, extent] (negative counts from the end).
int64_t clamp_slice_index(int64_t index, int64_t extent) {
  if (index < 0) index = index < -extent ? 0 : index + extent;
  return std::clamp<int64_t>(index, 0, extent);
}

/// A Slice of a fused projection's output (q, k and v side by side, each split over tp on its
/// own): the bounds, which the graph computes from the global shape, must take one whole part
/// along the last dim (and all of every other dim); that part is the result, nothing moves.
Value slice_part(const OnnxNode& node, const Values& inputs) {
  const std::vector<ShardTensor>& parts = inputs[0]->parts;
  const Shape shape = parts_shape(parts);
  const int64_t rank = static_cast<int64_t>(shape.size());
  const int64_t width = parts[0].global_shape().back();
  const auto [starts, ends, axes, steps] = slice_args(node, inputs);
  int64_t part = 0;
  for (size_t i = 0; i < starts.size(); ++i) {
    const int64_t axis = normalize_axis(node, axes[i], rank);
    const int64_t extent = shape[axis];
    const int64_t first = clamp_slice_index(starts[i], extent);
    const int64_t last = std::max(first, clamp_slice_index(ends[i], extent));
    const bool whole_dim = first == 0 && last == extent && steps[i] == 1;
    const bool whole_part =
        axis == rank - 1 && steps[i] == 1 && first % width == 0 && last - first == width;
    check_arg(whole_dim || whole_part, "onnx",
              "{}: takes [{}, {}) step {} of dim {} of '{}', the output of a fused projection "
              "split over tp part by part ({} parts of {} features on the last dim); only one "
              "whole part can be taken",
              node.where(), first, last, steps[i], axis, node.inputs[0], parts.size(), width);
    if (!whole_dim || axis == rank - 1) part = first / width;
  }
  return data_value(parts[part]);
}

/// Slice with unit steps as ops::split along each sliced axis (each part keeps x's layout cut to
/// the rank's box: no communication); other steps through the op fallback.
Step compile_slice(const OnnxNode& node) {
  return [&node](const RunContext& context, const Values& inputs) {
    if (!inputs.empty() && inputs[0] && !inputs[0]->parts.empty())
      return std::vector<Value>{slice_part(node, inputs)};
    ShardTensor x = data_of(context, node, inputs, 0);
    const int64_t rank = static_cast<int64_t>(x.global_shape().size());
    const auto [starts, ends, axes, steps] = slice_args(node, inputs);
    for (size_t i = 0; i < starts.size(); ++i) {
      if (steps[i] != 1) throw UseFallback{};
      const int64_t axis = normalize_axis(node, axes[i], rank);
      const int64_t extent = x.global_shape()[axis];
      const int64_t first = clamp_slice_index(starts[i], extent);
      const int64_t last = std::max(first, clamp_slice_index(ends[i], extent));
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

}  // namespace

Step fused_projection_step(const OnnxNode& node, int64_t parts) {
  return [&node, parts](const RunContext& context, const Values& inputs) {
    const ShardTensor x = data_of(context, node, inputs, 0);
    const ShardTensor w = data_of(context, node, inputs, 1, x.dtype());
    const std::optional<ShardTensor> b = optional_data(context, node, inputs, 2, x.dtype());
    const Shape& shape = w.global_shape();
    check_arg(shape.size() == 2 && shape[0] % parts == 0, "onnx",
              "{}: the stacked weight of a fused projection has shape {} (expected [{} * in, "
              "width])",
              node.where(), shape, parts);
    // Rows [p * in, (p + 1) * in) of the stacked weight are part p's [in, width] weight, split
    // on its columns over tp like the whole: a column-parallel product per part, nothing moves.
    const std::vector<ShardTensor> weights = ops::split(w, {shape[0] / parts}, 0);
    std::vector<ShardTensor> biases;
    if (b) biases = ops::split(*b, {1}, 0);  // [1, width] each, broadcast over the rows
    Value value;
    for (int64_t p = 0; p < parts; ++p) {
      const ShardTensor y = weighted_matmul(x, weights[p]);
      value.parts.push_back(b ? ops::add(y, biases[p]) : y);
    }
    return std::vector<Value>{value};
  };
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
          data_value(weighted_matmul(a, data_of(context, node, inputs, 1, a.dtype())))};
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
  if (op == "Reshape") {
    // The reshapes of attention blocks keep their shards: [.., E] -> [.., heads, E / heads]
    // (ops::split_last) and back (ops::merge_last), and a reshape to the same shape is nothing.
    // Any other reshape of sharded data runs through the op fallback.
    const bool allow_zero = node.integer("allowzero", 0) != 0;
    return Step([&node, allow_zero](const RunContext& context, const Values& inputs) {
      check_arg(inputs.size() >= 2 && inputs[1] && inputs[1]->constant, "onnx",
                "{}: the shape (input 1) must be known without data", node.where());
      const ShardTensor x = data_of(context, node, inputs, 0);
      const Shape& from = x.global_shape();
      Shape to = inputs[1]->constant->as_integers();
      int64_t known = 1, inferred = -1;
      for (size_t d = 0; d < to.size(); ++d) {
        if (to[d] == 0 && !allow_zero) {
          check_arg(d < from.size(), "onnx", "{}: shape {} copies dim {} of a {}-d input",
                    node.where(), to, d, from.size());
          to[d] = from[d];
        }
        if (to[d] == -1) {
          check_arg(inferred < 0, "onnx", "{}: shape {} has two -1", node.where(), to);
          inferred = static_cast<int64_t>(d);
        } else {
          check_arg(to[d] >= 0, "onnx", "{}: shape {} has a negative extent", node.where(), to);
          known *= to[d];
        }
      }
      int64_t numel = 1;
      for (int64_t extent : from) numel *= extent;
      if (inferred >= 0) {
        check_arg(known > 0 && numel % known == 0, "onnx", "{}: cannot reshape {} to {}",
                  node.where(), from, to);
        to[inferred] = numel / known;
      }
      const size_t rank = from.size();
      const auto same_lead = [&](size_t count) {
        return std::equal(from.begin(), from.begin() + static_cast<std::ptrdiff_t>(count),
                          to.begin());
      };
      if (to == from) return std::vector<Value>{data_value(x)};
      if (rank >= 1 && to.size() == rank + 1 && same_lead(rank - 1) &&
          to[rank - 1] * to[rank] == from[rank - 1] && to[rank] > 0)
        return std::vector<Value>{data_value(ops::split_last(x, to[rank]))};
      if (rank >= 2 && to.size() == rank - 1 && same_lead(rank - 2) &&
          to[rank - 2] == from[rank - 2] * from[rank - 1])
        return std::vector<Value>{data_value(ops::merge_last(x))};
      throw UseFallback{};
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

}  // namespace tessera::nn::onnx
