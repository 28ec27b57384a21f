// Modules (ops/nn/module.hpp).
#include "ops/nn/module.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "ops/cast/cast_op.hpp"

namespace tessera::nn {

ShardTensor Module::forward(const ShardTensor&) {
  throw InvalidArgument("module", "this module has no forward()");
}

void Module::check_new_name(const std::string& name) const {
  check_arg(!name.empty() && name.find('.') == std::string::npos, "module",
            "name '{}' (expected a non-empty name without '.')", name);
  const bool taken = std::any_of(parameters_.begin(), parameters_.end(),
                                 [&](const auto& entry) { return entry.first == name; }) ||
                     std::any_of(buffers_.begin(), buffers_.end(),
                                 [&](const auto& entry) { return entry.first == name; }) ||
                     std::any_of(counters_.begin(), counters_.end(),
                                 [&](const auto& entry) { return entry.first == name; }) ||
                     std::any_of(children_.begin(), children_.end(),
                                 [&](const auto& entry) { return entry.first == name; });
  check_arg(!taken, "module", "name '{}' is registered twice", name);
}

Parameter Module::add_parameter(const std::string& name, ShardTensor value) {
  check_new_name(name);
  Parameter parameter(std::move(value), name);
  parameters_.emplace_back(name, parameter);
  return parameter;
}

void Module::add_buffer(const std::string& name, ShardTensor value) {
  check_new_name(name);
  buffers_.emplace_back(name, std::move(value));
}

size_t Module::buffer_index(const std::string& name) const {
  for (size_t i = 0; i < buffers_.size(); ++i)
    if (buffers_[i].first == name) return i;
  throw InvalidArgument("module", fmt::format("no buffer '{}'", name));
}

const ShardTensor& Module::buffer(const std::string& name) const {
  return buffers_[buffer_index(name)].second;
}

void Module::set_buffer(const std::string& name, ShardTensor value) {
  ShardTensor& target = buffers_[buffer_index(name)].second;
  check_arg(value.global_shape() == target.global_shape() && value.dtype() == target.dtype(),
            "module", "buffer '{}' of global shape {} {} set to {} {}", name, target.global_shape(),
            dtype_name(target.dtype()), value.global_shape(), dtype_name(value.dtype()));
  target = std::move(value);
}

void Module::add_counter(const std::string& name, int64_t value) {
  check_new_name(name);
  counters_.emplace_back(name, value);
}

int64_t& Module::counter(const std::string& name) {
  for (auto& [key, value] : counters_)
    if (key == name) return value;
  throw InvalidArgument("module", fmt::format("no counter '{}'", name));
}

void Module::collect_counters(const std::string& prefix,
                              std::vector<std::pair<std::string, int64_t*>>& out) const {
  for (const auto& [name, value] : counters_)
    out.emplace_back(prefix + name, const_cast<int64_t*>(&value));
  for (const auto& [name, child] : children_) child->collect_counters(prefix + name + ".", out);
}

std::vector<std::pair<std::string, int64_t>> Module::named_counters() const {
  std::vector<std::pair<std::string, int64_t*>> slots;
  collect_counters("", slots);
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& [name, slot] : slots) out.emplace_back(name, *slot);
  return out;
}

void Module::load_counters(const std::map<std::string, int64_t>& values) {
  std::vector<std::pair<std::string, int64_t*>> slots;
  collect_counters("", slots);
  for (const auto& [name, slot] : slots)
    check_arg(values.count(name) == 1, "load_counters", "counter '{}' is missing", name);
  for (const auto& [name, value] : values)
    check_arg(std::any_of(slots.begin(), slots.end(),
                          [&](const auto& slot) { return slot.first == name; }),
              "load_counters", "'{}' is not a counter of the module", name);
  for (const auto& [name, slot] : slots) *slot = values.at(name);
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> module) {
  check_new_name(name);
  check_arg(module != nullptr, "module", "child '{}' is null", name);
  children_.emplace_back(name, std::move(module));
}

void Module::collect(const std::string& prefix,
                     std::vector<std::pair<std::string, Parameter>>& out) const {
  for (const auto& [name, parameter] : parameters_) out.emplace_back(prefix + name, parameter);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", out);
}

void Module::collect_buffers(const std::string& prefix,
                             std::vector<std::pair<std::string, Module*>>& out) const {
  for (const auto& [name, value] : buffers_)
    out.emplace_back(prefix + name, const_cast<Module*>(this));
  for (const auto& [name, child] : children_) child->collect_buffers(prefix + name + ".", out);
}

