// OnnxModel (onnx_model.hpp): every node is compiled once into a step (onnx_nodes.hpp: its
// attributes read and checked when the model is built), then run in the graph's order on values
// that are either data on the mesh (ShardTensors) or constants known without data (host arrays:
// shapes, scales, Constant nodes). A float initializer is both: its Parameter for the ops and its
// host values for the inputs that must be constants.
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
#include "ops/nn/onnx_nodes.hpp"
#include "ops/ops.hpp"

namespace tessera::nn {

namespace {

using io::OnnxNode;
using onnx::data_of;
using onnx::data_value;
using onnx::HostArray;
using onnx::RunContext;
using onnx::Step;
using onnx::UseFallback;
using onnx::Value;
using onnx::Values;

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
    /// The values the step reads instead of the node's inputs (a recognised pattern's inputs).
    std::vector<std::string> input_override;
  };
  std::vector<Compiled> compiled;
  std::set<std::string> fallbacks, warned;
  /// The initializers held stacked by parts (fused projections' weights and biases): parts.
  std::map<std::string, int64_t> stacked;

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

/// A fused projection's initializer in its stacked layout: a weight [in, parts * width] as
/// [parts * in, width] (part p's columns become rows [p * in, (p + 1) * in)), a bias
/// [parts * width] as [parts, width] (the same values in the same order).
Tensor stacked_by_parts(const Tensor& value, int64_t parts) {
  const Shape& shape = value.shape();
  if (shape.size() == 1) return value.contiguous().reshape({parts, shape[0] / parts});
  const int64_t in = shape[0], width = shape[1] / parts;
  Tensor stacked = Tensor::empty({parts * in, width}, value.dtype(), value.device());
  for (int64_t p = 0; p < parts; ++p)
    stacked.slice(0, p * in, (p + 1) * in).copy_from(value.slice(1, p * width, (p + 1) * width));
  return stacked;
}

/// The inverse of stacked_by_parts: the value in the initializer's layout `shape`.
Tensor unstacked(const Tensor& stacked, int64_t parts, const Shape& shape) {
  if (shape.size() == 1) return stacked.contiguous().reshape(shape);  // a bias [parts * width]
  const int64_t in = shape[0], width = shape[1] / parts;
  Tensor value = Tensor::empty(shape, stacked.dtype(), stacked.device());
  for (int64_t p = 0; p < parts; ++p)
    value.slice(1, p * width, (p + 1) * width).copy_from(stacked.slice(0, p * in, (p + 1) * in));
  return value;
}

}  // namespace

