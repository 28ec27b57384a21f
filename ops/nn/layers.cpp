// Layers (ops/nn/layers.hpp).
#include "ops/nn/layers.hpp"

#include <cmath>
#include <random>

#include "core/runtime/rank_context.hpp"
#include "ops/ops.hpp"

namespace tessera::nn {

namespace {

/// Values uniform in [-bound, bound) from `generator`, as f64, converted to `dtype`.
Tensor uniform(const Shape& shape, double bound, std::mt19937_64& generator, DType dtype) {
  Tensor values = Tensor::empty(shape, DType::f64);
  std::uniform_real_distribution<double> pick(-bound, bound);
  for (int64_t i = 0; i < values.numel(); ++i) values.data<double>()[i] = pick(generator);
  return values.to_dtype(dtype);
}

}  // namespace

Conv::Conv(const DeviceMesh& mesh, ConvConfig config, uint64_t seed) : config_(config) {
  check_arg(config.spatial_dims >= 1 && config.spatial_dims <= 3, "conv",
            "spatial dims {} (expected 1, 2 or 3)", config.spatial_dims);
  check_arg(config.in_channels >= 1 && config.out_channels >= 1 && config.kernel >= 1 &&
                config.options.groups >= 1 && config.in_channels % config.options.groups == 0 &&
                config.out_channels % config.options.groups == 0,
            "conv", "channels {} -> {}, kernel {}, groups {}", config.in_channels,
            config.out_channels, config.kernel, config.options.groups);
  Shape w_shape{config.out_channels, config.in_channels / config.options.groups};
  for (int d = 0; d < config.spatial_dims; ++d) w_shape.push_back(config.kernel);
  const double fan_in = static_cast<double>(shape_numel(w_shape) / config.out_channels);
  const double bound = 1.0 / std::sqrt(fan_in);
  std::mt19937_64 generator(seed);
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  // Made on the calling rank's device, like every other result.
  const Device device = current_rank_context().device();
  weight_ = add_parameter(
      "weight", ShardTensor::distribute(uniform(w_shape, bound, generator, config.dtype).to(device),
                                        mesh, replicated));
  if (config.bias)
    bias_ = add_parameter(
        "bias", ShardTensor::distribute(
                    uniform({config.out_channels}, bound, generator, config.dtype).to(device), mesh,
                    replicated));
}

ShardTensor Conv::forward(const ShardTensor& x) {
  check_arg(static_cast<int>(x.global_shape().size()) == config_.spatial_dims + 2, "conv",
            "conv{}d expects an input [N, C, {} spatial dims], got global shape {}",
            config_.spatial_dims, config_.spatial_dims, x.global_shape());
  return ops::conv(x, weight_.tensor(),
                   bias_.defined() ? std::optional<ShardTensor>(bias_.tensor()) : std::nullopt,
                   config_.options);
}

MaxPool::MaxPool(ops::PoolOptions options) : options_(std::move(options)) {}

ShardTensor MaxPool::forward(const ShardTensor& x) {
  return ops::max_pool(x, options_);
}

AvgPool::AvgPool(ops::PoolOptions options) : options_(std::move(options)) {}

ShardTensor AvgPool::forward(const ShardTensor& x) {
  return ops::avg_pool(x, options_);
}

Activation::Activation(std::string kind) : kind_(std::move(kind)) {
  check_arg(kind_ == "relu" || kind_ == "gelu" || kind_ == "silu" || kind_ == "tanh", "activation",
            "'{}' (expected relu, gelu, silu or tanh)", kind_);
}

ShardTensor Activation::forward(const ShardTensor& x) {
  if (kind_ == "relu") return ops::relu(x);
  if (kind_ == "gelu") return ops::gelu(x);
  if (kind_ == "silu") return ops::silu(x);
  return ops::tanh(x);
}

}  // namespace tessera::nn
