// Random sharded-normalization cases (op, shape, attributes, which optional inputs, placements and
// extents) shared by the cpu sweep (norm_sharded_test.cpp) and the cuda one
// (tests/gpu/norm_gpu_test.cpp).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "core/tessera.hpp"
#include "ops/ops.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera::testing {

/// One normalization: the op, the shape of x, attributes, optional inputs and x's layout.
struct NormCase {
  std::string op = "group_norm";  ///< group_norm, batch_norm, instance_norm or layer_norm
  Shape x_shape;
  int64_t groups = 1;           ///< group_norm
  int64_t normalized_ndim = 1;  ///< layer_norm
  double eps = 1e-5;
  bool has_w = false, has_b = false;
  bool has_running = false;  ///< batch_norm: running statistics given
  bool training = true;      ///< batch_norm
  double momentum = 0.1;     ///< batch_norm
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;

  /// Shape of w, b (and the running statistics).
  Shape param_shape() const {
    if (op == "layer_norm") return Shape(x_shape.end() - normalized_ndim, x_shape.end());
    return {x_shape[1]};
  }

  std::string str() const {
    std::vector<std::string> names;
    for (const Placement& placement : placements) names.push_back(placement.str());
    return fmt::format(
        "{} x {} groups {} normalized_ndim {} eps {} w {} b {} running {} training {} momentum {} "
        "placements [{}] extents {}",
        op, x_shape, groups, normalized_ndim, eps, has_w, has_b, has_running, training, momentum,
        fmt::join(names, ", "), extents);
  }
};

/// The inputs of a case (full tensors; absent ones empty).
struct NormInputs {
  Tensor x;
  std::optional<Tensor> w, b, running_mean, running_var;
};

/// The outputs of a case on some layout: y and batch_norm's running statistics.
inline std::vector<ShardTensor> norm(const NormCase& c, const ShardTensor& x,
                                     const std::optional<ShardTensor>& w,
                                     const std::optional<ShardTensor>& b,
                                     const std::optional<ShardTensor>& running_mean,
                                     const std::optional<ShardTensor>& running_var) {
  if (c.op == "group_norm") return {ops::group_norm(x, c.groups, w, b, c.eps)};
  if (c.op == "instance_norm") return {ops::instance_norm(x, w, b, c.eps)};
  if (c.op == "layer_norm") return {ops::layer_norm(x, c.normalized_ndim, w, b, c.eps)};
  const ops::BatchNormResult result =
      ops::batch_norm(x, running_mean, running_var, w, b,
                      {.training = c.training, .momentum = c.momentum, .eps = c.eps});
  std::vector<ShardTensor> outputs{result.y};
  if (result.running_mean) {
    outputs.push_back(*result.running_mean);
    outputs.push_back(*result.running_var);
  }
  return outputs;
}

/// A random normalization on a mesh of `mesh_shape`: one of the four ops, 1/2/3-d ([N, C,
/// spatial..]; layer_norm any rank 2..5 and normalized_ndim), optional w and b, batch_norm's
/// running statistics, training or eval, momentum, eps; mesh dims shard any dim (batch, channel,
/// spatial, normalized or not) with uneven and empty shards, or replicate.
inline NormCase random_norm_case(const std::vector<int>& mesh_shape, CaseRng& rng) {
  static const char* const ops[] = {"group_norm", "batch_norm", "instance_norm", "layer_norm"};
  NormCase c;
  c.op = ops[rng.uniform(0, 3)];
  const int spatial = static_cast<int>(rng.uniform(1, 3));
  c.x_shape = {rng.uniform(1, 3)};
  if (c.op == "group_norm") {
    c.groups = rng.uniform(1, 3);
    c.x_shape.push_back(c.groups * rng.uniform(1, 3));
  } else {
    c.x_shape.push_back(rng.uniform(1, 5));
  }
  const int64_t most = spatial == 3 ? 5 : spatial == 2 ? 7 : 11;
  for (int i = 0; i < spatial; ++i) c.x_shape.push_back(rng.uniform(1, most));
  if (c.op == "layer_norm") {
    if (rng.chance(0.2)) c.x_shape.resize(2);  // [N, C] included
    c.normalized_ndim = rng.uniform(1, static_cast<int64_t>(c.x_shape.size()));
  }
  if (c.op == "batch_norm") {
    c.has_running = rng.chance(0.75);
    c.training = !c.has_running || rng.chance(0.7);
    const double momenta[] = {0.1, 0.3, 1.0};
    c.momentum = momenta[rng.uniform(0, 2)];
    // Training needs more than one value per channel.
    if (c.training && shape_numel(c.x_shape) / c.x_shape[1] < 2) c.x_shape[0] = 2;
  }
  const double epsilons[] = {1e-5, 1e-3, 0.1};
  c.eps = epsilons[rng.uniform(0, 2)];
  c.has_w = rng.chance(0.7);
  c.has_b = c.has_w && rng.chance(0.7);
  // Mesh dims shard distinct dims or replicate.
  std::vector<bool> used(c.x_shape.size(), false);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    const int dim = static_cast<int>(rng.uniform(0, static_cast<int64_t>(c.x_shape.size()) - 1));
    if (used[dim] || rng.chance(0.1)) {
      c.placements.push_back(Placement::replicate());
      c.extents.emplace_back();
      continue;
    }
    used[dim] = true;
    c.placements.push_back(Placement::shard(dim));
    c.extents.push_back(rng.chance(0.3) ? default_split(c.x_shape[dim], mesh_shape[m])
                                        : random_extents(c.x_shape[dim], mesh_shape[m], rng));
  }
  return c;
}

/// Random values of a case: x with an offset (its mean far from zero), w around 1, b, running
/// statistics (the variance positive); multiples of 1/64.
inline NormInputs random_norm_inputs(const NormCase& c, CaseRng& rng) {
  auto values = [&](const Shape& shape, int64_t lo, int64_t hi, double offset) {
    Tensor t = integer_tensor(shape, DType::f64, rng, lo, hi);
    double* data = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) data[i] = data[i] / 64.0 + offset;
    return t;
  };
  NormInputs inputs;
  inputs.x = values(c.x_shape, -200, 200, rng.chance(0.5) ? 3.0 : 0.0);
  const Shape params = c.param_shape();
  if (c.has_w) inputs.w = values(params, -32, 32, 1.0);
  if (c.has_b) inputs.b = values(params, -64, 64, 0.0);
  if (c.has_running) {
    inputs.running_mean = values(params, -64, 64, 0.0);
    inputs.running_var = values(params, 0, 64, 0.5);
  }
  return inputs;
}

}  // namespace tessera::testing
