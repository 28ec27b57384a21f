// Reading ONNX model files with the onnx library's protobuf classes (onnx_graph.hpp). Every value
// read from the file is checked before it sizes anything (dims, data lengths), so a truncated or
// corrupted file ends in one InvalidArgument, never in a huge allocation or a crash; protobuf's
// own log lines are silenced, so the error is the only line printed.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <google/protobuf/stubs/logging.h>
#include <onnx/onnx_pb.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "core/errors.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/estimate/real_data.hpp"
#include "io/onnx/onnx_graph.hpp"

namespace tessera::io {

namespace {

/// The Tessera dtype of an ONNX element type, or nullopt for types Tessera does not hold.
std::optional<DType> dtype_of_element(int32_t element_type) {
  switch (element_type) {
    case onnx::TensorProto::FLOAT: return DType::f32;
    case onnx::TensorProto::DOUBLE: return DType::f64;
    case onnx::TensorProto::FLOAT16: return DType::f16;
    case onnx::TensorProto::BFLOAT16: return DType::bf16;
    case onnx::TensorProto::INT32: return DType::i32;
    case onnx::TensorProto::INT64: return DType::i64;
    case onnx::TensorProto::UINT8:
    case onnx::TensorProto::BOOL: return DType::u8;
    default: return std::nullopt;
  }
}

/// A TensorProto as a host Tensor; `what` names it in errors ("initializer 'w'").
Tensor tensor_of(const onnx::TensorProto& proto, const std::string& what) {
  check_arg(proto.data_location() != onnx::TensorProto::EXTERNAL, "onnx",
            "{}: external data is not supported (export the model as one file)", what);
  const std::optional<DType> dtype = dtype_of_element(proto.data_type());
  check_arg(dtype.has_value(), "onnx", "{}: element type {} is not supported", what,
            proto.data_type());
  Shape shape;
  int64_t numel = 1;
  for (int64_t dim : proto.dims()) {
    check_arg(dim >= 0, "onnx", "{}: negative dim {}", what, dim);
    check_arg(dim == 0 || numel <= std::numeric_limits<int32_t>::max() / dim, "onnx",
              "{}: dims {} are too large", what, fmt::join(proto.dims(), ","));
    numel *= dim;
    shape.push_back(dim);
  }
  // Estimate mode reads the model file for real: the import folds constants and matches
  // patterns (GroupNorm's scale and bias) by value. The model's parameters become shape-only
  // when they are copied onto the mesh.
  const estimate::RealDataScope real_data;
  const bool values = true;
  const size_t element_size = dtype_size(*dtype);
  const size_t bytes = static_cast<size_t>(numel) * element_size;
  // Sized only after the file's data is known to hold that many elements.
  auto check_count = [&](int64_t count) {
    check_arg(count == numel, "onnx", "{}: holds {} values, its shape [{}] needs {}", what, count,
              fmt::join(shape, ", "), numel);
  };
  if (proto.has_raw_data()) {
    check_arg(proto.raw_data().size() == bytes, "onnx",
              "{}: holds {} bytes of data, its shape [{}] of {} needs {}", what,
              proto.raw_data().size(), fmt::join(shape, ", "), dtype_name(*dtype), bytes);
    Tensor tensor = Tensor::empty(shape, *dtype);
    if (bytes > 0 && values) std::memcpy(tensor.raw_data(), proto.raw_data().data(), bytes);
    return tensor;
  }
  if (!values) return Tensor::empty(shape, *dtype);  // floating, in estimate mode
  Tensor tensor;
  switch (proto.data_type()) {
    case onnx::TensorProto::FLOAT:
      check_count(proto.float_data_size());
      tensor = Tensor::empty(shape, *dtype);
      for (int64_t i = 0; i < numel; ++i) tensor.data<float>()[i] = proto.float_data(i);
      break;
    case onnx::TensorProto::DOUBLE:
      check_count(proto.double_data_size());
      tensor = Tensor::empty(shape, *dtype);
      for (int64_t i = 0; i < numel; ++i) tensor.data<double>()[i] = proto.double_data(i);
      break;
    case onnx::TensorProto::INT64:
      check_count(proto.int64_data_size());
      tensor = Tensor::empty(shape, *dtype);
      for (int64_t i = 0; i < numel; ++i) tensor.data<int64_t>()[i] = proto.int64_data(i);
      break;
    case onnx::TensorProto::INT32:
      check_count(proto.int32_data_size());
      tensor = Tensor::empty(shape, *dtype);
      for (int64_t i = 0; i < numel; ++i) tensor.data<int32_t>()[i] = proto.int32_data(i);
      break;
    case onnx::TensorProto::UINT8:
    case onnx::TensorProto::BOOL:
      check_count(proto.int32_data_size());
      tensor = Tensor::empty(shape, *dtype);
      for (int64_t i = 0; i < numel; ++i)
        tensor.data<uint8_t>()[i] = static_cast<uint8_t>(proto.int32_data(i));
      break;
    default:  // f16 / bf16 bit patterns in int32_data
      check_count(proto.int32_data_size());
      tensor = Tensor::empty(shape, *dtype);
      for (int64_t i = 0; i < numel; ++i)
        reinterpret_cast<uint16_t*>(tensor.raw_data())[i] =
            static_cast<uint16_t>(proto.int32_data(i));
      break;
  }
  return tensor;
}

/// A float attribute as the double its shortest decimal form names: PyTorch writes eps=1e-5 as
/// the float 9.99999974738e-06, and computing with 1e-5 is what the exported model meant.
double decimal_of(float value) {
  return std::stod(fmt::format("{}", value));
}

OnnxAttribute attribute_of(const onnx::AttributeProto& proto, const std::string& what) {
  OnnxAttribute attribute;
  switch (proto.type()) {
    case onnx::AttributeProto::INT:
      attribute.kind = OnnxAttribute::Kind::integer;
      attribute.integer = proto.i();
      break;
    case onnx::AttributeProto::FLOAT:
      attribute.kind = OnnxAttribute::Kind::real;
      attribute.real = decimal_of(proto.f());
      break;
    case onnx::AttributeProto::STRING:
      attribute.kind = OnnxAttribute::Kind::text;
      attribute.text = proto.s();
      break;
    case onnx::AttributeProto::INTS:
      attribute.kind = OnnxAttribute::Kind::integers;
      attribute.integers.assign(proto.ints().begin(), proto.ints().end());
      break;
    case onnx::AttributeProto::FLOATS:
      attribute.kind = OnnxAttribute::Kind::reals;
      for (float value : proto.floats()) attribute.reals.push_back(decimal_of(value));
      break;
    case onnx::AttributeProto::STRINGS:
      attribute.kind = OnnxAttribute::Kind::texts;
      attribute.texts.assign(proto.strings().begin(), proto.strings().end());
      break;
    case onnx::AttributeProto::TENSOR:
      attribute.kind = OnnxAttribute::Kind::tensor;
      attribute.tensor = tensor_of(proto.t(), what + ": attribute '" + proto.name() + "'");
      break;
    default:  // graphs, sparse tensors, type protos: no op Tessera maps reads them
      attribute.kind = OnnxAttribute::Kind::other;
      break;
  }
  return attribute;
}

OnnxValue value_of(const onnx::ValueInfoProto& proto) {
  OnnxValue value;
  value.name = proto.name();
  if (proto.type().has_tensor_type()) {
    const onnx::TypeProto::Tensor& type = proto.type().tensor_type();
    value.element_type = type.elem_type();
    if (type.has_shape())
      for (const onnx::TensorShapeProto::Dimension& dim : type.shape().dim())
        value.shape.push_back(dim.has_dim_value() ? dim.dim_value() : -1);
  }
  return value;
}

void ignore_protobuf_log(google::protobuf::LogLevel, const char*, int, const std::string&) {}

}  // namespace

bool onnx_available() {
  return true;
}

OnnxGraph parse_onnx(const std::string& bytes, const std::string& source) {
  // Protobuf logs parse problems to stderr itself; the error below says it in one line.
  static std::once_flag silence;
  std::call_once(silence, [] { google::protobuf::SetLogHandler(ignore_protobuf_log); });
  check_arg(bytes.size() < static_cast<size_t>(std::numeric_limits<int>::max()), "onnx",
            "{}: {} bytes is larger than protobuf reads (2 GiB)", source, bytes.size());
  onnx::ModelProto model;
  check_arg(model.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())), "onnx",
            "{}: not a valid ONNX model (the protobuf does not parse: truncated or corrupted?)",
            source);
  check_arg(model.has_graph(), "onnx", "{}: the model has no graph", source);
  OnnxGraph graph;
  graph.source = source;
  graph.producer = model.producer_name() + " " + model.producer_version();
  for (const onnx::OperatorSetIdProto& opset : model.opset_import())
    if (opset.domain().empty() || opset.domain() == "ai.onnx") graph.opset = opset.version();
  const onnx::GraphProto& proto = model.graph();
  for (const onnx::TensorProto& initializer : proto.initializer())
    graph.initializers.emplace_back(
        initializer.name(), tensor_of(initializer, "initializer '" + initializer.name() + "'"));
  std::set<std::string> initializer_names;
  for (const auto& [name, tensor] : graph.initializers) initializer_names.insert(name);
  // Older exporters list initializers among the inputs too; they are not inputs to feed.
  for (const onnx::ValueInfoProto& input : proto.input())
    if (initializer_names.count(input.name()) == 0) graph.inputs.push_back(value_of(input));
  for (const onnx::ValueInfoProto& output : proto.output())
    graph.outputs.push_back(value_of(output));
  for (int index = 0; index < proto.node_size(); ++index) {
    const onnx::NodeProto& node_proto = proto.node(index);
    OnnxNode node;
    node.op_type = node_proto.op_type();
    if (!node_proto.domain().empty() && node_proto.domain() != "ai.onnx")
      node.op_type = node_proto.domain() + ":" + node.op_type;
    node.name =
        node_proto.name().empty() ? fmt::format("{}#{}", node.op_type, index) : node_proto.name();
    node.inputs.assign(node_proto.input().begin(), node_proto.input().end());
    node.outputs.assign(node_proto.output().begin(), node_proto.output().end());
    for (const onnx::AttributeProto& attribute : node_proto.attribute())
      node.attributes[attribute.name()] = attribute_of(attribute, node.where());
    graph.nodes.push_back(std::move(node));
  }
  validate_onnx_graph(graph);
  graph.serialized = std::make_shared<const std::string>(bytes);
  return graph;
}

