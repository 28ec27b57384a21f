// Parameter (core/parameter.hpp).
#include "core/parameter.hpp"

#include "core/tensor_arith.hpp"

namespace tessera {

struct Parameter::State {
  State(ShardTensor value, std::string name) : value(std::move(value)), name(std::move(name)) {}
  ShardTensor value;
  std::optional<ShardTensor> compute;  // set_compute_value: what tensor() returns meanwhile
  std::string name;
  std::optional<ShardTensor> grad;
  GradHookHandle hook;
};

Parameter::Parameter(ShardTensor value, std::string name) {
  for (size_t m = 0; m < value.placements().size(); ++m)
    TESSERA_CHECK_ARG(!value.placements()[m].is_partial(), "parameter",
                      "parameter '{}' has the Partial layout {}: a parameter holds its full values",
                      name, value.spec().str());
  value.set_requires_grad(true);
  state_ = std::make_shared<State>(std::move(value), std::move(name));
  hook_value();
}

void Parameter::hook_value() {
  // The tape hands every final gradient of this leaf to the parameter.
  std::weak_ptr<State> weak = state_;
  state_->hook = register_grad_hook(state_->value.id(), [weak](const ShardTensor& grad) {
    if (auto state = weak.lock()) {
      Parameter parameter;
      parameter.state_ = state;
      parameter.accumulate_grad(grad);
    }
  });
}

const ShardTensor& Parameter::tensor() const {
  check_arg(defined(), "parameter", "an undefined parameter has no tensor");
  return state_->compute ? *state_->compute : state_->value;
}

const ShardTensor& Parameter::stored() const {
  check_arg(defined(), "parameter", "an undefined parameter has no tensor");
  return state_->value;
}

void Parameter::reshard(const std::vector<Placement>& placements,
                        const std::vector<std::vector<int64_t>>& extents) {
  check_arg(defined(), "parameter", "an undefined parameter cannot be resharded");
  for (const Placement& placement : placements)
    check_arg(!placement.is_partial(), "parameter",
              "resharding parameter '{}' to a Partial layout: a parameter holds its full values",
              state_->name);
  NoGrad plain;
  // A copy: the old storage goes with the old value (sharding frees the full tensor).
  ShardTensor moved = state_->value.redistribute(placements, extents);
  ShardTensor value(moved.to_local().contiguous().clone(), moved.mesh(), moved.spec());
  value.set_requires_grad(true);
  state_->value = std::move(value);
  state_->grad.reset();
  hook_value();
}

void Parameter::set_compute_value(std::optional<ShardTensor> value) {
  check_arg(defined(), "parameter", "an undefined parameter has no tensor");
  if (value)
    check_arg(value->global_shape() == state_->value.global_shape() &&
                  value->dtype() == state_->value.dtype(),
              "parameter", "compute value {} {} for parameter '{}' of shape {} {}",
              value->global_shape(), dtype_name(value->dtype()), state_->name,
              state_->value.global_shape(), dtype_name(state_->value.dtype()));
  state_->compute = std::move(value);
}

const std::string& Parameter::name() const {
  static const std::string none;
  return defined() ? state_->name : none;
}

std::optional<ShardTensor> Parameter::grad() const {
  return defined() ? state_->grad : std::nullopt;
}

void Parameter::zero_grad() {
  if (defined()) state_->grad.reset();
}

void Parameter::set_grad(std::optional<ShardTensor> grad) {
  check_arg(defined(), "parameter", "an undefined parameter has no gradient");
  if (grad) {
    const ShardTensor& value = state_->value;
    TESSERA_CHECK_ARG(grad->global_shape() == value.global_shape() &&
                          grad->dtype() == value.dtype() && grad->spec() == value.spec(),
                      "parameter", "gradient {} {} for parameter '{}' {} {}", grad->spec().str(),
                      dtype_name(grad->dtype()), state_->name, value.spec().str(),
                      dtype_name(value.dtype()));
  }
  state_->grad = std::move(grad);
}

void Parameter::accumulate_grad(const ShardTensor& grad) {
  check_arg(defined(), "parameter", "an undefined parameter has no gradient");
  const ShardTensor& value = state_->value;
  check_arg(grad.global_shape() == value.global_shape(), "parameter",
            "gradient of global shape {} for parameter '{}' of shape {}", grad.global_shape(),
            state_->name, value.global_shape());
  NoGrad plain;
  const ShardTensor moved = grad.spec() == value.spec() ? grad : grad.redistribute_to(value.spec());
  state_->grad = state_->grad ? add_same_shape(*state_->grad, moved) : moved;
}

void Parameter::assign_local(const Tensor& values) {
  Tensor local = stored().to_local();
  TESSERA_CHECK_ARG(values.shape() == local.shape() && values.dtype() == local.dtype(), "parameter",
                    "assigning {} to parameter '{}' whose local piece is {}", values.str(),
                    state_->name, local.str());
  local.copy_from(values.to(local.device()));
}

}  // namespace tessera
