// Host semantics of the ONNX shape and layout ops (onnx_host.hpp), following the ONNX operator
// specification for opsets 13..17.
#include "ops/nn/onnx_host.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "core/errors.hpp"
#include "core/estimate/real_data.hpp"

namespace tessera::nn::onnx {

namespace {

using io::OnnxNode;
using Inputs = std::vector<std::optional<HostArray>>;

/// Arrays larger than this are refused by the shape ops (they hold shapes, not data; the
/// fallback of a layout op on real data goes through the same code and is bounded by memory).
constexpr int64_t kMaxHostElements = int64_t{1} << 31;

int64_t checked_numel(const OnnxNode& node, const Shape& shape) {
  int64_t numel = 1;
  for (int64_t dim : shape) {
    check_arg(dim >= 0, "onnx", "{}: negative extent in shape [{}]", node.where(),
              fmt::join(shape, ", "));
    check_arg(dim == 0 || numel <= kMaxHostElements / dim, "onnx", "{}: shape [{}] is too large",
              node.where(), fmt::join(shape, ", "));
    numel *= dim;
  }
  return numel;
}

std::vector<int64_t> strides_of(const Shape& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * shape[d + 1];
  return strides;
}

const HostArray& need(const OnnxNode& node, const Inputs& inputs, size_t index) {
  check_arg(index < inputs.size() && inputs[index].has_value(), "onnx", "{}: needs input {}",
            node.where(), index);
  return *inputs[index];
}

/// Numpy broadcasting of `shapes` (right-aligned, extents equal or 1).
Shape broadcast_shape(const OnnxNode& node, const std::vector<Shape>& shapes) {
  size_t rank = 0;
  for (const Shape& shape : shapes) rank = std::max(rank, shape.size());
  Shape result(rank, 1);
  for (const Shape& shape : shapes)
    for (size_t i = 0; i < shape.size(); ++i) {
      int64_t& out = result[rank - shape.size() + i];
      const int64_t extent = shape[i];
      check_arg(out == 1 || extent == 1 || out == extent, "onnx", "{}: shapes {} do not broadcast",
                node.where(), shapes);
      if (out == 1) out = extent;
    }
  return result;
}

/// The flat index into an array of `shape` (right-aligned, broadcast) of the result index whose
/// digits are `index` over `result`.
int64_t source_index(const Shape& shape, const Shape& result, const std::vector<int64_t>& index) {
  int64_t flat = 0;
  const size_t offset = result.size() - shape.size();
  for (size_t i = 0; i < shape.size(); ++i)
    flat = flat * shape[i] + (shape[i] == 1 ? 0 : index[offset + i]);
  return flat;
}

/// Calls `visit(result index digits, flat result index)` for every element of `shape`.
void for_each_index(const Shape& shape,
                    const std::function<void(const std::vector<int64_t>&, int64_t)>& visit) {
  int64_t numel = 1;
  for (int64_t dim : shape) numel *= dim;
  std::vector<int64_t> index(shape.size(), 0);
  for (int64_t flat = 0; flat < numel; ++flat) {
    visit(index, flat);
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
}

HostArray elementwise(const OnnxNode& node, const Inputs& inputs,
                      const std::function<double(const std::vector<double>&)>& function,
                      std::optional<bool> integral = std::nullopt) {
  std::vector<Shape> shapes;
  bool all_integral = true;
  for (size_t i = 0; i < inputs.size(); ++i) {
    shapes.push_back(need(node, inputs, i).shape);
    all_integral = all_integral && inputs[i]->integral;
  }
  HostArray result;
  result.shape = broadcast_shape(node, shapes);
  result.integral = integral.value_or(all_integral);
  result.values.resize(static_cast<size_t>(checked_numel(node, result.shape)));
  std::vector<double> operands(inputs.size());
  for_each_index(result.shape, [&](const std::vector<int64_t>& index, int64_t flat) {
    for (size_t i = 0; i < inputs.size(); ++i)
      operands[i] = inputs[i]->values[source_index(inputs[i]->shape, result.shape, index)];
    result.values[flat] = function(operands);
  });
  if (result.integral)
    for (double& value : result.values) value = std::trunc(value);
  return result;
}

HostArray reshaped(const OnnxNode& node, const HostArray& data, const Shape& shape) {
  check_arg(checked_numel(node, shape) == data.numel(), "onnx",
            "{}: cannot reshape [{}] ({} elements) to [{}]", node.where(),
            fmt::join(data.shape, ", "), data.numel(), fmt::join(shape, ", "));
  HostArray result = data;
  result.shape = shape;
  return result;
}

HostArray reshape(const OnnxNode& node, const Inputs& inputs) {
  const HostArray& data = need(node, inputs, 0);
  const std::vector<int64_t> requested = need(node, inputs, 1).as_integers();
  const bool allow_zero = node.integer("allowzero", 0) != 0;
  Shape shape;
  int64_t inferred = -1, known = 1;
  for (size_t i = 0; i < requested.size(); ++i) {
    int64_t extent = requested[i];
    if (extent == 0 && !allow_zero) {
      check_arg(i < data.shape.size(), "onnx", "{}: shape [{}] copies dim {} of a {}-d input",
                node.where(), fmt::join(requested, ", "), i, data.shape.size());
      extent = data.shape[i];
    }
    if (extent == -1) {
      check_arg(inferred < 0, "onnx", "{}: shape [{}] has more than one -1", node.where(),
                fmt::join(requested, ", "));
      inferred = static_cast<int64_t>(i);
      extent = 1;
    }
    check_arg(extent >= 0, "onnx", "{}: shape [{}] has a negative extent", node.where(),
              fmt::join(requested, ", "));
    shape.push_back(extent);
    known = extent == 0 ? 0 : known * extent;
  }
  if (inferred >= 0) {
    check_arg(known > 0 && data.numel() % known == 0, "onnx", "{}: cannot reshape [{}] to [{}]",
              node.where(), fmt::join(data.shape, ", "), fmt::join(requested, ", "));
    shape[inferred] = data.numel() / known;
  }
  return reshaped(node, data, shape);
}

HostArray transpose(const OnnxNode& node, const HostArray& data) {
  const int64_t rank = static_cast<int64_t>(data.shape.size());
  std::vector<int64_t> perm = node.integers("perm");
  if (perm.empty())
    for (int64_t d = rank - 1; d >= 0; --d) perm.push_back(d);
  std::vector<int64_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t d = 0; d < rank; ++d)
    check_arg(static_cast<int64_t>(sorted.size()) == rank && sorted[d] == d, "onnx",
              "{}: perm [{}] is not a permutation of the {} dims", node.where(),
              fmt::join(perm, ", "), rank);
  HostArray result;
  result.integral = data.integral;
  for (int64_t d : perm) result.shape.push_back(data.shape[d]);
  result.values.resize(data.values.size());
  const std::vector<int64_t> strides = strides_of(data.shape);
  for_each_index(result.shape, [&](const std::vector<int64_t>& index, int64_t flat) {
    int64_t source = 0;
    for (int64_t d = 0; d < rank; ++d) source += index[d] * strides[perm[d]];
    result.values[flat] = data.values[source];
  });
  return result;
}

HostArray gather(const OnnxNode& node, const Inputs& inputs) {
  const HostArray& data = need(node, inputs, 0);
  const HostArray& indices = need(node, inputs, 1);
  const int64_t rank = static_cast<int64_t>(data.shape.size());
  check_arg(rank >= 1, "onnx", "{}: gathers from a scalar", node.where());
  const int64_t axis = normalize_axis(node, node.integer("axis", 0), rank);
  HostArray result;
  result.integral = data.integral;
  result.shape.assign(data.shape.begin(), data.shape.begin() + axis);
  result.shape.insert(result.shape.end(), indices.shape.begin(), indices.shape.end());
  result.shape.insert(result.shape.end(), data.shape.begin() + axis + 1, data.shape.end());
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= data.shape[d];
  for (int64_t d = axis + 1; d < rank; ++d) inner *= data.shape[d];
  const int64_t extent = data.shape[axis];
  result.values.reserve(static_cast<size_t>(checked_numel(node, result.shape)));
  const std::vector<int64_t> picks = indices.as_integers();
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t pick : picks) {
      check_arg(pick >= -extent && pick < extent, "onnx",
                "{}: index {} is out of range for extent {}", node.where(), pick, extent);
      const int64_t i = pick < 0 ? pick + extent : pick;
      const double* row = data.values.data() + (o * extent + i) * inner;
      result.values.insert(result.values.end(), row, row + inner);
    }
  return result;
}

HostArray concat(const OnnxNode& node, const Inputs& inputs) {
  const HostArray& first = need(node, inputs, 0);
  const int64_t rank = static_cast<int64_t>(first.shape.size());
  const int64_t axis = normalize_axis(node, node.integer("axis", 0), rank);
  HostArray result;
  result.integral = true;
  result.shape = first.shape;
  result.shape[axis] = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const HostArray& part = need(node, inputs, i);
    check_arg(static_cast<int64_t>(part.shape.size()) == rank, "onnx",
              "{}: inputs of different ranks", node.where());
    for (int64_t d = 0; d < rank; ++d)
      check_arg(d == axis || part.shape[d] == first.shape[d], "onnx",
                "{}: input shapes [{}] and [{}] differ off the axis", node.where(),
                fmt::join(first.shape, ", "), fmt::join(part.shape, ", "));
    result.shape[axis] += part.shape[axis];
    result.integral = result.integral && part.integral;
  }
  int64_t outer = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= first.shape[d];
  for (int64_t o = 0; o < outer; ++o)
    for (const std::optional<HostArray>& part : inputs) {
      const int64_t block = part->numel() / std::max<int64_t>(outer, 1);
      const double* begin = part->values.data() + o * block;
      result.values.insert(result.values.end(), begin, begin + block);
    }
  return result;
}

