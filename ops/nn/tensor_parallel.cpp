// Tensor-parallel layers (ops/nn/tensor_parallel.hpp).
#include "ops/nn/tensor_parallel.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "core/runtime/rank_context.hpp"
#include "ops/ops.hpp"

namespace tessera::nn {

namespace {

/// nn::Linear's initial weight [out, in] and bias [out] (uniform in +-1/sqrt(in), weight drawn
/// first), as full f64 tensors converted to `dtype`.
std::pair<Tensor, Tensor> linear_init(int64_t in_features, int64_t out_features, uint64_t seed,
                                      DType dtype) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> pick(-bound, bound);
  auto draw = [&](const Shape& shape) {
    Tensor values = Tensor::empty(shape, DType::f64);
    for (int64_t i = 0; i < values.numel(); ++i) values.data<double>()[i] = pick(generator);
    return values.to_dtype(dtype).to(current_rank_context().device());
  };
  Tensor weight = draw({out_features, in_features});
  Tensor bias = draw({out_features});
  return {weight, bias};
}

/// Replicated on every mesh dim but `mesh_dim` (-1: none), Shard(`tensor_dim`) there.
std::vector<Placement> sharded_on(const DeviceMesh& mesh, int mesh_dim, int tensor_dim) {
  std::vector<Placement> placements(mesh.ndim(), Placement::replicate());
  if (mesh_dim >= 0) placements[mesh_dim] = Placement::shard(tensor_dim);
  return placements;
}

/// Features split evenly over the tp dim: a size that does not divide them is an error naming
/// the layer (every rank holds the same config and mesh, so every rank raises it).
void check_divides(const DeviceMesh& mesh, int mesh_dim, int64_t count, const std::string& what,
                   const std::string& op) {
  if (mesh_dim < 0) return;
  const int parts = mesh.size(mesh_dim);
  check_arg(count % parts == 0, op, "{} {} do not divide over the {} ranks of mesh dim '{}'", what,
            count, parts, mesh.names()[mesh_dim]);
}

/// The initial weight and bias [out] of a groups-1 convolution layer (uniform in +-1/sqrt(fan_in),
/// fan_in = numel(weight) / weight's dim 0, weight drawn first), as full tensors of the config's
/// dtype: nn::Conv's [out, in, k..] or, with `transposed`, nn::ConvTranspose's [in, out, k..].
/// Checks the config as those layers do and that the split channels (out when `split_out`, else
/// in) divide over the tp dim.
template <typename Config>
std::pair<Tensor, Tensor> conv_layer_init(const DeviceMesh& mesh, int tp, const Config& config,
                                          uint64_t seed, bool split_out, bool transposed,
                                          const std::string& op) {
  check_arg(config.spatial_dims >= 1 && config.spatial_dims <= 3, op,
            "spatial dims {} (expected 1, 2 or 3)", config.spatial_dims);
  check_arg(config.in_channels >= 1 && config.out_channels >= 1 && config.kernel >= 1 &&
                config.options.groups == 1,
            op, "channels {} -> {}, kernel {}, groups {} (tensor parallelism needs groups 1)",
            config.in_channels, config.out_channels, config.kernel, config.options.groups);
  check_divides(mesh, tp, split_out ? config.out_channels : config.in_channels,
                split_out ? "out channels" : "in channels", op);
  Shape w_shape = transposed ? Shape{config.in_channels, config.out_channels}
                             : Shape{config.out_channels, config.in_channels};
  for (int d = 0; d < config.spatial_dims; ++d) w_shape.push_back(config.kernel);
  const double fan_in = static_cast<double>(shape_numel(w_shape) / w_shape[0]);
  const double bound = 1.0 / std::sqrt(fan_in);
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> pick(-bound, bound);
  auto draw = [&](const Shape& shape) {
    Tensor values = Tensor::empty(shape, DType::f64);
    for (int64_t i = 0; i < values.numel(); ++i) values.data<double>()[i] = pick(generator);
    return values.to_dtype(config.dtype).to(current_rank_context().device());
  };
  Tensor weight = draw(w_shape);
  Tensor bias = draw({config.out_channels});
  return {weight, bias};
}

std::pair<Tensor, Tensor> conv_init(const DeviceMesh& mesh, int tp, const ConvConfig& config,
                                    uint64_t seed, bool split_out, const std::string& op) {
  return conv_layer_init(mesh, tp, config, seed, split_out, false, op);
}

std::pair<Tensor, Tensor> conv_transpose_init(const DeviceMesh& mesh, int tp,
                                              const ConvTransposeConfig& config, uint64_t seed,
                                              bool split_out, const std::string& op) {
  return conv_layer_init(mesh, tp, config, seed, split_out, true, op);
}

}  // namespace