std::vector<std::pair<std::string, ShardTensor>> Module::named_buffers() const {
  std::vector<std::pair<std::string, Module*>> owners;
  collect_buffers("", owners);
  std::vector<std::pair<std::string, ShardTensor>> out;
  for (const auto& [path, owner] : owners)
    out.emplace_back(path, owner->buffer(path.substr(path.rfind('.') + 1)));
  return out;
}

std::vector<std::pair<std::string, Parameter>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Parameter>> out;
  collect("", out);
  return out;
}

std::vector<Parameter> Module::parameters() const {
  std::vector<Parameter> out;
  for (auto& [name, parameter] : named_parameters()) out.push_back(parameter);
  return out;
}

std::map<std::string, ShardTensor> Module::state_dict() const {
  std::map<std::string, ShardTensor> state;
  for (const auto& [name, parameter] : named_parameters()) state.emplace(name, parameter.tensor());
  for (const auto& [name, value] : named_buffers()) state.emplace(name, value);
  return state;
}

void Module::load_state_dict(const std::map<std::string, ShardTensor>& state) {
  const auto named = named_parameters();
  std::set<std::string> expected;
  for (const auto& [name, parameter] : named) {
    expected.insert(name);
    auto found = state.find(name);
    check_arg(found != state.end(), "load_state_dict", "state has no '{}'", name);
    const ShardTensor& value = parameter.tensor();
    check_arg(found->second.global_shape() == value.global_shape() &&
                  found->second.dtype() == value.dtype(),
              "load_state_dict", "'{}' has global shape {} {}, the parameter {} {}", name,
              found->second.global_shape(), dtype_name(found->second.dtype()), value.global_shape(),
              dtype_name(value.dtype()));
  }
  std::vector<std::pair<std::string, Module*>> buffers;
  collect_buffers("", buffers);
  for (const auto& [name, owner] : buffers) {
    expected.insert(name);
    auto found = state.find(name);
    check_arg(found != state.end(), "load_state_dict", "state has no '{}'", name);
    const ShardTensor& value = owner->buffer(name.substr(name.rfind('.') + 1));
    check_arg(found->second.global_shape() == value.global_shape() &&
                  found->second.dtype() == value.dtype(),
              "load_state_dict", "'{}' has global shape {} {}, the buffer {} {}", name,
              found->second.global_shape(), dtype_name(found->second.dtype()), value.global_shape(),
              dtype_name(value.dtype()));
  }
  for (const auto& [name, value] : state)
    check_arg(expected.count(name) == 1, "load_state_dict",
              "state key '{}' is not a parameter or buffer", name);
  NoGrad no_grad;
  for (const auto& [name, parameter] : named) {
    const ShardTensor& value = parameter.tensor();
    const ShardTensor moved = state.at(name).redistribute(value.placements(), value.spec().extents);
    Parameter target = parameter;
    target.assign_local(moved.to_local());
  }
  for (const auto& [name, owner] : buffers) {
    const std::string local_name = name.substr(name.rfind('.') + 1);
    const ShardTensor& value = owner->buffer(local_name);
    const ShardTensor moved = state.at(name).redistribute(value.placements(), value.spec().extents);
    owner->set_buffer(local_name,
                      ShardTensor(moved.to_local().clone(), value.mesh(), value.spec()));
  }
}

void Module::train(bool on) {
  training_ = on;
  for (const auto& [name, child] : children_) child->train(on);
}

void Module::zero_grad() {
  for (auto& [name, parameter] : named_parameters()) parameter.zero_grad();
}

void Module::set_compute_dtype(std::optional<DType> dtype) {
  compute_dtype_ = dtype;
  for (const auto& [name, child] : children_) child->set_compute_dtype(dtype);
}

ShardTensor Module::compute_value(const Parameter& parameter) const {
  return compute_dtype_ ? ops::cast(parameter.tensor(), *compute_dtype_) : parameter.tensor();
}

std::optional<ShardTensor> Module::compute_optional(const Parameter& parameter) const {
  return parameter.defined() ? std::optional<ShardTensor>(compute_value(parameter)) : std::nullopt;
}

ShardTensor Module::compute_input(const ShardTensor& x) const {
  return compute_dtype_ ? ops::cast(x, *compute_dtype_) : x;
}

Sequential& Sequential::append(std::shared_ptr<Module> module) {
  add_module(std::to_string(layers_.size()), module);
  layers_.push_back(std::move(module));
  return *this;
}

ShardTensor Sequential::forward(const ShardTensor& x) {
  ShardTensor y = x;
  for (const auto& layer : layers_) y = layer->forward(y);
  return y;
}

}  // namespace tessera::nn