HostArray slice(const OnnxNode& node, const Inputs& inputs) {
  const HostArray& data = need(node, inputs, 0);
  const int64_t rank = static_cast<int64_t>(data.shape.size());
  const std::vector<int64_t> starts = need(node, inputs, 1).as_integers();
  const std::vector<int64_t> ends = need(node, inputs, 2).as_integers();
  std::vector<int64_t> axes, steps;
  if (inputs.size() > 3 && inputs[3]) {
    axes = inputs[3]->as_integers();
  } else {
    for (size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<int64_t>(i));
  }
  if (inputs.size() > 4 && inputs[4]) {
    steps = inputs[4]->as_integers();
  } else {
    steps.assign(starts.size(), 1);
  }
  check_arg(
      ends.size() == starts.size() && axes.size() == starts.size() && steps.size() == starts.size(),
      "onnx", "{}: starts, ends, axes and steps differ in length", node.where());
  std::vector<int64_t> begin(rank, 0), step(rank, 1);
  Shape shape = data.shape;
  for (size_t i = 0; i < starts.size(); ++i) {
    const int64_t axis = normalize_axis(node, axes[i], rank);
    const int64_t extent = data.shape[axis];
    check_arg(steps[i] != 0, "onnx", "{}: a step of 0", node.where());
    auto clamp_index = [&](int64_t index, int64_t lo, int64_t hi) {
      if (index < 0) index = index < -extent ? -1 : index + extent;
      return std::clamp(index, lo, hi);
    };
    int64_t first, last;
    if (steps[i] > 0) {
      first = clamp_index(starts[i], 0, extent);
      last = clamp_index(ends[i], 0, extent);
    } else {
      first = clamp_index(starts[i], 0, extent - 1);
      last = clamp_index(ends[i], -1, extent - 1);
    }
    const int64_t count = steps[i] > 0 ? (last - first + steps[i] - 1) / steps[i]
                                       : (first - last - steps[i] - 1) / -steps[i];
    begin[axis] = first;
    step[axis] = steps[i];
    shape[axis] = std::max<int64_t>(count, 0);
  }
  HostArray result;
  result.integral = data.integral;
  result.shape = shape;
  result.values.resize(static_cast<size_t>(checked_numel(node, shape)));
  const std::vector<int64_t> strides = strides_of(data.shape);
  for_each_index(shape, [&](const std::vector<int64_t>& index, int64_t flat) {
    int64_t source = 0;
    for (int64_t d = 0; d < rank; ++d) source += (begin[d] + index[d] * step[d]) * strides[d];
    result.values[flat] = data.values[source];
  });
  return result;
}

