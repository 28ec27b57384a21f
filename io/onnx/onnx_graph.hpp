// An ONNX model as a plain graph description: the graph's inputs and outputs, its initializers
// as host tensors, and its nodes with their attributes, in the file's (topological) order. The
// io layer parses and validates files into this; the model layer (ops/nn/onnx_model.hpp) builds
// Tessera ops from it. Nothing here depends on protobuf or the onnx library.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace tessera::io {

/// One node attribute, of one of the kinds the model layer reads.
struct OnnxAttribute {
  enum class Kind { integer, real, text, integers, reals, tensor, texts, other };
  Kind kind = Kind::other;
  int64_t integer = 0;
  double real = 0;
  std::string text;
  std::vector<int64_t> integers;
  std::vector<double> reals;
  std::vector<std::string> texts;
  Tensor tensor;
};

/// One node: op type, named inputs and outputs ("" for an absent optional input), attributes.
struct OnnxNode {
  std::string name;  ///< the file's node name, or "<op_type>#<index>" when it has none
  std::string op_type;
  std::vector<std::string> inputs, outputs;
  std::map<std::string, OnnxAttribute> attributes;

  /// True when the node has the attribute.
  bool has(const std::string& attribute) const { return attributes.count(attribute) > 0; }
  /// The integer attribute, or `fallback` when absent; an attribute of another kind is an error
  /// naming the node.
  int64_t integer(const std::string& attribute, int64_t fallback) const;
  /// The float attribute, or `fallback` when absent.
  double real(const std::string& attribute, double fallback) const;
  /// The string attribute, or `fallback` when absent.
  std::string text(const std::string& attribute, const std::string& fallback) const;
  /// The integer list attribute, or `fallback` when absent.
  std::vector<int64_t> integers(const std::string& attribute,
                                const std::vector<int64_t>& fallback = {}) const;
  /// The tensor attribute (required: an error naming the node when absent).
  const Tensor& tensor(const std::string& attribute) const;
  /// Input `index` when present and not "", else nullopt.
  std::optional<std::string> input(size_t index) const;
  /// "node 'NAME' (OP_TYPE)", the way every error about the node starts.
  std::string where() const;
};

/// A graph input or output: name, element type (ONNX TensorProto data type) and shape (-1 for a
/// dim without a fixed extent).
struct OnnxValue {
  std::string name;
  int32_t element_type = 0;
  std::vector<int64_t> shape;
};

/// A parsed model: the default-domain opset, the graph's real inputs (initializers excluded),
/// outputs, initializers (in file order) and nodes (topologically ordered, every input defined
/// before use).
struct OnnxGraph {
  std::string source;  ///< the file name (for messages)
  std::string producer;
  int64_t opset = 0;
  std::vector<OnnxValue> inputs, outputs;
  std::vector<std::pair<std::string, Tensor>> initializers;
  std::vector<OnnxNode> nodes;
  /// The model as read (protobuf bytes), kept for write_onnx; null for graphs built in code.
  /// Shared, read-only: copies of a graph (one per rank or stage) share it.
  std::shared_ptr<const std::string> serialized;
};

/// The opsets Tessera reads (those PyTorch 1.13..2.x exports by default or on request).
inline constexpr int64_t kOnnxOpsetMin = 13;
inline constexpr int64_t kOnnxOpsetMax = 17;

/// Reads and validates an ONNX model file. Any problem (missing, truncated or malformed file, an
/// opset outside 13..17, an input used before it is defined, an initializer whose data does not
/// match its shape, an element type Tessera does not hold) throws one InvalidArgument tagged
/// "onnx" naming the file, or the node and its op type. Throws NotAvailable in a build without
/// ONNX support.
OnnxGraph read_onnx(const std::string& file);

/// As read_onnx, from the bytes of a model in memory; `source` names it in messages.
OnnxGraph parse_onnx(const std::string& bytes, const std::string& source);

/// Writes the model `graph` was read from to `file` with the initializers named in `values`
/// replaced by those tensors (each of the initializer's shape, converted to its element type;
/// float initializers only), everything else as read: the export of a trained network, loadable
/// by PyTorch's ONNX consumers. Written to a temporary file renamed over `file` once complete.
/// Throws InvalidArgument tagged "onnx" for an unknown name or a shape mismatch.
void write_onnx(const OnnxGraph& graph, const std::vector<std::pair<std::string, Tensor>>& values,
                const std::string& file);

/// True when this build reads ONNX files (TESSERA_WITH_ONNX found the onnx library).
bool onnx_available();

/// The checks of read_onnx that need no protobuf: the opset range, unique non-empty names, every
/// node input defined (a graph input, an initializer or an earlier node's output) before use,
/// every graph output defined. Throws InvalidArgument tagged "onnx".
void validate_onnx_graph(const OnnxGraph& graph);

}  // namespace tessera::io
