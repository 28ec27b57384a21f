// The steps of nn::OnnxModel: the values a graph holds (data on the mesh, host constants, or
// both) and, per ONNX op type with a sharded op, a compiler that reads and checks the node's
// attributes once (when the model is built) and returns the step that runs the node.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/shard_tensor.hpp"
#include "io/onnx/onnx_graph.hpp"
#include "ops/nn/onnx_host.hpp"

namespace tessera::nn::onnx {

/// A value of the graph: data on the mesh, host values known without data, or both (a float
/// initializer: its Parameter and its values); or the output of a fused projection under tensor
/// parallelism (q, k and v side by side), held as its parts, each in its own layout: only Shape
/// (the whole's global shape) and Slice or Split taking whole parts read it. The host values are
/// read-only and shared (by the steps' copies of a value, and an initializer's by the simulated
/// ranks of an estimate).
struct Value {
  std::optional<ShardTensor> sharded;
  std::shared_ptr<const HostArray> constant;
  std::vector<ShardTensor> parts;
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

/// A value holding data only.
Value data_value(ShardTensor tensor);
/// A value holding host values only.
Value constant_value(HostArray array);

/// Input `index` of `node` as data on the mesh: a constant becomes a replicated tensor in `like`'s
/// dtype (the model's dtype when there is none), no communication.
ShardTensor data_of(const RunContext& context, const io::OnnxNode& node, const Values& inputs,
                    size_t index, std::optional<DType> like = std::nullopt);

/// The step of a fused projection (ops/nn/onnx_partition.hpp: OnnxFusedProjection) of `parts`
/// parts: inputs x, the stacked weight [parts * in, width] and optionally the stacked bias
/// [parts, width]; the result holds the parts x @ w_p + b_p, each split over tp like the weight.
Step fused_projection_step(const io::OnnxNode& node, int64_t parts);

/// The step of a node with a sharded op (nullopt for op types without one); attribute errors
/// name the node.
std::optional<Step> compile_sharded(const io::OnnxNode& node, int64_t opset);

/// True when input `index` of an `op` node is read as a constant (shapes, scales, pads, axes): a
/// float initializer there is a constant, not a Parameter.
bool is_constant_position(const std::string& op, size_t index);

}  // namespace tessera::nn::onnx