HostArray unsqueeze(const OnnxNode& node, const Inputs& inputs) {
  const HostArray& data = need(node, inputs, 0);
  const std::vector<int64_t> axes =
      inputs.size() > 1 && inputs[1] ? inputs[1]->as_integers() : node.integers("axes");
  const int64_t rank = static_cast<int64_t>(data.shape.size() + axes.size());
  std::vector<bool> inserted(rank, false);
  for (int64_t axis : axes) {
    const int64_t dim = normalize_axis(node, axis, rank);
    check_arg(!inserted[dim], "onnx", "{}: axis {} given twice", node.where(), axis);
    inserted[dim] = true;
  }
  Shape shape;
  size_t next = 0;
  for (int64_t d = 0; d < rank; ++d) shape.push_back(inserted[d] ? 1 : data.shape[next++]);
  return reshaped(node, data, shape);
}

HostArray squeeze(const OnnxNode& node, const Inputs& inputs) {
  const HostArray& data = need(node, inputs, 0);
  const int64_t rank = static_cast<int64_t>(data.shape.size());
  std::vector<bool> removed(rank, false);
  if (inputs.size() > 1 && inputs[1]) {
    for (int64_t axis : inputs[1]->as_integers()) {
      const int64_t dim = normalize_axis(node, axis, rank);
      check_arg(data.shape[dim] == 1, "onnx", "{}: dim {} has extent {}, not 1", node.where(), dim,
                data.shape[dim]);
      removed[dim] = true;
    }
  } else {
    for (int64_t d = 0; d < rank; ++d) removed[d] = data.shape[d] == 1;
  }
  Shape shape;
  for (int64_t d = 0; d < rank; ++d)
    if (!removed[d]) shape.push_back(data.shape[d]);
  return reshaped(node, data, shape);
}

