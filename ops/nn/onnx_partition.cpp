// Pipeline cuts and tensor-parallel patterns of an ONNX graph (onnx_partition.hpp).
#include "ops/nn/onnx_partition.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <set>

#include "core/errors.hpp"
#include "ops/nn/onnx_host.hpp"

namespace tessera::nn {

namespace {

using io::OnnxGraph;
using io::OnnxNode;

/// Who makes and who reads each value of a graph, and which values are constants.
struct GraphIndex {
  std::map<std::string, size_t> producer;                ///< node index; graph inputs are absent
  std::map<std::string, std::vector<size_t>> consumers;  ///< node indices, n for a graph output
  std::map<std::string, const Tensor*> initializers;
  std::set<std::string> constants;  ///< initializers and values computed from constants only
  std::vector<bool> data_node;      ///< nodes with an input that is not a constant

  explicit GraphIndex(const OnnxGraph& graph) {
    const size_t n = graph.nodes.size();
    for (const auto& [name, tensor] : graph.initializers) {
      initializers[name] = &tensor;
      constants.insert(name);
    }
    data_node.resize(n, false);
    for (size_t i = 0; i < n; ++i) {
      const OnnxNode& node = graph.nodes[i];
      bool constant = true;
      for (const std::string& input : node.inputs) {
        if (input.empty()) continue;
        std::vector<size_t>& readers = consumers[input];
        if (readers.empty() || readers.back() != i) readers.push_back(i);
        constant = constant && constants.count(input) > 0;
      }
      data_node[i] = !constant;
      for (const std::string& output : node.outputs) {
        if (output.empty()) continue;
        producer[output] = i;
        if (constant) constants.insert(output);
      }
    }
    for (const io::OnnxValue& output : graph.outputs) consumers[output.name].push_back(n);
  }