int tensor_parallel_mesh_dim(const DeviceMesh& mesh, const TensorParallelOptions& options,
                             const std::string& op) {
  if (options.dim.empty()) return -1;
  const auto& names = mesh.names();
  const auto found = std::find(names.begin(), names.end(), options.dim);
  check_arg(found != names.end(), op, "tensor-parallel dim '{}' is not a dim of the mesh (dims {})",
            options.dim, fmt::join(names, ", "));
  return static_cast<int>(found - names.begin());
}

ColumnParallelLinear::ColumnParallelLinear(const DeviceMesh& mesh, int64_t in_features,
                                           int64_t out_features, bool bias, uint64_t seed,
                                           DType dtype, TensorParallelOptions options) {
  const std::string op = "column_parallel_linear";
  check_arg(in_features >= 1 && out_features >= 1, op, "features {} -> {}", in_features,
            out_features);
  const int tp = tensor_parallel_mesh_dim(mesh, options, op);
  check_divides(mesh, tp, out_features, "out features", op);
  auto [w, b] = linear_init(in_features, out_features, seed, dtype);
  const std::vector<Placement> rows = sharded_on(mesh, tp, 0);
  weight_ = add_parameter("weight", ShardTensor::distribute(w, mesh, rows));
  if (bias) bias_ = add_parameter("bias", ShardTensor::distribute(b, mesh, rows));
}

ShardTensor ColumnParallelLinear::forward(const ShardTensor& x) {
  return ops::linear(x, weight_.tensor(),
                     bias_.defined() ? std::optional<ShardTensor>(bias_.tensor()) : std::nullopt);
}

RowParallelLinear::RowParallelLinear(const DeviceMesh& mesh, int64_t in_features,
                                     int64_t out_features, bool bias, uint64_t seed, DType dtype,
                                     TensorParallelOptions options)
    : options_(std::move(options)) {
  const std::string op = "row_parallel_linear";
  check_arg(in_features >= 1 && out_features >= 1, op, "features {} -> {}", in_features,
            out_features);
  tp_mesh_dim_ = tensor_parallel_mesh_dim(mesh, options_, op);
  check_divides(mesh, tp_mesh_dim_, in_features, "in features", op);
  auto [w, b] = linear_init(in_features, out_features, seed, dtype);
  weight_ =
      add_parameter("weight", ShardTensor::distribute(w, mesh, sharded_on(mesh, tp_mesh_dim_, 1)));
  if (bias)
    bias_ = add_parameter("bias", ShardTensor::distribute(b, mesh, sharded_on(mesh, -1, 0)));
}

ShardTensor RowParallelLinear::forward(const ShardTensor& x) {
  if (tp_mesh_dim_ < 0)
    return ops::linear(x, weight_.tensor(),
                       bias_.defined() ? std::optional<ShardTensor>(bias_.tensor()) : std::nullopt);
  ShardTensor y = ops::linear(x, weight_.tensor());  // Partial(sum) over tp
  // The one reduction of the region: all-reduce, or reduce-scatter along the sequence.
  std::vector<Placement> placements = y.placements();
  std::vector<std::vector<int64_t>> extents = y.spec().extents;
  placements[tp_mesh_dim_] =
      options_.sequence_parallel ? Placement::shard(options_.sequence_dim) : Placement::replicate();
  extents[tp_mesh_dim_].clear();
  y = y.redistribute_to(
      ShardSpec::make(y.global_shape(), y.spec().mesh_shape, placements, extents, "tp"));
  return bias_.defined() ? ops::add(y, bias_.tensor()) : y;
}