HostArray flatten(const OnnxNode& node, const HostArray& data) {
  const int64_t rank = static_cast<int64_t>(data.shape.size());
  const int64_t axis = normalize_axis(node, node.integer("axis", 1), rank + 1);
  int64_t outer = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= data.shape[d];
  return reshaped(node, data, {outer, outer == 0 ? 0 : data.numel() / outer});
}

HostArray expand(const OnnxNode& node, const Inputs& inputs) {
  const HostArray& data = need(node, inputs, 0);
  const std::vector<int64_t> requested = need(node, inputs, 1).as_integers();
  HostArray target;
  target.shape = Shape(requested.begin(), requested.end());
  target.values.assign(static_cast<size_t>(checked_numel(node, target.shape)), 0.0);
  return elementwise(
      node, {data, target}, [](const std::vector<double>& v) { return v[0]; }, data.integral);
}

HostArray constant_of_shape(const OnnxNode& node, const Inputs& inputs) {
  const std::vector<int64_t> requested = need(node, inputs, 0).as_integers();
  HostArray result;
  result.shape = Shape(requested.begin(), requested.end());
  double value = 0;
  if (node.has("value")) {
    const HostArray fill = host_array(node.tensor("value"));
    value = fill.scalar(node.where() + " attribute 'value'");
    result.integral = fill.integral;
  }
  result.values.assign(static_cast<size_t>(checked_numel(node, result.shape)), value);
  return result;
}

