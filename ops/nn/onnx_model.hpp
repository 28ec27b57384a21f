// OnnxModel: a network exported from PyTorch (torch.onnx.export, opset 13..17) as a graph of
// Tessera ops on a DeviceMesh. The io layer parses the file (io/onnx/onnx_graph.hpp); this layer
// maps each node to a sharded op (Conv -> ops::conv, Resize -> ops::interpolate, ...), so the
// inputs may be sharded on any layout and the outputs equal one rank's. Float initializers become
// Parameters named after the initializer, replicated or laid out as the caller names them
// (tensor parallelism: ops/nn/onnx_partition.hpp), BatchNormalization's running statistics
// buffers; subgraphs that only compute shapes (Shape, Gather, Unsqueeze, Concat, Cast,
// ...) are folded into constants every forward, so spatial sizes may differ from the exported
// ones. PyTorch's GroupNorm pattern (Reshape -> InstanceNormalization -> Reshape(Shape(x))) runs
// as ops::group_norm, never flattening sharded spatial dims. Layout ops without a sharded rule
// (Reshape, Flatten, Transpose, ... on sharded data) run through the op fallback: the inputs
// gathered, the node computed on every rank, the result re-sharded (one warning per node).
// Everything that can be refused is refused when the model is built: one error naming the node
// and its op type.
//
//   nn::OnnxModel model = nn::OnnxModel::load("unet.onnx", mesh, DType::f64);
//   ShardTensor y = model.forward(x);  // x sharded on its spatial dims
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/parameter.hpp"
#include "io/onnx/onnx_graph.hpp"
#include "ops/nn/onnx_partition.hpp"

namespace tessera::nn {

class OnnxModel {
 public:
  /// Builds the model from a parsed graph on `mesh`, parameters in `dtype` (f32 or f64; f16/bf16
  /// also work where every op does) on the calling rank's device. Validates every node first.
  /// Parameters are replicated, except those named in `placements` (one placement per mesh dim):
  /// tensor parallelism shards weights this way (ops/nn/onnx_partition.hpp finds which), and the
  /// MatMul, Gemm, Conv and ConvTranspose steps run a weight split on its in features as a
  /// row-parallel (channel-parallel) product whose Partial sum is reduced before the bias is added.
  /// The `fused` projections (attention's q/k/v MatMul, found by the plan) hold their weight and
  /// bias stacked by parts ([parts * in, width], [parts, width]: `placements` names those
  /// layouts), and their MatMul (with its bias Add) computes each part on its own; fused
  /// projections whose node the graph lacks (another pipeline stage's) are ignored.
  OnnxModel(io::OnnxGraph graph, const DeviceMesh& mesh, DType dtype = DType::f32,
            const std::map<std::string, std::vector<Placement>>& placements = {},
            const std::vector<OnnxFusedProjection>& fused = {});
  /// Reads `file` (io::read_onnx) and builds the model.
  static OnnxModel load(const std::string& file, const DeviceMesh& mesh, DType dtype = DType::f32);

  /// The graph's inputs and outputs (names, element types, exported shapes).
  const std::vector<io::OnnxValue>& inputs() const;
  const std::vector<io::OnnxValue>& outputs() const;
  /// The parameters (float initializers) by initializer name, in file order.
  std::vector<std::pair<std::string, Parameter>> named_parameters() const;
  /// BatchNormalization's running statistics by initializer name.
  std::vector<std::pair<std::string, ShardTensor>> named_buffers() const;
  /// The nodes that run through the op fallback (gathered), by name.
  std::vector<std::string> fallback_nodes() const;

  /// Collective: runs the graph on `inputs` (one per graph input, by name, any layout); returns
  /// every graph output by name.
  std::map<std::string, ShardTensor> forward(const std::map<std::string, ShardTensor>& inputs);
  /// Collective: the one-input graph on `x`; its first output.
  ShardTensor forward(const ShardTensor& x);

  /// Collective: the whole value of parameter or buffer `name` in its initializer's shape and
  /// layout (a fused projection's stacked weight back as [in, parts * width]), on every rank.
  Tensor full_initializer(const std::string& name) const;

  /// Collective: writes the model back as ONNX to `file` (rank 0 writes): the graph as read, with
  /// every parameter's and buffer's initializer holding its current (gathered) values (in the
  /// file's element type), so a trained network goes back to PyTorch's ONNX consumers under the
  /// same names. A problem is the same error on every rank.
  void save(const std::string& file) const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace tessera::nn
