// Optimizers over Parameters with PyTorch's update formulas (torch.optim, single-tensor path):
// SGD (momentum, dampening, nesterov, weight decay, maximize), Adam and AdamW (amsgrad). Each
// update is elementwise on the rank's local piece, so a sharded parameter has sharded state laid
// out like it, a replicated one replicated state, and replicas stay bit-identical (the same
// operations on the same values on every rank). Parameters without a gradient are skipped. f32
// and f64 parameters on cpu.
//
//   optim::AdamW adam(model.parameters(), {.lr = 1e-3, .weight_decay = 1e-2});
//   for (...) { adam.zero_grad(); { Tape tape; tape.backward(loss(...)); } adam.step(); }
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/parameter.hpp"

namespace tessera::optim {

/// What optimizers share: the parameters, the learning rate, the step count and per-parameter
/// state tensors.
class Optimizer {
 public:
  Optimizer(std::vector<Parameter> parameters, double lr, std::string name);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// One update of every parameter that has a gradient.
  virtual void step() = 0;
  /// Drops every parameter's gradient.
  void zero_grad();
  double lr() const { return lr_; }
  /// Sets the learning rate of later steps (schedules call this once per step).
  void set_lr(double lr);
  /// Steps taken so far.
  int64_t steps() const { return steps_; }
  const std::vector<Parameter>& parameters() const { return parameters_; }

  /// The state for checkpoints: "step" (a 0-d f64 tensor replicated like the first parameter)
  /// and "<parameter index>.<buffer>" for each state buffer, laid out like its parameter.
  std::map<std::string, ShardTensor> state_dict() const;
  /// Restores state_dict() output (any layout of the same global shapes: moved to each
  /// parameter's layout). Unknown or missing keys and shape mismatches raise one error naming
  /// the key.
  void load_state_dict(const std::map<std::string, ShardTensor>& state);
  /// The checks of load_state_dict alone (nothing is written).
  void check_state_dict(const std::map<std::string, ShardTensor>& state) const;

 protected:
  /// The state buffer `buffer` of parameter `index` (created zero-filled, like the parameter,
  /// on first use when `create`; nullptr when absent and not created).
  Tensor* buffer(size_t index, const std::string& buffer, bool create);
  /// Names of the buffers this optimizer keeps per parameter.
  virtual std::vector<std::string> buffer_names() const = 0;

  std::vector<Parameter> parameters_;
  double lr_;
  int64_t steps_ = 0;
  std::string name_;

 private:
  std::vector<std::map<std::string, Tensor>> state_;
};

struct SgdOptions {
  double lr = 1e-3;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
  bool maximize = false;
};

/// torch.optim.SGD: g = grad (+ weight_decay * p); with momentum, b = g on the first step and
/// b = momentum * b + (1 - dampening) * g after, g = g + momentum * b (nesterov) or b; p -= lr * g.
class Sgd final : public Optimizer {
 public:
  Sgd(std::vector<Parameter> parameters, SgdOptions options);
  void step() override;

 private:
  std::vector<std::string> buffer_names() const override;
  SgdOptions options_;
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  std::optional<double> weight_decay{};  ///< default: 0 for Adam, 1e-2 for AdamW (PyTorch's)
  bool amsgrad = false;
  bool maximize = false;
};

/// torch.optim.Adam (decoupled = false: weight decay added to the gradient) and AdamW
/// (decoupled = true: p *= 1 - lr * weight_decay first). m = lerp(m, g, 1 - beta1),
/// v = beta2 * v + (1 - beta2) * g * g, denom = sqrt(v) / sqrt(1 - beta2^t) + eps (amsgrad: the
/// running maximum of v), p -= lr / (1 - beta1^t) * m / denom.
class Adam : public Optimizer {
 public:
  Adam(std::vector<Parameter> parameters, AdamOptions options);
  void step() override;

 protected:
  Adam(std::vector<Parameter> parameters, AdamOptions options, bool decoupled, std::string name);

 private:
  std::vector<std::string> buffer_names() const override;
  AdamOptions options_;
  bool decoupled_;
};

/// torch.optim.AdamW (weight_decay default 1e-2).
class AdamW final : public Adam {
 public:
  AdamW(std::vector<Parameter> parameters, AdamOptions options);
};

/// Learning rate at step `step` (0-based) for a base rate: linear warmup from base/warmup to base
/// over `warmup` steps, then a cosine from base down to `min_lr` at step `total` (held there
/// after).
double warmup_cosine_lr(int64_t step, double base, int64_t warmup, int64_t total,
                        double min_lr = 0);
/// torch.optim.lr_scheduler.StepLR: base * gamma^(step / step_size).
double step_lr(int64_t step, double base, int64_t step_size, double gamma);

/// Collective over the parameters' meshes: clips the gradients in place to a global 2-norm of at
/// most `max_norm` like torch.nn.utils.clip_grad_norm_ (the norm of the per-parameter norms,
/// coefficient max_norm / (norm + 1e-6) when below 1) and returns the norm before clipping.
/// Each parameter's norm counts every element once (summed over the mesh dims that shard it,
/// gathered and added in rank order): the same value on every rank.
double clip_grad_norm(const std::vector<Parameter>& parameters, double max_norm);

}  // namespace tessera::optim