HostArray range(const OnnxNode& node, const Inputs& inputs) {
  const HostArray& start = need(node, inputs, 0);
  const double first = start.scalar(node.where());
  const double limit = need(node, inputs, 1).scalar(node.where());
  const double delta = need(node, inputs, 2).scalar(node.where());
  check_arg(delta != 0, "onnx", "{}: delta 0", node.where());
  const double count = std::max(std::ceil((limit - first) / delta), 0.0);
  check_arg(count < static_cast<double>(kMaxHostElements), "onnx", "{}: {} elements", node.where(),
            count);
  HostArray result;
  result.integral = start.integral;
  result.shape = {static_cast<int64_t>(count)};
  for (int64_t i = 0; i < result.shape[0]; ++i) result.values.push_back(first + i * delta);
  return result;
}

HostArray constant(const OnnxNode& node) {
  if (node.has("value")) return host_array(node.tensor("value"));
  HostArray result;
  if (node.has("value_float")) {
    result.values = {node.real("value_float", 0)};
  } else if (node.has("value_int")) {
    result.values = {static_cast<double>(node.integer("value_int", 0))};
    result.integral = true;
  } else if (node.has("value_ints")) {
    for (int64_t value : node.integers("value_ints")) result.values.push_back(value);
    result.shape = {result.numel()};
    result.integral = true;
  } else {
    const auto found = node.attributes.find("value_floats");
    check_arg(
        found != node.attributes.end() && found->second.kind == io::OnnxAttribute::Kind::reals,
        "onnx", "{}: needs a value attribute (value, value_float(s), value_int(s))", node.where());
    result.values = found->second.reals;
    result.shape = {result.numel()};
  }
  return result;
}

HostArray cast(const OnnxNode& node, const HostArray& data) {
  const int64_t to = node.integer("to", 1);
  HostArray result = data;
  // INT8..INT64, UINT8..UINT64 and BOOL are integral; FLOAT, DOUBLE, FLOAT16, BFLOAT16 not.
  result.integral = to != 1 && to != 10 && to != 11 && to != 16;
  if (to == 9) {
    for (double& value : result.values) value = value != 0 ? 1 : 0;
  } else if (result.integral) {
    for (double& value : result.values) value = std::trunc(value);
  } else if (to == 1) {
    for (double& value : result.values) value = static_cast<float>(value);
  }
  return result;
}

using Unary = double (*)(double);
const std::map<std::string, Unary>& unary_ops() {
  static const std::map<std::string, Unary> ops = {
      {"Neg", [](double x) { return -x; }},
      {"Abs", [](double x) { return std::fabs(x); }},
      {"Sqrt", [](double x) { return std::sqrt(x); }},
      {"Exp", [](double x) { return std::exp(x); }},
      {"Log", [](double x) { return std::log(x); }},
      {"Erf", [](double x) { return std::erf(x); }},
      {"Tanh", [](double x) { return std::tanh(x); }},
      {"Sigmoid", [](double x) { return 1 / (1 + std::exp(-x)); }},
      {"Relu", [](double x) { return x > 0 ? x : 0.0; }},
      {"Floor", [](double x) { return std::floor(x); }},
      {"Ceil", [](double x) { return std::ceil(x); }},
      {"Reciprocal", [](double x) { return 1 / x; }},
      {"Not", [](double x) { return x == 0 ? 1.0 : 0.0; }},
  };
  return ops;
}

}  // namespace

std::vector<int64_t> HostArray::as_integers() const {
  std::vector<int64_t> result;
  result.reserve(values.size());
  for (double value : values) {
    if (value >= 9.2e18) {
      result.push_back(std::numeric_limits<int64_t>::max());
    } else if (value <= -9.2e18) {
      result.push_back(std::numeric_limits<int64_t>::min());
    } else {
      result.push_back(static_cast<int64_t>(value));
    }
  }
  return result;
}

