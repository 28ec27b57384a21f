// Optimizers (ops/optim/optimizer.hpp): PyTorch's update formulas on each rank's local piece.
#include "ops/optim/optimizer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <type_traits>

#include "core/compute_threads.hpp"
#include "core/parallel_for.hpp"
#include "core/trace.hpp"
#include "ops/optim/optimizer_cuda.hpp"
#include "ops/optim/update_rules.hpp"

namespace tessera::optim {

namespace {

/// Elements per parallel chunk of an update (elementwise: the order does not matter).
constexpr int64_t kChunk = int64_t{1} << 14;

/// Calls body(begin, end) over [0, count) in parallel chunks.
template <typename Body>
void for_chunks(int64_t count, Body&& body) {
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  parallel_for(chunks, compute_threads(), [&](int64_t first, int64_t last, int) {
    for (int64_t chunk = first; chunk < last; ++chunk)
      body(chunk * kChunk, std::min(count, (chunk + 1) * kChunk));
  });
}

/// The local values of a parameter and of its gradient, checked for an update.
struct Operands {
  Tensor value;  // the parameter's storage (updated in place)
  Tensor grad;   // contiguous, same shape and dtype
};

Operands operands_of(const Parameter& parameter, const std::string& op) {
  const Tensor value = parameter.tensor().to_local();
  const Tensor grad = parameter.grad()->to_local().contiguous();
  TESSERA_CHECK_ARG(grad.device() == value.device(), op,
                    "the gradient of parameter '{}' is on {}, it is on {}", parameter.name(),
                    grad.device().str(), value.device().str());
  check_arg(value.dtype() == DType::f32 || value.dtype() == DType::f64, op,
            "parameter '{}' is {}: updates take f32 or f64 parameters", parameter.name(),
            dtype_name(value.dtype()));
  check_arg(value.is_contiguous(), op, "parameter '{}' is not contiguous", parameter.name());
  TESSERA_CHECK_ARG(grad.shape() == value.shape() && grad.dtype() == value.dtype(), op,
                    "the gradient of parameter '{}' ({}) does not match it ({})", parameter.name(),
                    grad.str(), value.str());
  return {value, grad};
}

/// Sum of squares of a local tensor in f64, in a fixed order (chunks of kChunk elements summed
/// on their own, then the chunks in order): the same on every rank and thread count.
double sum_of_squares(const Tensor& tensor) {
  if (tensor.is_shape_only()) return 0;  // estimate mode: the norm's collectives still run
  const Tensor values = tensor.to(Device::cpu()).to_dtype(DType::f64).contiguous();
  const double* x = values.data<double>();
  const int64_t count = values.numel();
  std::vector<double> chunks(static_cast<size_t>((count + kChunk - 1) / kChunk), 0.0);
  for_chunks(count, [&](int64_t begin, int64_t end) {
    double sum = 0;
    for (int64_t i = begin; i < end; ++i) sum += x[i] * x[i];
    chunks[static_cast<size_t>(begin / kChunk)] = sum;
  });
  double total = 0;
  for (double chunk : chunks) total += chunk;
  return total;
}

}  // namespace

// ---- Optimizer ----

Optimizer::Optimizer(std::vector<Parameter> parameters, double lr, std::string name)
    : parameters_(std::move(parameters)), lr_(lr), name_(std::move(name)) {
  check_arg(std::isfinite(lr) && lr >= 0, name_, "learning rate {} (expected >= 0)", lr);
  for (size_t i = 0; i < parameters_.size(); ++i)
    check_arg(parameters_[i].defined(), name_, "parameter {} is undefined", i);
  state_.resize(parameters_.size());
}

void Optimizer::zero_grad() {
  for (Parameter& parameter : parameters_) parameter.zero_grad();
}

void Optimizer::set_lr(double lr) {
  check_arg(std::isfinite(lr) && lr >= 0, name_, "learning rate {} (expected >= 0)", lr);
  lr_ = lr;
}

Tensor* Optimizer::buffer(size_t index, const std::string& name, bool create) {
  auto& buffers = state_[index];
  auto found = buffers.find(name);
  if (found != buffers.end()) return &found->second;
  if (!create) return nullptr;
  const Tensor& value = parameters_[index].tensor().to_local();
  return &buffers.emplace(name, Tensor::zeros(value.shape(), value.dtype(), value.device()))
              .first->second;
}

std::map<std::string, ShardTensor> Optimizer::state_dict() const {
  std::map<std::string, ShardTensor> state;
  if (parameters_.empty()) return state;
  const ShardTensor& first = parameters_.front().tensor();
  const std::vector<Placement> replicated(first.mesh().ndim(), Placement::replicate());
  state.emplace("step", ShardTensor::distribute(
                            Tensor::from_values<double>({}, std::vector<double>{double(steps_)}),
                            first.mesh(), replicated));
  for (size_t i = 0; i < parameters_.size(); ++i)
    for (const auto& [name, tensor] : state_[i]) {
      const ShardTensor& parameter = parameters_[i].tensor();
      state.emplace(fmt::format("{}.{}", i, name),
                    ShardTensor(tensor, parameter.mesh(), parameter.spec()));
    }
  return state;
}

void Optimizer::check_state_dict(const std::map<std::string, ShardTensor>& state) const {
  const std::vector<std::string> names = buffer_names();
  for (const auto& [key, tensor] : state) {
    if (key == "step") continue;
    const size_t dot = key.find('.');
    bool known = dot != std::string::npos &&
                 std::find(names.begin(), names.end(), key.substr(dot + 1)) != names.end();
    size_t index = 0;
    if (known) {
      try {
        size_t used = 0;
        index = std::stoul(key.substr(0, dot), &used);
        known = used == dot && index < parameters_.size();
      } catch (const std::exception&) {
        known = false;
      }
    }
    check_arg(known, name_,
              "state key '{}' is not one of this optimizer's ({} parameters, buffers {})", key,
              parameters_.size(), fmt::join(names, ", "));
    const ShardTensor& parameter = parameters_[index].tensor();
    check_arg(
        tensor.global_shape() == parameter.global_shape() && tensor.dtype() == parameter.dtype(),
        name_, "state '{}' has global shape {} {}, its parameter {} {}", key, tensor.global_shape(),
        dtype_name(tensor.dtype()), parameter.global_shape(), dtype_name(parameter.dtype()));
  }
  check_arg(state.count("step") == 1, name_, "state has no 'step'");
}

void Optimizer::load_state_dict(const std::map<std::string, ShardTensor>& state) {
  check_state_dict(state);
  const Tensor step = state.at("step").full_tensor();
  steps_ = static_cast<int64_t>(step.to(Device::cpu()).item_as_double({}));
  for (auto& buffers : state_) buffers.clear();
  NoGrad no_grad;
  for (const auto& [key, tensor] : state) {
    if (key == "step") continue;
    const size_t dot = key.find('.');
    const size_t index = std::stoul(key.substr(0, dot));
    const ShardTensor& parameter = parameters_[index].tensor();
    const ShardTensor moved = tensor.redistribute(parameter.placements(), parameter.spec().extents);
    state_[index][key.substr(dot + 1)] =
        moved.to_local().to(parameter.device()).contiguous().clone();
  }
}

// ---- SGD ----

Sgd::Sgd(std::vector<Parameter> parameters, SgdOptions options)
    : Optimizer(std::move(parameters), options.lr, "sgd"), options_(options) {
  check_arg(options.momentum >= 0 && options.weight_decay >= 0, name_,
            "momentum {} and weight decay {} must be >= 0", options.momentum, options.weight_decay);
  check_arg(!options.nesterov || (options.momentum > 0 && options.dampening == 0), name_,
            "nesterov momentum requires a momentum and zero dampening");
}

std::vector<std::string> Sgd::buffer_names() const {
  return {"momentum_buffer"};
}

void Sgd::step() {
  trace::Span span("optimizer", name_);
  ++steps_;
  for (size_t index = 0; index < parameters_.size(); ++index) {
    const Parameter& parameter = parameters_[index];
    if (!parameter.grad()) continue;
    const Operands operands = operands_of(parameter, name_);
    Tensor* momentum = nullptr;
    bool first = false;
    if (options_.momentum != 0) {
      first = buffer(index, "momentum_buffer", false) == nullptr;
      momentum = buffer(index, "momentum_buffer", true);
    }
    if (operands.value.is_shape_only()) continue;  // estimate mode: state made, no arithmetic
    dispatch_dtype(operands.value.dtype(), [&]<typename T>() {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        const rules::Sgd<T> rule{.lr = static_cast<T>(lr_),
                                 .weight_decay = static_cast<T>(options_.weight_decay),
                                 .momentum = static_cast<T>(options_.momentum),
                                 .dampening_weight = static_cast<T>(1 - options_.dampening),
                                 .nesterov = options_.nesterov,
                                 .maximize = options_.maximize,
                                 .first = first,
                                 .has_weight_decay = options_.weight_decay != 0,
                                 .has_momentum = momentum != nullptr};
        if (operands.value.device().is_cuda()) {
          sgd_update_cuda(rule, operands.value, operands.grad, momentum);
          return;
        }
        T* p = operands.value.data<T>();
        const T* grad = operands.grad.data<T>();
        T* b = momentum ? momentum->data<T>() : nullptr;
        for_chunks(operands.value.numel(), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) rule(p[i], grad[i], b ? b + i : nullptr);
        });
      }
    });
  }
}