OnnxModel::OnnxModel(io::OnnxGraph graph, const DeviceMesh& mesh, DType dtype,
                     const std::map<std::string, std::vector<Placement>>& placements,
                     const std::vector<OnnxFusedProjection>& fused)
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
  // Fused projections: the MatMul (or, with a bias, its Add, reading x, the weight and the bias)
  // computes every part on its own.
  for (const OnnxFusedProjection& projection : fused) {
    std::optional<size_t> product, bias_add;
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      if (g.nodes[i].name == projection.node) product = i;
      if (!projection.bias_node.empty() && g.nodes[i].name == projection.bias_node) bias_add = i;
    }
    if (!product) continue;
    const OnnxNode& matmul = g.nodes[*product];
    check_arg(matmul.op_type == "MatMul" && matmul.inputs.size() == 2 &&
                  matmul.inputs[1] == projection.weight &&
                  (projection.bias_node.empty() || bias_add),
              "onnx", "{}: not the fused projection of weight '{}' the plan names", matmul.where(),
              projection.weight);
    state.stacked[projection.weight] = projection.parts;
    if (bias_add) {
      state.stacked[projection.bias] = projection.parts;
      state.compiled[*product].skip = true;
      state.compiled[*bias_add].input_override = {matmul.inputs[0], projection.weight,
                                                  projection.bias};
      state.compiled[*bias_add].step = onnx::fused_projection_step(matmul, projection.parts);
    } else {
      state.compiled[*product].step = onnx::fused_projection_step(matmul, projection.parts);
    }
  }
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const OnnxNode& node = g.nodes[i];
    if (state.compiled[i].skip) continue;
    if (const std::optional<GroupNormMatch> match = match_group_norm(g, i)) {
      state.compiled[i].skip = true;
      state.compiled[match->instance_norm].skip = true;
      const OnnxNode& back = g.nodes[match->reshape_back];
      const int64_t groups = match->groups;
      const double eps = match->eps;
      state.compiled[match->reshape_back].input_override = {node.inputs[0]};
      state.compiled[match->reshape_back].step =
          Step([&back, groups, eps](const RunContext& context, const Values& inputs) {
            return std::vector<Value>{data_value(ops::group_norm(
                data_of(context, back, inputs, 0), groups, std::nullopt, std::nullopt, eps))};
          });
      continue;
    }
    if (state.compiled[i].step) continue;  // a pattern's last node, compiled above
    state.compiled[i].step = onnx::compile_sharded(node, opset);
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
      if (!onnx::is_constant_position(node.op_type, k)) data_inputs.insert(node.inputs[k]);
    }
  const Device device = current_rank_context().device();
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  for (const auto& [name, tensor] : g.initializers) {
    Value value;
    value.constant = onnx::shared_host_array(tensor);
    if (is_floating(tensor.dtype()) && data_inputs.count(name) > 0) {
      const auto placed = placements.find(name);
      check_arg(placed == placements.end() || statistics.count(name) == 0, "onnx",
                "{}: '{}' holds running statistics; only parameters take a placement", g.source,
                name);
      const auto stacked = state.stacked.find(name);
      const Tensor layout =
          stacked == state.stacked.end() ? tensor : stacked_by_parts(tensor, stacked->second);
      ShardTensor values =
          ShardTensor::distribute(layout.to_dtype(dtype).to(device), mesh,
                                  placed == placements.end() ? replicated : placed->second);
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
    if (!compiled.input_override.empty()) {
      // A recognised pattern's step (GroupNorm on the first Reshape's input x; a fused
      // projection on x, its weight and bias) reads the pattern's inputs.
      for (const std::string& name : compiled.input_override)
        node_inputs.push_back(values.at(name));
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
      if (!compiled.input_override.empty()) {
        results = (*compiled.step)(context, node_inputs);
      } else if (node.op_type == "Shape" && !node_inputs.empty() && node_inputs[0] &&
                 (node_inputs[0]->sharded || !node_inputs[0]->parts.empty())) {
        // The global shape: known on every rank without data (a fused projection's: its parts
        // side by side on the last dim).
        HostArray shape;
        shape.integral = true;
        Shape global;
        if (node_inputs[0]->sharded) {
          global = node_inputs[0]->sharded->global_shape();
        } else {
          global = node_inputs[0]->parts[0].global_shape();
          global.back() *= static_cast<int64_t>(node_inputs[0]->parts.size());
        }
        const int64_t rank = static_cast<int64_t>(global.size());
        int64_t start = node.integer("start", 0), end = node.integer("end", rank);
        start = std::clamp(start < 0 ? start + rank : start, int64_t{0}, rank);
        end = std::clamp(end < 0 ? end + rank : end, int64_t{0}, rank);
        for (int64_t d = start; d < end; ++d)
          shape.values.push_back(static_cast<double>(global[d]));
        shape.shape = {static_cast<int64_t>(shape.values.size())};
        results.push_back(onnx::constant_value(std::move(shape)));
      } else if (node.op_type == "Identity" && !node_inputs.empty() && node_inputs[0]) {
        results.push_back(*node_inputs[0]);
      } else if (onnx::has_host_op(node.op_type) && all_constant) {
        // Shape arithmetic: folded on the host, on every rank alike.
        std::vector<std::optional<HostArray>> constants;
        for (const std::optional<Value>& input : node_inputs)
          constants.push_back(input && input->constant ? std::optional(*input->constant)
                                                       : std::nullopt);
        for (HostArray& result : onnx::run_host_op(node, constants))
          results.push_back(onnx::constant_value(std::move(result)));
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
          } else if (!input->parts.empty()) {
            throw InvalidArgument(
                "onnx", fmt::format("{}: reads the output of a fused projection split over tp "
                                    "part by part, which only Shape, Slice and Split may read",
                                    node.where()));
          } else if (input->constant) {
            gathered.push_back(*input->constant);
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
            results.push_back(onnx::constant_value(std::move(result)));
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

Tensor OnnxModel::full_initializer(const std::string& name) const {
  const State& state = *state_;
  for (const auto& [key, parameter] : state.parameters)
    if (key == name) {
      const Tensor full = parameter.tensor().full_tensor();
      const auto stacked = state.stacked.find(name);
      if (stacked == state.stacked.end()) return full;
      for (const auto& [initializer, tensor] : state.graph.initializers)
        if (initializer == name)
          return unstacked(full.to(Device::cpu()), stacked->second, tensor.shape());
    }
  for (const auto& [key, buffer] : state.buffers)
    if (key == name) return buffer.full_tensor();
  throw InvalidArgument("onnx",
                        fmt::format("{}: no parameter or buffer '{}'", state.graph.source, name));
}

void OnnxModel::save(const std::string& file) const {
  const State& state = *state_;
  // Every rank gathers each value (nothing moves for a replicated one); only rank 0 writes.
  std::vector<std::pair<std::string, Tensor>> values;
  for (const auto& [name, parameter] : state.parameters)
    values.emplace_back(name, full_initializer(name));
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