void write_onnx(const OnnxGraph& graph, const std::vector<std::pair<std::string, Tensor>>& values,
                const std::string& file) {
  check_arg(graph.serialized && !graph.serialized->empty(), "onnx",
            "{}: the graph was not read from a file; there is no model to write back",
            graph.source);
  onnx::ModelProto model;
  check_arg(model.ParseFromString(*graph.serialized), "onnx", "{}: the stored model does not parse",
            graph.source);
  std::map<std::string, onnx::TensorProto*> initializers;
  for (onnx::TensorProto& initializer : *model.mutable_graph()->mutable_initializer())
    initializers[initializer.name()] = &initializer;
  for (const auto& [name, tensor] : values) {
    const auto found = initializers.find(name);
    check_arg(found != initializers.end(), "onnx", "{}: the model has no initializer '{}'",
              graph.source, name);
    onnx::TensorProto& proto = *found->second;
    const Shape shape(proto.dims().begin(), proto.dims().end());
    check_arg(tensor.shape() == shape, "onnx", "initializer '{}' has shape [{}], got [{}]", name,
              fmt::join(shape, ", "), fmt::join(tensor.shape(), ", "));
    const std::optional<DType> dtype = dtype_of_element(proto.data_type());
    check_arg(dtype && (*dtype == DType::f32 || *dtype == DType::f64 || *dtype == DType::f16 ||
                        *dtype == DType::bf16),
              "onnx", "initializer '{}' is not a float tensor", name);
    const Tensor converted = tensor.to(Device::cpu()).to_dtype(*dtype).contiguous();
    // Little-endian raw bytes, as ONNX stores them; the typed fields are cleared.
    proto.clear_float_data();
    proto.clear_double_data();
    proto.clear_int32_data();
    proto.set_raw_data(converted.raw_data(), converted.nbytes());
  }
  const std::string temporary = file + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    check_arg(out.good(), "onnx", "cannot write model file {}", file);
    check_arg(model.SerializeToOstream(&out), "onnx", "cannot write model file {}", file);
    out.close();
    check_arg(out.good(), "onnx", "cannot write model file {}", file);
  }
  check_arg(std::rename(temporary.c_str(), file.c_str()) == 0, "onnx",
            "cannot write model file {} (rename failed)", file);
}