// ---- Adam / AdamW ----

Adam::Adam(std::vector<Parameter> parameters, AdamOptions options)
    : Adam(std::move(parameters), options, false, "adam") {}

Adam::Adam(std::vector<Parameter> parameters, AdamOptions options, bool decoupled, std::string name)
    : Optimizer(std::move(parameters), options.lr, std::move(name)),
      options_(options),
      decoupled_(decoupled) {
  if (!options_.weight_decay) options_.weight_decay = decoupled ? 1e-2 : 0.0;
  check_arg(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
            name_, "betas ({}, {}) must be in [0, 1)", options.beta1, options.beta2);
  check_arg(options.eps >= 0 && *options_.weight_decay >= 0, name_,
            "eps {} and weight decay {} must be >= 0", options.eps, *options_.weight_decay);
}

std::vector<std::string> Adam::buffer_names() const {
  if (options_.amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

void Adam::step() {
  trace::Span span("optimizer", name_);
  ++steps_;
  const double bias_correction1 = 1 - std::pow(options_.beta1, static_cast<double>(steps_));
  const double bias_correction2 = 1 - std::pow(options_.beta2, static_cast<double>(steps_));
  const double step_size = lr_ / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  const double weight_decay = *options_.weight_decay;
  for (size_t index = 0; index < parameters_.size(); ++index) {
    const Parameter& parameter = parameters_[index];
    if (!parameter.grad()) continue;
    const Operands operands = operands_of(parameter, name_);
    Tensor* exp_avg = buffer(index, "exp_avg", true);
    Tensor* exp_avg_sq = buffer(index, "exp_avg_sq", true);
    Tensor* max_exp_avg_sq = options_.amsgrad ? buffer(index, "max_exp_avg_sq", true) : nullptr;
    if (operands.value.is_shape_only()) continue;  // estimate mode: state made, no arithmetic
    dispatch_dtype(operands.value.dtype(), [&]<typename T>() {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        const rules::Adam<T> rule{.beta1_weight = static_cast<T>(1 - options_.beta1),
                                  .beta2 = static_cast<T>(options_.beta2),
                                  .one_minus_beta2 = static_cast<T>(1 - options_.beta2),
                                  .decay = static_cast<T>(1 - lr_ * weight_decay),
                                  .weight_decay = static_cast<T>(weight_decay),
                                  .eps = static_cast<T>(options_.eps),
                                  .step_size = static_cast<T>(step_size),
                                  .bias_correction2_sqrt = static_cast<T>(bias_correction2_sqrt),
                                  .decoupled = decoupled_,
                                  .maximize = options_.maximize,
                                  .has_weight_decay = weight_decay != 0};
        if (operands.value.device().is_cuda()) {
          adam_update_cuda(rule, operands.value, operands.grad, *exp_avg, *exp_avg_sq,
                           max_exp_avg_sq);
          return;
        }
        T* p = operands.value.data<T>();
        const T* grad = operands.grad.data<T>();
        T* m = exp_avg->data<T>();
        T* v = exp_avg_sq->data<T>();
        T* v_max = max_exp_avg_sq ? max_exp_avg_sq->data<T>() : nullptr;
        for_chunks(operands.value.numel(), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i)
            rule(p[i], grad[i], m[i], v[i], v_max ? v_max + i : nullptr);
        });
      }
    });
  }
}