double HostArray::scalar(const std::string& what) const {
  check_arg(values.size() == 1, "onnx", "{}: expected one value, got {}", what, values.size());
  return values[0];
}

HostArray host_array(const Tensor& tensor) {
  // Host constants are values even in estimate mode: the import folds them and decides the
  // graph's structure from them (the model file is read for real).
  const estimate::RealDataScope real_data;
  HostArray array;
  array.shape = tensor.shape();
  const DType dtype = tensor.dtype();
  array.integral = dtype == DType::i64 || dtype == DType::i32 || dtype == DType::u8;
  const Tensor values = tensor.to(Device::cpu()).contiguous();
  array.values.resize(static_cast<size_t>(values.numel()));
  if (dtype == DType::i64) {
    for (int64_t i = 0; i < values.numel(); ++i)
      array.values[i] = static_cast<double>(values.data<int64_t>()[i]);
  } else {
    const Tensor doubles = values.to_dtype(DType::f64);
    std::copy(doubles.data<double>(), doubles.data<double>() + doubles.numel(),
              array.values.begin());
  }
  return array;
}

std::shared_ptr<const HostArray> shared_host_array(const Tensor& tensor) {
  if (!tensor.device().is_cpu() || tensor.is_shape_only() || tensor.numel() == 0)
    return std::make_shared<const HostArray>(host_array(tensor));
  // The array and the tensor it was made from live together, so the key's address stays the
  // tensor's while the entry can be locked.
  struct Holder {
    Tensor source;
    HostArray array;
  };
  using Key = std::tuple<const void*, DType, Shape>;
  static std::mutex mutex;
  static std::map<Key, std::weak_ptr<const HostArray>> arrays;
  const Key key{tensor.raw_data(), tensor.dtype(), tensor.shape()};
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto found = arrays.find(key); found != arrays.end())
    if (std::shared_ptr<const HostArray> shared = found->second.lock()) return shared;
  auto holder = std::make_shared<const Holder>(Holder{tensor, host_array(tensor)});
  std::shared_ptr<const HostArray> shared(holder, &holder->array);
  std::erase_if(arrays, [](const auto& entry) { return entry.second.expired(); });
  arrays[key] = shared;
  return shared;
}

Tensor host_tensor(const HostArray& array, DType float_dtype) {
  if (array.integral) {
    const std::vector<int64_t> values = array.as_integers();
    return Tensor::from_values<int64_t>(array.shape, values);
  }
  return Tensor::from_values<double>(array.shape, array.values).to_dtype(float_dtype);
}

bool has_host_op(const std::string& op_type) {
  static const std::vector<std::string> ops = {
      "Identity", "Constant", "Reshape",   "Flatten", "Transpose", "Gather",
      "Concat",   "Slice",    "Unsqueeze", "Squeeze", "Expand",    "ConstantOfShape",
      "Range",    "Cast",     "Add",       "Sub",     "Mul",       "Div",
      "Pow",      "Min",      "Max",       "Equal",   "Less",      "Greater",
      "Where",    "And",      "Or",        "Mod"};
  return std::find(ops.begin(), ops.end(), op_type) != ops.end() || unary_ops().count(op_type) > 0;
}

int64_t normalize_axis(const OnnxNode& node, int64_t axis, int64_t rank) {
  check_arg(axis >= -rank && axis < rank, "onnx", "{}: axis {} is out of range for rank {}",
            node.where(), axis, rank);
  return axis < 0 ? axis + rank : axis;
}

