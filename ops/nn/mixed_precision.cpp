// Mixed precision (ops/nn/mixed_precision.hpp).
#include "ops/nn/mixed_precision.hpp"

#include <cmath>
#include <type_traits>

#include "core/autograd.hpp"
#include "core/errors.hpp"
#include "ops/pointwise/pointwise_ops.hpp"

namespace tessera::nn {

namespace {

/// The gradient's local piece divided by `scale` on the host (f32/f64 in their own precision,
/// f16/bf16 through float), on t's device again. Powers of two divide exactly.
Tensor unscaled(const Tensor& t, double scale) {
  Tensor host = t.to(Device::cpu()).contiguous().clone();
  dispatch_dtype(host.dtype(), [&]<typename T>() {
    if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
      const T inverse = static_cast<T>(1.0 / scale);
      T* values = host.data<T>();
      for (int64_t i = 0; i < host.numel(); ++i) values[i] *= inverse;
    } else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      const float inverse = static_cast<float>(1.0 / scale);
      T* values = host.data<T>();
      for (int64_t i = 0; i < host.numel(); ++i)
        values[i] = T(static_cast<float>(values[i]) * inverse);
    }
  });
  return t.device().is_cpu() ? host : host.to(t.device());
}

}  // namespace

void apply_mixed_precision(Module& model, const MixedPrecision& policy) {
  check_arg(is_floating(policy.compute), "mixed_precision",
            "compute dtype {} is not floating (expected bf16, f16, f32 or f64)",
            dtype_name(policy.compute));
  for (const auto& [name, parameter] : model.named_parameters())
    check_arg(parameter.stored().dtype() == policy.reduce, "mixed_precision",
              "reduce dtype {} differs from the dtype {} of parameter '{}' (gradients are reduced "
              "in the master weights' dtype)",
              dtype_name(policy.reduce), dtype_name(parameter.stored().dtype()), name);
  model.set_compute_dtype(policy.compute);
}

bool has_non_finite(const Tensor& t) {
  const Tensor host = t.to(Device::cpu()).contiguous();
  return dispatch_dtype(host.dtype(), [&]<typename T>() {
    if constexpr (std::is_integral_v<T>) {
      return false;
    } else {
      const T* values = host.data<T>();
      for (int64_t i = 0; i < host.numel(); ++i)
        if (!std::isfinite(static_cast<double>(values[i]))) return true;
      return false;
    }
  });
}

GradScaler::GradScaler(std::vector<Parameter> parameters, GradScalerOptions options)
    : parameters_(std::move(parameters)), options_(options) {
  check_arg(!parameters_.empty(), "grad_scaler", "no parameters");
  check_arg(options_.init_scale > 0 && std::isfinite(options_.init_scale), "grad_scaler",
            "init_scale = {} (expected a finite positive number)", options_.init_scale);
  check_arg(options_.growth_factor > 1, "grad_scaler", "growth_factor = {} (expected > 1)",
            options_.growth_factor);
  check_arg(options_.backoff_factor > 0 && options_.backoff_factor < 1, "grad_scaler",
            "backoff_factor = {} (expected in (0, 1))", options_.backoff_factor);
  check_arg(options_.growth_interval >= 1, "grad_scaler", "growth_interval = {} (expected >= 1)",
            options_.growth_interval);
  for (const Parameter& parameter : parameters_)
    check_arg(
        parameter.stored().mesh().comm_ptr() == parameters_.front().stored().mesh().comm_ptr(),
        "grad_scaler", "parameter '{}' is on another communicator than '{}'", parameter.name(),
        parameters_.front().name());
  state_.scale = options_.init_scale;
}

const DeviceMesh& GradScaler::mesh() const {
  return parameters_.front().stored().mesh();
}

ShardTensor GradScaler::scale(const ShardTensor& loss) const {
  return ops::scale(loss, state_.scale);
}

bool GradScaler::unscale() {
  if (unscaled_) return found_inf_;
  uint8_t local_inf = 0;
  for (Parameter& parameter : parameters_) {
    const std::optional<ShardTensor> grad = parameter.grad();
    if (!grad) continue;
    if (has_non_finite(grad->to_local())) local_inf = 1;
    parameter.set_grad(
        ShardTensor(unscaled(grad->to_local(), state_.scale), grad->mesh(), grad->spec()));
  }
  // One all-reduce over every rank of the mesh: a shard's inf on one rank skips the step on all.
  uint8_t any_inf = 0;
  mesh().comm().all_reduce(&local_inf, &any_inf, 1, DType::u8, ReduceOp::max);
  found_inf_ = any_inf != 0;
  unscaled_ = true;
  return found_inf_;
}

bool GradScaler::step(optim::Optimizer& optimizer) {
  const bool found_inf = unscale();
  if (!found_inf) optimizer.step();
  return !found_inf;
}

void GradScaler::update() {
  check_arg(unscaled_, "grad_scaler", "update() before step() or unscale() in this iteration");
  if (found_inf_) {
    state_.scale *= options_.backoff_factor;
    state_.growth_tracker = 0;
  } else if (++state_.growth_tracker == options_.growth_interval) {
    state_.scale *= options_.growth_factor;
    state_.growth_tracker = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
}

void GradScaler::load_state(const GradScalerState& state) {
  check_arg(state.scale > 0 && std::isfinite(state.scale) && state.growth_tracker >= 0,
            "grad_scaler",
            "state scale = {}, growth_tracker = {} (expected a finite positive "
            "scale and a non-negative tracker)",
            state.scale, state.growth_tracker);
  state_ = state;
  unscaled_ = false;
  found_inf_ = false;
}

}  // namespace tessera::nn
