// The host (reference) semantics of the ONNX ops that only move or compute small values: shape
// arithmetic (Shape, Gather, Unsqueeze, Concat, Cast, Slice, ...) folded into constants when the
// model runs, and the op fallback (gather the inputs, compute here on every rank, re-shard) for
// layout ops on sharded data (Reshape, Flatten, Transpose, ...). Values are held in double
// (integers up to 2^53 exactly; larger ones, like Slice's INT64_MAX ends, are clamped when read
// back as integers).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "io/onnx/onnx_graph.hpp"

namespace tessera::nn::onnx {

/// A small host array: shape, values in row-major order, and whether it holds integers
/// (i64/i32/bool in the file) or floats.
struct HostArray {
  Shape shape;
  std::vector<double> values;
  bool integral = false;

  int64_t numel() const { return static_cast<int64_t>(values.size()); }
  /// The values as int64 (clamped to the int64 range).
  std::vector<int64_t> as_integers() const;
  /// The only value of a one-element array (an error naming `what` otherwise).
  double scalar(const std::string& what) const;
};

/// A host tensor (any dtype) as a HostArray.
HostArray host_array(const Tensor& tensor);
/// host_array(tensor), read-only and shared by every caller passing a tensor of the same storage,
/// shape and dtype while one of them holds it: an initializer of a model parse that simulated
/// ranks share is converted once, not once per rank (the array keeps that storage alive, so an
/// address is never taken for another tensor's while it is shared).
std::shared_ptr<const HostArray> shared_host_array(const Tensor& tensor);
/// The array as a cpu tensor: i64 when integral, else `float_dtype`.
Tensor host_tensor(const HostArray& array, DType float_dtype);

/// True when `op_type` has host semantics here (run_host_op computes it).
bool has_host_op(const std::string& op_type);

/// Computes `node` on host arrays (absent optional inputs as nullopt); errors name the node.
std::vector<HostArray> run_host_op(const io::OnnxNode& node,
                                   const std::vector<std::optional<HostArray>>& inputs);

/// `axis` (negative from the end) as a dim of a rank-`rank` tensor; errors name the node.
int64_t normalize_axis(const io::OnnxNode& node, int64_t axis, int64_t rank);

}  // namespace tessera::nn::onnx