  /// A float initializer of more than one element: a parameter or buffer, which one stage owns.
  bool is_state(const std::string& name) const {
    const auto found = initializers.find(name);
    return found != initializers.end() && is_floating(found->second->dtype()) &&
           found->second->numel() > 1;
  }
};

/// The nodes with data in [begin, end).
int64_t data_nodes(const GraphIndex& index, size_t begin, size_t end) {
  int64_t count = 0;
  for (size_t i = begin; i < end; ++i) count += index.data_node[i] ? 1 : 0;
  return count;
}

std::string describe(const std::vector<OnnxCutPoint>& cuts) {
  std::vector<std::string> names;
  for (const OnnxCutPoint& cut : cuts) names.push_back(cut.tensor);
  return names.empty() ? std::string("none") : fmt::format("{}", fmt::join(names, ", "));
}

}  // namespace

std::vector<OnnxCutPoint> onnx_cut_points(const OnnxGraph& graph) {
  const GraphIndex index(graph);
  const size_t n = graph.nodes.size();
  // Each activation is alive from its producer (graph inputs: before node 0) to its last reader;
  // each state initializer from its first reader to its last.
  struct Span {
    std::string name;
    size_t first, last;  // crossing position k when first < k <= last
  };
  std::vector<Span> activations, states;
  for (const auto& [name, readers] : index.consumers) {
    if (index.is_state(name)) {
      states.push_back({name, readers.front() + 1, readers.back()});
    } else if (index.constants.count(name) == 0) {
      const auto made = index.producer.find(name);
      activations.push_back(
          {name, made == index.producer.end() ? 0 : made->second + 1, readers.back()});
    }
  }
  std::vector<OnnxCutPoint> cuts;
  std::set<std::string> seen;
  for (size_t k = 1; k < n; ++k) {
    std::vector<std::string> crossing;
    for (const Span& span : activations)
      if (span.first <= k && k <= span.last) crossing.push_back(span.name);
    if (crossing.size() != 1) continue;
    const bool state_split = std::any_of(states.begin(), states.end(), [&](const Span& span) {
      return span.first <= k && k <= span.last;
    });
    if (state_split || data_nodes(index, 0, k) == 0 || data_nodes(index, k, n) == 0) continue;
    if (seen.insert(crossing[0]).second) cuts.push_back({k, crossing[0]});
  }
  return cuts;
}

namespace {

OnnxStageCost stage_cost(const OnnxGraph& graph, const GraphIndex& index, size_t begin,
                         size_t end) {
  std::set<std::string> used;
  for (size_t i = begin; i < end; ++i)
    for (const std::string& input : graph.nodes[i].inputs)
      if (index.is_state(input)) used.insert(input);
  OnnxStageCost cost;
  for (const std::string& name : used) cost.parameters += index.initializers.at(name)->numel();
  cost.nodes = data_nodes(index, begin, end);
  return cost;
}

}  // namespace

OnnxStageCost onnx_stage_cost(const OnnxGraph& graph, size_t begin, size_t end) {
  return stage_cost(graph, GraphIndex(graph), begin, end);
}

std::vector<OnnxCutPoint> balanced_stage_cuts(const OnnxGraph& graph, int stages,
                                              const std::string& op, const std::string& what) {
  const std::vector<OnnxCutPoint> cuts = onnx_cut_points(graph);
  check_arg(stages >= 1 && static_cast<int>(cuts.size()) >= stages - 1, op,
            "{}: the graph of {} has {} cut point(s) (activations that alone cross between the "
            "nodes: {}), too few for {} stages",
            what, graph.source, cuts.size(), describe(cuts), stages);
  // Positions 0, the cut points, n; stages cover [positions[a], positions[b]). One scalar cost:
  // parameters first, node count to break ties.
  const GraphIndex index(graph);
  const size_t n = graph.nodes.size();
  std::vector<size_t> positions{0};
  for (const OnnxCutPoint& cut : cuts) positions.push_back(cut.position);
  positions.push_back(n);
  const size_t points = positions.size();
  const auto cost = [&](size_t a, size_t b) {
    const OnnxStageCost c = stage_cost(graph, index, positions[a], positions[b]);
    return static_cast<double>(c.parameters) * static_cast<double>(n + 1) +
           static_cast<double>(c.nodes);
  };
  constexpr double kNone = std::numeric_limits<double>::infinity();
  // best[s][p]: the smallest largest cost of s + 1 stages covering [0, positions[p]); from[s][p]
  // the start of the last of them.
  std::vector<std::vector<double>> best(stages, std::vector<double>(points, kNone));
  std::vector<std::vector<size_t>> from(stages, std::vector<size_t>(points, 0));
  for (size_t p = 1; p < points; ++p) best[0][p] = cost(0, p);
  for (int s = 1; s < stages; ++s)
    for (size_t p = 1; p < points; ++p)
      for (size_t q = 1; q < p; ++q) {
        if (best[s - 1][q] == kNone) continue;
        const double value = std::max(best[s - 1][q], cost(q, p));
        if (value < best[s][p]) {
          best[s][p] = value;
          from[s][p] = q;
        }
      }
  std::vector<OnnxCutPoint> chosen;
  size_t p = points - 1;
  for (int s = stages - 1; s > 0; --s) {
    p = from[s][p];
    chosen.push_back(cuts[p - 1]);
  }
  std::reverse(chosen.begin(), chosen.end());
  return chosen;
}

std::vector<OnnxCutPoint> named_stage_cuts(const OnnxGraph& graph,
                                           const std::vector<std::string>& tensors,
                                           const std::string& op) {
  const std::vector<OnnxCutPoint> cuts = onnx_cut_points(graph);
  std::vector<OnnxCutPoint> chosen;
  for (const std::string& tensor : tensors) {
    const auto found = std::find_if(cuts.begin(), cuts.end(),
                                    [&](const OnnxCutPoint& cut) { return cut.tensor == tensor; });
    check_arg(found != cuts.end(), op,
              "--stage-cuts: '{}' is not a cut point of {} (the activations that alone cross "
              "between its nodes: {})",
              tensor, graph.source, describe(cuts));
    // (Not check_arg: its message would read chosen.back() of an empty vector.)
    if (!chosen.empty() && chosen.back().position >= found->position)
      throw InvalidArgument(
          op,
          fmt::format("--stage-cuts: '{}' comes before '{}' in {}: give the cuts in graph order",
                      tensor, chosen.back().tensor, graph.source));
    chosen.push_back(*found);
  }
  return chosen;
}

io::OnnxGraph onnx_stage_graph(const OnnxGraph& graph, const std::vector<OnnxCutPoint>& cuts,
                               int stage) {
  const GraphIndex index(graph);
  const size_t begin = stage == 0 ? 0 : cuts[stage - 1].position;
  const size_t end =
      stage < static_cast<int>(cuts.size()) ? cuts[stage].position : graph.nodes.size();
  // The constant nodes before the stage that it reads, with the constant nodes they read.
  std::set<size_t> earlier;
  std::vector<std::string> wanted;
  for (size_t i = begin; i < end; ++i)
    for (const std::string& input : graph.nodes[i].inputs) wanted.push_back(input);
  while (!wanted.empty()) {
    const std::string name = wanted.back();
    wanted.pop_back();
    const auto made = index.producer.find(name);
    if (made == index.producer.end() || made->second >= begin || index.constants.count(name) == 0 ||
        !earlier.insert(made->second).second)
      continue;
    for (const std::string& input : graph.nodes[made->second].inputs) wanted.push_back(input);
  }
  io::OnnxGraph part;
  part.source = fmt::format("{} (stage {})", graph.source, stage);
  part.producer = graph.producer;
  part.opset = graph.opset;
  for (size_t i : earlier) part.nodes.push_back(graph.nodes[i]);
  for (size_t i = begin; i < end; ++i) part.nodes.push_back(graph.nodes[i]);
  std::set<std::string> read;
  for (const OnnxNode& node : part.nodes)
    for (const std::string& input : node.inputs) read.insert(input);
  for (const auto& [name, tensor] : graph.initializers)
    if (read.count(name) > 0) part.initializers.emplace_back(name, tensor);
  const int32_t element_type = graph.inputs.empty() ? 0 : graph.inputs[0].element_type;
  if (stage == 0)
    part.inputs = graph.inputs;
  else
    part.inputs = {io::OnnxValue{cuts[stage - 1].tensor, element_type, {}}};
  if (stage < static_cast<int>(cuts.size()))
    part.outputs = {io::OnnxValue{cuts[stage].tensor, element_type, {}}};
  else
    part.outputs = graph.outputs;
  return part;
}

namespace {

/// A weighted product node: its family, its weight initializer, which weight dims hold the out
/// and in features, and its bias initializer (Gemm's and Conv's third input, or the Add of a
/// 1-d initializer right after a MatMul) with the value the region starts from.
struct Product {
  std::string family;  // "mlp" or "conv"
  size_t node = 0;
  std::string weight, bias;
  int out_dim = 0, in_dim = 1;
  int64_t out = 0;
  size_t last = 0;     // the node whose output starts the region (the bias Add, or the product)
  std::string output;  // that output
};

const std::set<std::string>& unary_ops() {
  static const std::set<std::string> ops = {"Erf",      "Tanh",     "Sigmoid", "Relu", "LeakyRelu",
                                            "Softplus", "Exp",      "Log",     "Neg",  "Abs",
                                            "Sqrt",     "Identity", "Gelu",    "Elu",  "Selu"};
  return ops;
}

const std::set<std::string>& binary_ops() {
  static const std::set<std::string> ops = {"Add", "Sub", "Mul", "Div", "Pow", "Min", "Max"};
  return ops;
}

/// True for a constant of one element (a scalar initializer or Constant node output).
bool scalar_constant(const OnnxGraph& graph, const GraphIndex& index, const std::string& name) {
  if (const auto found = index.initializers.find(name); found != index.initializers.end())
    return found->second->numel() == 1;
  const auto made = index.producer.find(name);
  if (made == index.producer.end()) return false;
  const OnnxNode& node = graph.nodes[made->second];
  if (node.op_type != "Constant") return false;
  if (node.has("value_float") || node.has("value_int")) return true;
  const auto value = node.attributes.find("value");
  return value != node.attributes.end() && value->second.kind == io::OnnxAttribute::Kind::tensor &&
         value->second.tensor.numel() == 1;
}

/// The initializer `name` when it is a float tensor of `dims` dims read by one node only.
const Tensor* own_weight(const GraphIndex& index, const std::string& name, size_t dims_at_least,
                         size_t dims_at_most) {
  const auto found = index.initializers.find(name);
  if (found == index.initializers.end() || !is_floating(found->second->dtype())) return nullptr;
  const size_t dims = found->second->shape().size();
  if (dims < dims_at_least || dims > dims_at_most) return nullptr;
  if (index.consumers.at(name).size() != 1) return nullptr;
  return found->second;
}

std::optional<Product> as_product(const OnnxGraph& graph, const GraphIndex& index, size_t i) {
  const OnnxNode& node = graph.nodes[i];
  if (node.outputs.size() != 1 || node.inputs.size() < 2) return std::nullopt;
  Product product;
  product.node = i;
  product.weight = node.inputs[1];
  std::optional<std::string> bias;
  if (node.op_type == "MatMul" || node.op_type == "Gemm") {
    const Tensor* w = own_weight(index, node.inputs[1], 2, 2);
    if (!w || index.constants.count(node.inputs[0]) > 0) return std::nullopt;
    product.family = "mlp";
    const bool trans_b = node.op_type == "Gemm" && node.integer("transB", 0) != 0;
    if (node.op_type == "Gemm" && node.integer("transA", 0) != 0) return std::nullopt;
    product.out_dim = trans_b ? 0 : 1;
    product.in_dim = 1 - product.out_dim;
    if (node.op_type == "Gemm" && node.input(2)) bias = node.inputs[2];
  } else if (node.op_type == "Conv") {
    const Tensor* w = own_weight(index, node.inputs[1], 3, 5);
    if (!w || node.integer("group", 1) != 1 || index.constants.count(node.inputs[0]) > 0)
      return std::nullopt;
    product.family = "conv";
    product.out_dim = 0;
    product.in_dim = 1;
    if (node.input(2)) bias = node.inputs[2];
  } else if (node.op_type == "ConvTranspose") {  // the conv family, weight [in, out, k..]
    const Tensor* w = own_weight(index, node.inputs[1], 3, 5);
    if (!w || node.integer("group", 1) != 1 || index.constants.count(node.inputs[0]) > 0)
      return std::nullopt;
    product.family = "conv";
    product.out_dim = 1;
    product.in_dim = 0;
    if (node.input(2)) bias = node.inputs[2];
  } else {
    return std::nullopt;
  }
  product.out = index.initializers.at(product.weight)->shape()[product.out_dim];
  product.last = i;
  product.output = node.outputs[0];
  // MatMul's bias: the one Add reading the product, with a 1-d initializer of the out features.
  if (node.op_type == "MatMul") {
    const std::vector<size_t>& readers = index.consumers.count(product.output)
                                             ? index.consumers.at(product.output)
                                             : std::vector<size_t>{};
    if (readers.size() == 1 && readers[0] < graph.nodes.size()) {
      const OnnxNode& add = graph.nodes[readers[0]];
      if (add.op_type == "Add" && add.inputs.size() == 2 && add.outputs.size() == 1) {
        const std::string& other = add.inputs[0] == product.output ? add.inputs[1] : add.inputs[0];
        const Tensor* b = own_weight(index, other, 1, 1);
        if (b && b->shape()[0] == product.out) {
          bias = other;
          product.last = readers[0];
          product.output = add.outputs[0];
        }
      }
    }
  }
  if (bias) {
    const Tensor* b = own_weight(index, *bias, 1, 1);
    if (!b || b->shape()[0] != product.out) return std::nullopt;
    product.bias = *bias;
  }
  return product;
}

/// Values computed from the graph's shapes and constants only (Shape outputs and the shape
/// arithmetic on them): replicated scalars and shapes, never activations.
std::set<std::string> shape_values(const OnnxGraph& graph, const GraphIndex& index) {
  std::set<std::string> values = index.constants;
  for (const OnnxNode& node : graph.nodes) {
    bool shape = node.op_type == "Shape";
    if (!shape && onnx::has_host_op(node.op_type))
      shape = std::all_of(node.inputs.begin(), node.inputs.end(), [&](const std::string& input) {
        return input.empty() || values.count(input) > 0;
      });
    if (shape)
      for (const std::string& output : node.outputs) values.insert(output);
  }
  return values;
}

/// The host values of the constant `name` (an initializer, or computed from constants only),
/// folded with the ops' host semantics; nullopt for anything else.
std::optional<onnx::HostArray> fold_constant(const OnnxGraph& graph, const GraphIndex& index,
                                             const std::string& name,
                                             std::map<std::string, onnx::HostArray>& folded,
                                             int depth = 0) {
  if (index.constants.count(name) == 0 || depth > 64) return std::nullopt;
  if (const auto found = folded.find(name); found != folded.end()) return found->second;
  if (const auto initializer = index.initializers.find(name);
      initializer != index.initializers.end())
    return folded[name] = onnx::host_array(*initializer->second);
  const auto made = index.producer.find(name);
  if (made == index.producer.end()) return std::nullopt;
  const OnnxNode& node = graph.nodes[made->second];
  if (!onnx::has_host_op(node.op_type)) return std::nullopt;
  std::vector<std::optional<onnx::HostArray>> inputs;
  for (const std::string& input : node.inputs) {
    if (input.empty()) {
      inputs.emplace_back();
      continue;
    }
    std::optional<onnx::HostArray> value = fold_constant(graph, index, input, folded, depth + 1);
    if (!value) return std::nullopt;
    inputs.push_back(std::move(value));
  }
  try {
    const std::vector<onnx::HostArray> results = onnx::run_host_op(node, inputs);
    for (size_t k = 0; k < results.size() && k < node.outputs.size(); ++k)
      folded[node.outputs[k]] = results[k];
  } catch (const Error&) {
    return std::nullopt;
  }
  const auto found = folded.find(name);
  return found == folded.end() ? std::nullopt : std::optional<onnx::HostArray>(found->second);
}

/// The heads a Reshape [.., width] -> [.., h, width / h] makes: h from the target's next to last
/// entry when it is a constant, else width over its last entry; 0 when neither is known. The
/// target is a constant, or a Concat of pieces (PyTorch's export of reshape(b, s, h, d): shape
/// pieces Unsqueezed from Gathers, the Python ints constants), read from its end.
int64_t reshape_heads(const OnnxGraph& graph, const GraphIndex& index, const OnnxNode& reshape,
                      int64_t width, std::map<std::string, onnx::HostArray>& folded) {
  if (reshape.inputs.size() < 2) return 0;
  std::vector<std::optional<int64_t>> tail;  // the target's entries from the last one back
  if (const std::optional<onnx::HostArray> whole =
          fold_constant(graph, index, reshape.inputs[1], folded)) {
    const std::vector<int64_t> values = whole->as_integers();
    for (auto it = values.rbegin(); it != values.rend() && tail.size() < 2; ++it)
      tail.push_back(*it);
  } else {
    const auto made = index.producer.find(reshape.inputs[1]);
    if (made == index.producer.end() || graph.nodes[made->second].op_type != "Concat") return 0;
    const OnnxNode& concat = graph.nodes[made->second];
    for (auto it = concat.inputs.rbegin(); it != concat.inputs.rend() && tail.size() < 2; ++it) {
      if (const std::optional<onnx::HostArray> piece = fold_constant(graph, index, *it, folded)) {
        const std::vector<int64_t> values = piece->as_integers();
        for (auto v = values.rbegin(); v != values.rend() && tail.size() < 2; ++v)
          tail.push_back(*v);
        continue;
      }
      // A piece computed from shapes: one entry when it is an Unsqueezed scalar.
      const auto piece_made = index.producer.find(*it);
      if (piece_made == index.producer.end() ||
          graph.nodes[piece_made->second].op_type != "Unsqueeze")
        return 0;
      tail.push_back(std::nullopt);
    }
  }
  if (tail.size() < 2) return 0;
  const std::optional<int64_t> head_size = tail[0], heads = tail[1];
  if (heads && *heads > 0) {
    if (width % *heads != 0) return 0;
    if (head_size && *head_size > 0 && *heads * *head_size != width) return 0;
    return *heads;
  }
  if (head_size && *head_size > 0 && width % *head_size == 0) return width / *head_size;
  return 0;
}

/// An attention chain from the q, k and v values `parts` (each of `width` features) to its
/// output projection, or why there is none.
struct AttentionChain {
  std::optional<Product> projection;
  int64_t heads = 0;
  std::string why;
};

AttentionChain follow_attention(const OnnxGraph& graph, const GraphIndex& index,
                                const std::set<std::string>& shapes,
                                const std::vector<std::string>& parts, size_t from, int64_t width,
                                std::map<std::string, onnx::HostArray>& folded) {
  AttentionChain chain;
  std::set<std::string> region(parts.begin(), parts.end());
  std::set<int64_t> heads;
  int softmaxes = 0, products = 0;
  const auto in_region = [&](const std::string& value) { return region.count(value) > 0; };
  for (size_t j = from; j < graph.nodes.size(); ++j) {
    const OnnxNode& node = graph.nodes[j];
    if (std::none_of(node.inputs.begin(), node.inputs.end(), in_region)) continue;
    if (node.op_type == "Shape") continue;  // global shapes: the same on every layout
    if (chain.projection) {
      chain.why = fmt::format("{} reads a value of the attention after its output projection",
                              node.where());
      chain.projection.reset();
      return chain;
    }
    const std::optional<Product> product = as_product(graph, index, j);
    if (product && product->family == "mlp" && in_region(node.inputs[0]) &&
        std::none_of(node.inputs.begin() + 1, node.inputs.end(), in_region) &&
        index.initializers.at(product->weight)->shape()[product->in_dim] == width) {
      chain.projection = product;
      continue;
    }
    bool kept = node.outputs.size() == 1;
    if (node.op_type == "Reshape") {
      kept = kept && in_region(node.inputs[0]) && node.inputs.size() >= 2 &&
             !in_region(node.inputs[1]);
      if (kept && std::find(parts.begin(), parts.end(), node.inputs[0]) != parts.end()) {
        const int64_t h = reshape_heads(graph, index, node, width, folded);
        if (h == 0) {
          chain.why =
              fmt::format("the head count of {} is not a constant of the graph", node.where());
          return chain;
        }
        heads.insert(h);
      }
    } else if (node.op_type == "MatMul") {
      kept = kept && std::all_of(node.inputs.begin(), node.inputs.end(), in_region);
      products += kept ? 1 : 0;
    } else if (node.op_type == "Softmax") {
      ++softmaxes;
    } else if (binary_ops().count(node.op_type)) {
      // The other operand: a value of the region or something replicated (a constant, a scale
      // computed from the shapes, as sqrt(head size)).
      kept = kept && std::all_of(node.inputs.begin(), node.inputs.end(), [&](const auto& v) {
               return in_region(v) || shapes.count(v) > 0;
             });
    } else {
      kept =
          kept && in_region(node.inputs[0]) &&
          std::none_of(node.inputs.begin() + 1, node.inputs.end(), in_region) &&
          (node.op_type == "Transpose" || node.op_type == "Identity" || node.op_type == "Dropout" ||
           node.op_type == "Cast" || unary_ops().count(node.op_type) > 0);
    }
    if (!kept) {
      chain.why = fmt::format("{} reads a value of the attention", node.where());
      return chain;
    }
    region.insert(node.outputs[0]);
  }
  for (const io::OnnxValue& output : graph.outputs)
    if (in_region(output.name)) chain.why = fmt::format("'{}' is a graph output", output.name);
  if (!chain.projection && chain.why.empty())
    chain.why = fmt::format(
        "no output projection (a MatMul with a weight of {} input features) reads it", width);
  if (chain.why.empty() && (softmaxes == 0 || products < 2))
    chain.why = "no Softmax between two products of the heads";
  if (chain.why.empty() && heads.size() != 1)
    chain.why = heads.empty() ? "no Reshape makes heads of q, k and v"
                              : "the Reshapes of q, k and v make different head counts";
  if (!chain.why.empty()) {
    chain.projection.reset();
    return chain;
  }
  chain.heads = *heads.begin();
  return chain;
}

/// The attention patterns of `graph` into `plan` (their nodes into `used`).
void plan_attention(const OnnxGraph& graph, const GraphIndex& index, int tp,
                    OnnxTensorParallelPlan& plan, std::set<size_t>& used) {
  const size_t n = graph.nodes.size();
  const std::set<std::string> shapes = shape_values(graph, index);
  std::map<std::string, onnx::HostArray> folded;
  for (size_t i = 0; i < n; ++i) {
    if (used.count(i) || graph.nodes[i].op_type != "MatMul") continue;
    const std::optional<Product> first = as_product(graph, index, i);
    if (!first) continue;
    // Fused: only Slice or Split nodes read the projection's output (and Shape nodes, for the
    // bounds). Separate: three MatMuls of one input with weights of one width.
    std::vector<size_t> readers;
    if (const auto found = index.consumers.find(first->output); found != index.consumers.end())
      for (size_t reader : found->second)
        if (reader >= n || graph.nodes[reader].op_type != "Shape") readers.push_back(reader);
    const bool fused =
        !readers.empty() && std::all_of(readers.begin(), readers.end(), [&](size_t reader) {
          if (reader >= n) return false;  // a graph output
          const OnnxNode& node = graph.nodes[reader];
          return (node.op_type == "Slice" || node.op_type == "Split") && !node.inputs.empty() &&
                 node.inputs[0] == first->output;
        });
    std::vector<std::string> parts;
    std::vector<Product> columns{*first};
    int64_t width = first->out;
    if (fused) {
      for (size_t reader : readers)
        for (const std::string& output : graph.nodes[reader].outputs) parts.push_back(output);
      if (parts.size() < 2 || first->out % static_cast<int64_t>(parts.size()) != 0) {
        plan.notes.push_back(fmt::format(
            "attention at {} left replicated: its output of {} features is read as {} part(s)",
            graph.nodes[i].where(), first->out, parts.size()));
        continue;
      }
      width = first->out / static_cast<int64_t>(parts.size());
    } else {
      for (size_t k = i + 1; k < n; ++k) {
        if (used.count(k) || graph.nodes[k].op_type != "MatMul") continue;
        const std::optional<Product> other = as_product(graph, index, k);
        if (other && graph.nodes[k].inputs[0] == graph.nodes[i].inputs[0] &&
            other->out == first->out)
          columns.push_back(*other);
      }
      if (columns.size() != 3) continue;  // not q, k and v (an MLP may share its input)
      for (const Product& column : columns) parts.push_back(column.output);
    }
    const AttentionChain chain =
        follow_attention(graph, index, shapes, parts, first->last + 1, width, folded);
    if (!chain.projection) {
      plan.notes.push_back(
          fmt::format("attention at {} left replicated: {}", graph.nodes[i].where(), chain.why));
      continue;
    }
    const Product& projection = *chain.projection;
    OnnxTensorParallelPattern pattern{"attention", graph.nodes[i].name,
                                      graph.nodes[projection.node].name, chain.heads};
    for (const Product& column : columns) used.insert(column.node);
    used.insert(projection.node);
    if (chain.heads % tp != 0) {
      plan.skipped.push_back(pattern);
      continue;
    }
    plan.patterns.push_back(pattern);
    if (fused) {
      // The stacked layout [parts * in, width] and [parts, width]: split on dim 1.
      plan.sharded[first->weight] = 1;
      if (!first->bias.empty()) plan.sharded[first->bias] = 1;
      plan.fused.push_back({graph.nodes[i].name,
                            first->last != first->node ? graph.nodes[first->last].name : "",
                            first->weight, first->bias, static_cast<int64_t>(parts.size())});
    } else {
      for (const Product& column : columns) {
        plan.sharded[column.weight] = column.out_dim;
        if (!column.bias.empty()) plan.sharded[column.bias] = 0;
      }
    }
    plan.sharded[projection.weight] = projection.in_dim;
  }
}

}  // namespace

OnnxTensorParallelPlan onnx_tensor_parallel_plan(const OnnxGraph& graph, int tp) {
  const GraphIndex index(graph);
  const size_t n = graph.nodes.size();
  OnnxTensorParallelPlan plan;
  std::set<size_t> used;  // products already in a pattern
  plan_attention(graph, index, tp, plan, used);
  for (size_t i = 0; i < n; ++i) {
    if (used.count(i)) continue;
    const std::optional<Product> first = as_product(graph, index, i);
    if (!first) continue;
    // Grow the region from P1's output through elementwise nodes until the second product.
    std::set<std::string> region{first->output};
    std::optional<Product> second;
    bool closed = true;
    for (size_t j = first->last + 1; j < n && closed; ++j) {
      const OnnxNode& node = graph.nodes[j];
      const bool reads_region = std::any_of(node.inputs.begin(), node.inputs.end(),
                                            [&](const std::string& v) { return region.count(v); });
      if (!reads_region) continue;
      if (second) {  // a region value read after P2: it leaves the region
        closed = false;
        break;
      }
      const std::optional<Product> product = as_product(graph, index, j);
      if (product && !used.count(j) && product->family == first->family &&
          region.count(node.inputs[0]) &&
          std::none_of(node.inputs.begin() + 1, node.inputs.end(),
                       [&](const std::string& v) { return region.count(v); }) &&
          index.initializers.at(product->weight)->shape()[product->in_dim] == first->out) {
        second = product;
        continue;
      }
      bool elementwise =
          node.outputs.size() == 1 && unary_ops().count(node.op_type) && node.inputs.size() == 1;
      if (binary_ops().count(node.op_type) && node.outputs.size() == 1) {
        elementwise = std::all_of(node.inputs.begin(), node.inputs.end(), [&](const auto& v) {
          return region.count(v) > 0 || scalar_constant(graph, index, v);
        });
      }
      if (!elementwise) {
        closed = false;
        break;
      }
      region.insert(node.outputs[0]);
    }
    for (const io::OnnxValue& output : graph.outputs) closed = closed && !region.count(output.name);
    if (!closed || !second) continue;
    OnnxTensorParallelPattern pattern{first->family, graph.nodes[first->node].name,
                                      graph.nodes[second->node].name, first->out};
    used.insert(second->node);
    if (first->out % tp != 0) {
      plan.skipped.push_back(pattern);
      continue;
    }
    plan.patterns.push_back(pattern);
    plan.sharded[first->weight] = first->out_dim;
    if (!first->bias.empty()) plan.sharded[first->bias] = 0;
    plan.sharded[second->weight] = second->in_dim;
  }
  // Attention was planned first; the patterns in node order.
  std::map<std::string, size_t> position;
  for (size_t i = 0; i < n; ++i) position[graph.nodes[i].name] = i;
  for (auto* patterns : {&plan.patterns, &plan.skipped})
    std::stable_sort(patterns->begin(), patterns->end(), [&](const auto& a, const auto& b) {
      return position[a.first] < position[b.first];
    });
  return plan;
}

}  // namespace tessera::nn
