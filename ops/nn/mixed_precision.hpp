// Mixed precision: parameters (the master weights) and optimizer state stay in their dtype (f32),
// while the layers compute in a lower one (bf16, or f16 with loss scaling), as torch.autocast with
// FSDP's MixedPrecision policy does. Each layer casts its parameters to the compute dtype where it
// uses them (ops::cast, differentiable: the gradient comes back to the master weight in f32) and
// its input likewise, so activations flow in the compute dtype. The weight gradients reach the
// master weights as f32 Partial sums, so data-parallel reducers (DDP buckets, FSDP's reduce-
// scatter) reduce them in f32 with their rank-independent order: replicas stay bit-identical.
//
//   nn::apply_mixed_precision(*model, {.compute = DType::bf16});
//   const ShardTensor y = ops::cast(model->forward(x), DType::f32);  // the loss in f32
//
// f16 overflows where bf16 does not (largest finite 65504), and small gradients underflow: the
// loss is scaled before backward and the gradients unscaled before the step by a GradScaler
// (torch.amp.GradScaler's dynamic scaling), which skips the step on every rank when any rank
// finds an inf or NaN.
#pragma once

#include <cstdint>
#include <vector>

#include "core/parameter.hpp"
#include "ops/nn/module.hpp"
#include "ops/optim/optimizer.hpp"

namespace tessera::nn {

/// Which dtypes a mixed-precision run uses.
struct MixedPrecision {
  DType compute = DType::bf16;  ///< layers' forward and backward (f16, bf16, f32 or f64)
  DType reduce = DType::f32;    ///< gradient reduction: the parameters' own dtype
};

/// Sets `policy.compute` as the compute dtype of every module of `model` (Module::
/// set_compute_dtype). Refused with one error naming the option: a compute dtype that is not
/// floating, or a reduce dtype other than the dtype of the model's parameters (gradients are
/// reduced in the master weights' dtype, where the cast's backward delivers them).
void apply_mixed_precision(Module& model, const MixedPrecision& policy);

struct GradScalerOptions {
  double init_scale = 65536.0;  ///< 2^16
  double growth_factor = 2.0;   ///< scale *= growth after growth_interval good steps in a row
  double backoff_factor = 0.5;  ///< scale *= backoff after a step with an inf or NaN
  int64_t growth_interval = 2000;
};

/// The scaler's state, as saved in training checkpoints.
struct GradScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;  ///< good steps since the last change of the scale
};

/// Dynamic loss scaling (torch.amp.GradScaler): scale(loss) before backward; step(optimizer)
/// unscales the gradients, and steps unless a gradient holds an inf or NaN on any rank of the
/// parameters' mesh (decided by one all-reduce, so every rank skips or steps alike); update()
/// then halves the scale after a skipped step and doubles it after growth_interval good ones.
class GradScaler {
 public:
  /// Scales the gradients of `parameters` (all on one mesh).
  explicit GradScaler(std::vector<Parameter> parameters, GradScalerOptions options = {});

  /// loss * scale (differentiable; a power of two, so exact unless it overflows).
  ShardTensor scale(const ShardTensor& loss) const;
  /// Collective: divides every gradient by the scale (once per step) and returns whether one held
  /// an inf or NaN on any rank.
  bool unscale();
  /// Collective: unscale() unless done, then optimizer.step() when no inf or NaN was found.
  /// Returns whether the optimizer stepped.
  bool step(optim::Optimizer& optimizer);
  /// Adjusts the scale after step(): backoff on a skipped step, growth after the interval.
  void update();

  /// The current scale.
  double get_scale() const { return state_.scale; }
  const GradScalerState& state() const { return state_; }
  void load_state(const GradScalerState& state);
  /// The mesh of the parameters (checkpoints store the state there).
  const DeviceMesh& mesh() const;

 private:
  std::vector<Parameter> parameters_;
  GradScalerOptions options_;
  GradScalerState state_;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

/// Whether the local piece `t` holds an inf or NaN (any floating dtype, any device).
bool has_non_finite(const Tensor& t);

}  // namespace tessera::nn