namespace {

OnnxGraph read_onnx_file(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  check_arg(in.good(), "onnx", "cannot open model file {}", file);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  check_arg(!in.bad(), "onnx", "cannot read model file {}", file);
  return parse_onnx(bytes.str(), file);
}

/// Estimate mode's one parse of each model file, shared by every simulated rank: the ranks of a
/// real run each hold the same constants, so the ranks of an estimate (threads of one process)
/// share one read-only copy instead of P (a copy of an OnnxGraph shares its tensors' storage and
/// its serialized bytes). Keyed by the file's path, size and modification time.
class SharedGraphs {
 public:
  OnnxGraph get(const std::string& file) {
    std::error_code error;
    const auto size = std::filesystem::file_size(file, error);
    const auto modified = std::filesystem::last_write_time(file, error);
    if (error) return read_onnx_file(file);  // the read reports the problem
    const std::lock_guard<std::mutex> lock(mutex_);
    Entry& entry = entries_[file];
    if (!entry.graph || entry.size != size || entry.modified != modified) {
      entry.graph = std::make_shared<const OnnxGraph>(read_onnx_file(file));
      entry.size = size;
      entry.modified = modified;
    }
    return *entry.graph;
  }

 private:
  struct Entry {
    std::shared_ptr<const OnnxGraph> graph;
    std::uintmax_t size = 0;
    std::filesystem::file_time_type modified;
  };
  std::mutex mutex_;
  std::map<std::string, Entry> entries_;
};

}  // namespace

OnnxGraph read_onnx(const std::string& file) {
  if (!estimate::active()) return read_onnx_file(file);
  static SharedGraphs shared;
  return shared.get(file);
}

}  // namespace tessera::io