ParallelMlp::ParallelMlp(const DeviceMesh& mesh, int64_t features, int64_t hidden, uint64_t seed,
                         DType dtype, TensorParallelOptions options) {
  fc1_ = add_module("fc1", std::make_shared<ColumnParallelLinear>(mesh, features, hidden, true,
                                                                  seed, dtype, options));
  fc2_ = add_module("fc2", std::make_shared<RowParallelLinear>(mesh, hidden, features, true,
                                                               seed + 1, dtype, options));
}

ShardTensor ParallelMlp::forward(const ShardTensor& x) {
  return fc2_->forward(ops::gelu(fc1_->forward(x)));
}

ParallelAttention::ParallelAttention(const DeviceMesh& mesh, int64_t embed, int64_t heads,
                                     uint64_t seed, DType dtype, TensorParallelOptions options,
                                     bool causal)
    : causal_(causal) {
  const std::string op = "parallel_attention";
  check_arg(heads >= 1 && embed >= 1 && embed % heads == 0, op,
            "embed {} in {} heads (expected a multiple of the heads)", embed, heads);
  check_divides(mesh, tensor_parallel_mesh_dim(mesh, options, op), heads, "heads", op);
  head_dim_ = embed / heads;
  q_ = add_module(
      "q", std::make_shared<ColumnParallelLinear>(mesh, embed, embed, true, seed, dtype, options));
  k_ = add_module("k", std::make_shared<ColumnParallelLinear>(mesh, embed, embed, true, seed + 1,
                                                              dtype, options));
  v_ = add_module("v", std::make_shared<ColumnParallelLinear>(mesh, embed, embed, true, seed + 2,
                                                              dtype, options));
  out_ = add_module("out", std::make_shared<RowParallelLinear>(mesh, embed, embed, true, seed + 3,
                                                               dtype, options));
}

ShardTensor ParallelAttention::forward(const ShardTensor& x) {
  check_arg(x.global_shape().size() == 3, "parallel_attention",
            "expects x [B, S, embed], got global shape {}", x.global_shape());
  // Each rank's projection columns are whole heads, so the split keeps them on their rank.
  const ShardTensor q = ops::split_last(q_->forward(x), head_dim_);
  const ShardTensor k = ops::split_last(k_->forward(x), head_dim_);
  const ShardTensor v = ops::split_last(v_->forward(x), head_dim_);
  const ShardTensor o = ops::attention(q, k, v, {.causal = causal_, .scale = std::nullopt})[0];
  return out_->forward(ops::merge_last(o));
}

ParallelTransformerBlock::ParallelTransformerBlock(const DeviceMesh& mesh, int64_t embed,
                                                   int64_t heads, int64_t hidden, uint64_t seed,
                                                   DType dtype, TensorParallelOptions options) {
  ln1_ = add_module("ln1", std::make_shared<LayerNorm>(mesh, Shape{embed}, 1e-5, true, dtype));
  attention_ = add_module(
      "attention", std::make_shared<ParallelAttention>(mesh, embed, heads, seed, dtype, options));
  ln2_ = add_module("ln2", std::make_shared<LayerNorm>(mesh, Shape{embed}, 1e-5, true, dtype));
  mlp_ = add_module("mlp",
                    std::make_shared<ParallelMlp>(mesh, embed, hidden, seed + 4, dtype, options));
}

ShardTensor ParallelTransformerBlock::forward(const ShardTensor& x) {
  const ShardTensor h = ops::add(x, attention_->forward(ln1_->forward(x)));
  return ops::add(h, mlp_->forward(ln2_->forward(h)));
}

FilterParallelConv::FilterParallelConv(const DeviceMesh& mesh, ConvConfig config, uint64_t seed,
                                       TensorParallelOptions options)
    : config_(config) {
  const std::string op = "filter_parallel_conv";
  const int tp = tensor_parallel_mesh_dim(mesh, options, op);
  auto [w, b] = conv_init(mesh, tp, config, seed, true, op);
  const std::vector<Placement> out_split = sharded_on(mesh, tp, 0);
  weight_ = add_parameter("weight", ShardTensor::distribute(w, mesh, out_split));
  if (config.bias) bias_ = add_parameter("bias", ShardTensor::distribute(b, mesh, out_split));
}

ShardTensor FilterParallelConv::forward(const ShardTensor& x) {
  return ops::conv(x, weight_.tensor(),
                   bias_.defined() ? std::optional<ShardTensor>(bias_.tensor()) : std::nullopt,
                   config_.options);
}