std::vector<HostArray> run_host_op(const OnnxNode& node, const Inputs& inputs) {
  const std::string& op = node.op_type;
  using V = const std::vector<double>&;
  if (op == "Identity") return {need(node, inputs, 0)};
  if (op == "Constant") return {constant(node)};
  if (op == "Reshape") return {reshape(node, inputs)};
  if (op == "Flatten") return {flatten(node, need(node, inputs, 0))};
  if (op == "Transpose") return {transpose(node, need(node, inputs, 0))};
  if (op == "Gather") return {gather(node, inputs)};
  if (op == "Concat") return {concat(node, inputs)};
  if (op == "Slice") return {slice(node, inputs)};
  if (op == "Unsqueeze") return {unsqueeze(node, inputs)};
  if (op == "Squeeze") return {squeeze(node, inputs)};
  if (op == "Expand") return {expand(node, inputs)};
  if (op == "ConstantOfShape") return {constant_of_shape(node, inputs)};
  if (op == "Range") return {range(node, inputs)};
  if (op == "Cast") return {cast(node, need(node, inputs, 0))};
  if (op == "Add") return {elementwise(node, inputs, [](V v) { return v[0] + v[1]; })};
  if (op == "Sub") return {elementwise(node, inputs, [](V v) { return v[0] - v[1]; })};
  if (op == "Mul") return {elementwise(node, inputs, [](V v) { return v[0] * v[1]; })};
  if (op == "Div") {
    const bool integral = need(node, inputs, 0).integral && need(node, inputs, 1).integral;
    return {elementwise(node, inputs, [integral, &node](V v) {
      check_arg(!integral || v[1] != 0, "onnx", "{}: integer division by zero", node.where());
      return integral ? std::trunc(v[0] / v[1]) : v[0] / v[1];
    })};
  }
  if (op == "Mod") {
    return {elementwise(node, inputs, [&node](V v) {
      check_arg(v[1] != 0, "onnx", "{}: modulo by zero", node.where());
      const double r = std::fmod(v[0], v[1]);
      return r != 0 && ((r < 0) != (v[1] < 0)) ? r + v[1] : r;
    })};
  }
  if (op == "Pow")
    return {elementwise(
        node, inputs, [](V v) { return std::pow(v[0], v[1]); }, need(node, inputs, 0).integral)};
  if (op == "Min" || op == "Max") {
    const bool max = op == "Max";
    return {elementwise(node, inputs, [max](V v) {
      double best = v[0];
      for (double value : v) best = max ? std::max(best, value) : std::min(best, value);
      return best;
    })};
  }
  if (op == "Equal")
    return {elementwise(
        node, inputs, [](V v) { return v[0] == v[1] ? 1.0 : 0.0; }, true)};
  if (op == "Less")
    return {elementwise(
        node, inputs, [](V v) { return v[0] < v[1] ? 1.0 : 0.0; }, true)};
  if (op == "Greater")
    return {elementwise(
        node, inputs, [](V v) { return v[0] > v[1] ? 1.0 : 0.0; }, true)};
  if (op == "And")
    return {elementwise(node, inputs, [](V v) { return v[0] != 0 && v[1] != 0 ? 1.0 : 0.0; })};
  if (op == "Or")
    return {elementwise(node, inputs, [](V v) { return v[0] != 0 || v[1] != 0 ? 1.0 : 0.0; })};
  if (op == "Where") {
    need(node, inputs, 1);
    need(node, inputs, 2);
    const bool integral = inputs[1]->integral && inputs[2]->integral;
    return {elementwise(
        node, inputs, [](V v) { return v[0] != 0 ? v[1] : v[2]; }, integral)};
  }
  const auto unary = unary_ops().find(op);
  check_arg(unary != unary_ops().end(), "onnx", "{}: no host semantics", node.where());
  const Unary function = unary->second;
  // Integers stay integers through the ops that map them to integers.
  const bool keeps_integers =
      op == "Neg" || op == "Abs" || op == "Relu" || op == "Floor" || op == "Ceil";
  const bool integral = op == "Not" || (keeps_integers && need(node, inputs, 0).integral);
  return {elementwise(
      node, {need(node, inputs, 0)}, [function](V v) { return function(v[0]); }, integral)};
}

}  // namespace tessera::nn::onnx
