// Attribute access and the protobuf-free validation of a parsed ONNX graph (onnx_graph.hpp).
#include "io/onnx/onnx_graph.hpp"

#include <fmt/format.h>

#include <set>

#include "core/errors.hpp"

namespace tessera::io {

namespace {

const OnnxAttribute* find_attribute(const OnnxNode& node, const std::string& name,
                                    OnnxAttribute::Kind kind, const char* kind_name) {
  const auto found = node.attributes.find(name);
  if (found == node.attributes.end()) return nullptr;
  check_arg(found->second.kind == kind, "onnx", "{}: attribute '{}' is not {}", node.where(), name,
            kind_name);
  return &found->second;
}

}  // namespace

int64_t OnnxNode::integer(const std::string& attribute, int64_t fallback) const {
  const OnnxAttribute* found =
      find_attribute(*this, attribute, OnnxAttribute::Kind::integer, "an integer");
  return found ? found->integer : fallback;
}

double OnnxNode::real(const std::string& attribute, double fallback) const {
  const OnnxAttribute* found =
      find_attribute(*this, attribute, OnnxAttribute::Kind::real, "a float");
  return found ? found->real : fallback;
}

std::string OnnxNode::text(const std::string& attribute, const std::string& fallback) const {
  const OnnxAttribute* found =
      find_attribute(*this, attribute, OnnxAttribute::Kind::text, "a string");
  return found ? found->text : fallback;
}

std::vector<int64_t> OnnxNode::integers(const std::string& attribute,
                                        const std::vector<int64_t>& fallback) const {
  const OnnxAttribute* found =
      find_attribute(*this, attribute, OnnxAttribute::Kind::integers, "a list of integers");
  return found ? found->integers : fallback;
}

const Tensor& OnnxNode::tensor(const std::string& attribute) const {
  const OnnxAttribute* found =
      find_attribute(*this, attribute, OnnxAttribute::Kind::tensor, "a tensor");
  check_arg(found != nullptr, "onnx", "{}: needs the tensor attribute '{}'", where(), attribute);
  return found->tensor;
}

std::optional<std::string> OnnxNode::input(size_t index) const {
  if (index >= inputs.size() || inputs[index].empty()) return std::nullopt;
  return inputs[index];
}

std::string OnnxNode::where() const {
  return fmt::format("node '{}' ({})", name, op_type);
}

void validate_onnx_graph(const OnnxGraph& graph) {
  check_arg(graph.opset >= kOnnxOpsetMin && graph.opset <= kOnnxOpsetMax, "onnx",
            "{}: opset {} of the default domain is not supported (expected {} to {}; export with "
            "torch.onnx.export(..., opset_version=17))",
            graph.source, graph.opset, kOnnxOpsetMin, kOnnxOpsetMax);
  check_arg(!graph.inputs.empty(), "onnx", "{}: the graph has no inputs", graph.source);
  check_arg(!graph.outputs.empty(), "onnx", "{}: the graph has no outputs", graph.source);
  std::set<std::string> defined;
  for (const OnnxValue& input : graph.inputs) {
    check_arg(!input.name.empty(), "onnx", "{}: a graph input has no name", graph.source);
    check_arg(defined.insert(input.name).second, "onnx", "{}: graph input '{}' is defined twice",
              graph.source, input.name);
  }
  for (const auto& [name, tensor] : graph.initializers) {
    check_arg(!name.empty(), "onnx", "{}: an initializer has no name", graph.source);
    check_arg(defined.insert(name).second, "onnx", "{}: initializer '{}' is defined twice",
              graph.source, name);
  }
  for (const OnnxNode& node : graph.nodes) {
    check_arg(!node.op_type.empty(), "onnx", "{}: a node has no op type", graph.source);
    for (const std::string& input : node.inputs)
      check_arg(input.empty() || defined.count(input) > 0, "onnx",
                "{}: input '{}' is not defined before the node (a graph input, an initializer or "
                "an earlier node's output)",
                node.where(), input);
    for (const std::string& output : node.outputs)
      check_arg(output.empty() || defined.insert(output).second, "onnx",
                "{}: output '{}' is defined twice", node.where(), output);
  }
  for (const OnnxValue& output : graph.outputs)
    check_arg(defined.count(output.name) > 0, "onnx",
              "{}: graph output '{}' is not computed by any node", graph.source, output.name);
}

}  // namespace tessera::io