ChannelParallelConv::ChannelParallelConv(const DeviceMesh& mesh, ConvConfig config, uint64_t seed,
                                         TensorParallelOptions options)
    : config_(config) {
  const std::string op = "channel_parallel_conv";
  tp_mesh_dim_ = tensor_parallel_mesh_dim(mesh, options, op);
  auto [w, b] = conv_init(mesh, tp_mesh_dim_, config, seed, false, op);
  weight_ =
      add_parameter("weight", ShardTensor::distribute(w, mesh, sharded_on(mesh, tp_mesh_dim_, 1)));
  if (config.bias)
    bias_ = add_parameter("bias", ShardTensor::distribute(b, mesh, sharded_on(mesh, -1, 0)));
}

ShardTensor ChannelParallelConv::forward(const ShardTensor& x) {
  const std::optional<ShardTensor> bias =
      bias_.defined() ? std::optional<ShardTensor>(bias_.tensor()) : std::nullopt;
  if (tp_mesh_dim_ < 0) return ops::conv(x, weight_.tensor(), bias, config_.options);
  ShardTensor y = ops::conv(x, weight_.tensor(), std::nullopt, config_.options);
  // The one reduction: each rank's share of the channel sum, all-reduced over tp.
  std::vector<Placement> placements = y.placements();
  placements[tp_mesh_dim_] = Placement::replicate();
  y = y.redistribute_to(
      ShardSpec::make(y.global_shape(), y.spec().mesh_shape, placements, y.spec().extents, "tp"));
  return bias ? ops::bias_add(y, *bias) : y;
}

FilterParallelConvTranspose::FilterParallelConvTranspose(const DeviceMesh& mesh,
                                                         ConvTransposeConfig config, uint64_t seed,
                                                         TensorParallelOptions options)
    : config_(config) {
  const std::string op = "filter_parallel_conv_transpose";
  const int tp = tensor_parallel_mesh_dim(mesh, options, op);
  auto [w, b] = conv_transpose_init(mesh, tp, config, seed, true, op);
  weight_ = add_parameter("weight", ShardTensor::distribute(w, mesh, sharded_on(mesh, tp, 1)));
  if (config.bias)
    bias_ = add_parameter("bias", ShardTensor::distribute(b, mesh, sharded_on(mesh, tp, 0)));
}

ShardTensor FilterParallelConvTranspose::forward(const ShardTensor& x) {
  return ops::conv_transpose(
      x, weight_.tensor(),
      bias_.defined() ? std::optional<ShardTensor>(bias_.tensor()) : std::nullopt, config_.options);
}

ChannelParallelConvTranspose::ChannelParallelConvTranspose(const DeviceMesh& mesh,
                                                           ConvTransposeConfig config,
                                                           uint64_t seed,
                                                           TensorParallelOptions options)
    : config_(config) {
  const std::string op = "channel_parallel_conv_transpose";
  tp_mesh_dim_ = tensor_parallel_mesh_dim(mesh, options, op);
  auto [w, b] = conv_transpose_init(mesh, tp_mesh_dim_, config, seed, false, op);
  weight_ =
      add_parameter("weight", ShardTensor::distribute(w, mesh, sharded_on(mesh, tp_mesh_dim_, 0)));
  if (config.bias)
    bias_ = add_parameter("bias", ShardTensor::distribute(b, mesh, sharded_on(mesh, -1, 0)));
}

ShardTensor ChannelParallelConvTranspose::forward(const ShardTensor& x) {
  const std::optional<ShardTensor> bias =
      bias_.defined() ? std::optional<ShardTensor>(bias_.tensor()) : std::nullopt;
  if (tp_mesh_dim_ < 0) return ops::conv_transpose(x, weight_.tensor(), bias, config_.options);
  ShardTensor y = ops::conv_transpose(x, weight_.tensor(), std::nullopt, config_.options);
  // The one reduction: each rank's share of the channel sum, all-reduced over tp.
  std::vector<Placement> placements = y.placements();
  placements[tp_mesh_dim_] = Placement::replicate();
  y = y.redistribute_to(
      ShardSpec::make(y.global_shape(), y.spec().mesh_shape, placements, y.spec().extents, "tp"));
  return bias ? ops::bias_add(y, *bias) : y;
}

}  // namespace tessera::nn