AdamW::AdamW(std::vector<Parameter> parameters, AdamOptions options)
    : Adam(std::move(parameters), options, true, "adamw") {}

// ---- schedules ----

double warmup_cosine_lr(int64_t step, double base, int64_t warmup, int64_t total, double min_lr) {
  check_arg(step >= 0 && warmup >= 0 && total >= warmup, "lr schedule",
            "step {}, warmup {}, total {} (expected 0 <= warmup <= total, step >= 0)", step, warmup,
            total);
  if (step < warmup) return base * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (total == warmup || step >= total) return step >= total ? min_lr : base;
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
  return min_lr + (base - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
}

double step_lr(int64_t step, double base, int64_t step_size, double gamma) {
  check_arg(step >= 0 && step_size >= 1, "lr schedule",
            "step {}, step size {} (expected >= 0, >= 1)", step, step_size);
  return base * std::pow(gamma, static_cast<double>(step / step_size));
}

// ---- clipping ----

double clip_grad_norm(const std::vector<Parameter>& parameters, double max_norm) {
  check_arg(std::isfinite(max_norm) && max_norm > 0, "clip_grad_norm", "max norm {} (expected > 0)",
            max_norm);
  double total_squared = 0;
  for (const Parameter& parameter : parameters) {
    if (!parameter.grad()) continue;
    const ShardTensor grad = *parameter.grad();
    // Every element once: this rank's piece summed over the mesh dims that shard it (the
    // replicas along the other dims hold the same values), in rank order.
    std::vector<int> sharding;
    for (int m = 0; m < grad.mesh().ndim(); ++m)
      if (grad.placements()[m].is_shard()) sharding.push_back(m);
    double squares = sum_of_squares(grad.to_local());
    if (!sharding.empty()) {
      auto comm = grad.mesh().sub_comm(sharding);
      std::vector<double> each(comm->size());
      comm->all_gather_v(&squares, 1, each.data(), std::vector<size_t>(comm->size(), 1),
                         DType::f64);
      squares = 0;
      for (double value : each) squares += value;
    }
    const double norm = std::sqrt(squares);
    total_squared += norm * norm;
  }
  const double total = std::sqrt(total_squared);
  const double coefficient = max_norm / (total + 1e-6);
  if (coefficient < 1) {
    for (const Parameter& parameter : parameters) {
      if (!parameter.grad()) continue;
      Parameter target = parameter;
      const ShardTensor grad = *parameter.grad();
      Tensor scaled = grad.to_local().contiguous().clone();
      backend_for(scaled.device())
          .scale(strided_ref(scaled), scaled.dtype(), coefficient,
                 compute_stream_for(scaled.device()));
      target.set_grad(ShardTensor(scaled, grad.mesh(), grad.spec()));
    }
  }
  return total;
}

}  // namespace tessera::optim
