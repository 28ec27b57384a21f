// Layers (ops/nn/layers.hpp).
#include "ops/nn/layers.hpp"

#include <cmath>
#include <functional>
#include <optional>
#include <random>

#include "core/estimate/estimate_mode.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/ops.hpp"

namespace tessera::nn {

namespace {

/// Values uniform in [-bound, bound) from `generator`, as f64, converted to `dtype`.
Tensor uniform(const Shape& shape, double bound, std::mt19937_64& generator, DType dtype) {
  // Estimate mode: the parameter's shape is all that matters, and it has no data to fill.
  if (estimate::active()) return Tensor::empty(shape, dtype);
  Tensor values = Tensor::empty(shape, DType::f64);
  std::uniform_real_distribution<double> pick(-bound, bound);
  for (int64_t i = 0; i < values.numel(); ++i) values.data<double>()[i] = pick(generator);
  return values.to_dtype(dtype);
}

/// A replicated tensor of `shape` filled with `value` on the calling rank's device.
ShardTensor filled(const DeviceMesh& mesh, const Shape& shape, double value, DType dtype) {
  Tensor values = Tensor::empty(shape, dtype, current_rank_context().device());
  values.fill(value);
  return ShardTensor::distribute(values, mesh,
                                 std::vector<Placement>(mesh.ndim(), Placement::replicate()));
}

/// The optional ShardTensor of a parameter (nullopt when undefined).
std::optional<ShardTensor> optional_of(const Parameter& parameter) {
  return parameter.defined() ? std::optional<ShardTensor>(parameter.tensor()) : std::nullopt;
}

/// The cpu convolutions run f32 and f64 only. Under an f16/bf16 compute dtype a conv layer on the
/// cpu convolves its already rounded input, weight and bias widened to f32 (exact) and rounds the
/// result to the compute dtype: what a half-precision kernel accumulating in f32 gives; the
/// gradients pass through the same casts, so they are rounded to the compute dtype as well.
bool conv_widens_on_cpu(const ShardTensor& x) {
  return (x.dtype() == DType::f16 || x.dtype() == DType::bf16) && x.to_local().device().is_cpu();
}

std::optional<ShardTensor> widened(const std::optional<ShardTensor>& value) {
  return value ? std::optional<ShardTensor>(ops::cast(*value, DType::f32)) : std::nullopt;
}

/// weight = 1 and bias = 0 of `shape`, registered on `module` when `affine`.
void add_affine(const DeviceMesh& mesh, const Shape& shape, bool affine, DType dtype,
                Parameter& weight, Parameter& bias,
                const std::function<Parameter(const std::string&, ShardTensor)>& add) {
  if (!affine) return;
  weight = add("weight", filled(mesh, shape, 1.0, dtype));
  bias = add("bias", filled(mesh, shape, 0.0, dtype));
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
  const ShardTensor input = compute_input(x);
  if (conv_widens_on_cpu(input))
    return ops::cast(
        ops::conv(ops::cast(input, DType::f32), ops::cast(compute_value(weight_), DType::f32),
                  widened(compute_optional(bias_)), config_.options),
        input.dtype());
  return ops::conv(input, compute_value(weight_), compute_optional(bias_), config_.options);
}

ConvTranspose::ConvTranspose(const DeviceMesh& mesh, ConvTransposeConfig config, uint64_t seed)
    : config_(config) {
  const int64_t groups = config.options.groups;
  check_arg(config.spatial_dims >= 1 && config.spatial_dims <= 3, "conv_transpose",
            "spatial dims {} (expected 1, 2 or 3)", config.spatial_dims);
  check_arg(config.in_channels >= 1 && config.out_channels >= 1 && config.kernel >= 1 &&
                groups >= 1 && config.in_channels % groups == 0 &&
                config.out_channels % groups == 0,
            "conv_transpose", "channels {} -> {}, kernel {}, groups {}", config.in_channels,
            config.out_channels, config.kernel, groups);
  Shape w_shape{config.in_channels, config.out_channels / groups};
  for (int d = 0; d < config.spatial_dims; ++d) w_shape.push_back(config.kernel);
  // PyTorch's fan_in of a weight is its dim 1 times the kernel's cells: out/groups * prod(k).
  const double fan_in = static_cast<double>(shape_numel(w_shape) / config.in_channels);
  const double bound = 1.0 / std::sqrt(fan_in);
  std::mt19937_64 generator(seed);
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
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

ShardTensor ConvTranspose::forward(const ShardTensor& x) {
  check_arg(static_cast<int>(x.global_shape().size()) == config_.spatial_dims + 2, "conv_transpose",
            "conv_transpose{}d expects an input [N, C, {} spatial dims], got global shape {}",
            config_.spatial_dims, config_.spatial_dims, x.global_shape());
  const ShardTensor input = compute_input(x);
  if (conv_widens_on_cpu(input))
    return ops::cast(ops::conv_transpose(ops::cast(input, DType::f32),
                                         ops::cast(compute_value(weight_), DType::f32),
                                         widened(compute_optional(bias_)), config_.options),
                     input.dtype());
  return ops::conv_transpose(input, compute_value(weight_), compute_optional(bias_),
                             config_.options);
}

MaxPool::MaxPool(ops::PoolOptions options) : options_(std::move(options)) {}

ShardTensor MaxPool::forward(const ShardTensor& x) {
  return ops::max_pool(x, options_);
}

Upsample::Upsample(ops::InterpolateOptions options) : options_(std::move(options)) {}

ShardTensor Upsample::forward(const ShardTensor& x) {
  return ops::interpolate(x, options_);
}

AvgPool::AvgPool(ops::PoolOptions options) : options_(std::move(options)) {}

ShardTensor AvgPool::forward(const ShardTensor& x) {
  return ops::avg_pool(x, options_);
}

GroupNorm::GroupNorm(const DeviceMesh& mesh, int64_t groups, int64_t channels, double eps,
                     bool affine, DType dtype)
    : groups_(groups), eps_(eps) {
  check_arg(groups >= 1 && channels >= 1 && channels % groups == 0, "group_norm",
            "{} channels in {} groups (expected a divisor of the channels)", channels, groups);
  add_affine(mesh, {channels}, affine, dtype, weight_, bias_,
             [&](const std::string& name, ShardTensor value) {
               return add_parameter(name, std::move(value));
             });
}

ShardTensor GroupNorm::forward(const ShardTensor& x) {
  return ops::group_norm(compute_input(x), groups_, compute_optional(weight_),
                         compute_optional(bias_), eps_);
}

BatchNorm::BatchNorm(const DeviceMesh& mesh, int64_t channels, double eps, double momentum,
                     bool affine, DType dtype)
    : eps_(eps), momentum_(momentum) {
  check_arg(channels >= 1, "batch_norm", "{} channels (expected at least 1)", channels);
  add_affine(mesh, {channels}, affine, dtype, weight_, bias_,
             [&](const std::string& name, ShardTensor value) {
               return add_parameter(name, std::move(value));
             });
  add_buffer("running_mean", filled(mesh, {channels}, 0.0, dtype));
  add_buffer("running_var", filled(mesh, {channels}, 1.0, dtype));
}

ShardTensor BatchNorm::forward(const ShardTensor& x) {
  // Under mixed precision the statistics stay in the buffers' dtype (as torch.autocast runs
  // batch_norm in f32): x is widened to it and the output cast to the compute dtype.
  const DType statistics_dtype = buffer("running_mean").dtype();
  const ops::BatchNormResult result =
      ops::batch_norm(compute_dtype() ? ops::cast(x, statistics_dtype) : x, buffer("running_mean"),
                      buffer("running_var"), optional_of(weight_), optional_of(bias_),
                      {.training = training(), .momentum = momentum_, .eps = eps_});
  if (training()) {
    // New values outside any autograd record (buffers are state, not part of the graph).
    for (const auto& [name, value] : {std::pair{"running_mean", *result.running_mean},
                                      std::pair{"running_var", *result.running_var}})
      set_buffer(name, ShardTensor(value.to_local(), value.mesh(), value.spec()));
  }
  return compute_input(result.y);
}

InstanceNorm::InstanceNorm(const DeviceMesh& mesh, int64_t channels, double eps, bool affine,
                           DType dtype)
    : eps_(eps) {
  check_arg(channels >= 1, "instance_norm", "{} channels (expected at least 1)", channels);
  add_affine(mesh, {channels}, affine, dtype, weight_, bias_,
             [&](const std::string& name, ShardTensor value) {
               return add_parameter(name, std::move(value));
             });
}

ShardTensor InstanceNorm::forward(const ShardTensor& x) {
  return ops::instance_norm(compute_input(x), compute_optional(weight_), compute_optional(bias_),
                            eps_);
}

LayerNorm::LayerNorm(const DeviceMesh& mesh, Shape normalized_shape, double eps,
                     bool elementwise_affine, DType dtype)
    : normalized_shape_(std::move(normalized_shape)), eps_(eps) {
  check_arg(!normalized_shape_.empty(), "layer_norm", "empty normalized shape");
  add_affine(mesh, normalized_shape_, elementwise_affine, dtype, weight_, bias_,
             [&](const std::string& name, ShardTensor value) {
               return add_parameter(name, std::move(value));
             });
}

ShardTensor LayerNorm::forward(const ShardTensor& x) {
  const Shape& shape = x.global_shape();
  const size_t n = normalized_shape_.size();
  check_arg(shape.size() >= n && Shape(shape.end() - n, shape.end()) == normalized_shape_,
            "layer_norm", "input of shape {} does not end in the normalized shape {}", shape,
            normalized_shape_);
  return ops::layer_norm(compute_input(x), static_cast<int64_t>(n), compute_optional(weight_),
                         compute_optional(bias_), eps_);
}

Linear::Linear(const DeviceMesh& mesh, int64_t in_features, int64_t out_features, bool bias,
               uint64_t seed, DType dtype) {
  check_arg(in_features >= 1 && out_features >= 1, "linear", "features {} -> {}", in_features,
            out_features);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  std::mt19937_64 generator(seed);
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  const Device device = current_rank_context().device();
  weight_ = add_parameter(
      "weight", ShardTensor::distribute(
                    uniform({out_features, in_features}, bound, generator, dtype).to(device), mesh,
                    replicated));
  if (bias)
    bias_ = add_parameter(
        "bias", ShardTensor::distribute(uniform({out_features}, bound, generator, dtype).to(device),
                                        mesh, replicated));
}

ShardTensor Linear::forward(const ShardTensor& x) {
  return ops::linear(compute_input(x), compute_value(weight_), compute_optional(bias_));
}

Dropout::Dropout(double p, uint64_t seed) : p_(p), seed_(seed) {
  check_arg(p >= 0 && p <= 1, "dropout", "p = {} is not a probability in [0, 1]", p);
  add_counter("calls", 0);
}

ShardTensor Dropout::forward(const ShardTensor& x) {
  if (!training()) return x;
  const int64_t call = counter("calls")++;
  return ops::dropout(x, p_, seed_ + static_cast<uint64_t>(call), true);
}

Activation::Activation(std::string kind) : kind_(std::move(kind)) {
  check_arg(kind_ == "relu" || kind_ == "gelu" || kind_ == "silu" || kind_ == "tanh" ||
                kind_ == "sigmoid" || kind_ == "softplus",
            "activation", "'{}' (expected relu, gelu, silu, tanh, sigmoid or softplus)", kind_);
}

ShardTensor Activation::forward(const ShardTensor& x) {
  if (kind_ == "relu") return ops::relu(x);
  if (kind_ == "gelu") return ops::gelu(x);
  if (kind_ == "silu") return ops::silu(x);
  if (kind_ == "sigmoid") return ops::sigmoid(x);
  if (kind_ == "softplus") return ops::softplus(x);
  return ops::tanh(x);
}

}  // namespace tessera::nn
