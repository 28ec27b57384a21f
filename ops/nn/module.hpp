// Modules: the C++ way to write a sharded model. A Module owns Parameters and child Modules under
// names; parameters()/named_parameters() walk them in registration order with dotted paths
// ("encoder.conv1.weight"), state_dict()/load_state_dict() save and restore them and the modules'
// buffers (state that is not trained, such as BatchNorm's running statistics; any layout in, the
// module's layout kept), train()/eval() set the mode of the whole tree. Layers (ops/nn/
// layers.hpp) are Modules over the sharded ops, so a model written with them runs on any mesh.
//
//   struct Net : nn::Module {
//     std::shared_ptr<nn::Conv> conv1, conv2;
//     Net(const DeviceMesh& mesh, uint64_t seed) {
//       conv1 = add_module("conv1", std::make_shared<nn::Conv>(mesh, 2, 8, 3, seed));
//       conv2 = add_module("conv2", std::make_shared<nn::Conv>(mesh, 8, 2, 3, seed + 1));
//     }
//     ShardTensor forward(const ShardTensor& x) override {
//       return conv2->forward(ops::gelu(conv1->forward(x)));
//     }
//   };
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/parameter.hpp"

namespace tessera::nn {

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// The module's computation (modules without one, like containers of parameters, throw).
  virtual ShardTensor forward(const ShardTensor& x);

  /// Every parameter of the tree, depth first in registration order.
  std::vector<Parameter> parameters() const;
  /// The same with dotted paths.
  std::vector<std::pair<std::string, Parameter>> named_parameters() const;
  /// The direct children with their names, in registration order.
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const {
    return children_;
  }
  /// Every buffer of the tree with its dotted path, depth first in registration order.
  std::vector<std::pair<std::string, ShardTensor>> named_buffers() const;
  /// Every counter of the tree (integer state such as Dropout's call count, which picks its next
  /// mask) with its dotted path, depth first in registration order. Training checkpoints save
  /// them, so a resumed run draws the same masks.
  std::vector<std::pair<std::string, int64_t>> named_counters() const;
  /// Sets the counters from `values` (every counter of the tree, no other key: else one error
  /// naming the key, before any counter is set). Counters are the same on every rank, so this is
  /// local.
  void load_counters(const std::map<std::string, int64_t>& values);
  /// Values of every parameter (sharing storage with the parameters) and buffer by dotted path.
  std::map<std::string, ShardTensor> state_dict() const;
  /// Collective: copies `state` into the parameters and buffers (each value any layout of the
  /// parameter's or buffer's global shape and dtype, moved to its layout). A missing or unknown
  /// key or a shape or dtype mismatch raises one error naming the key, before any value is
  /// written.
  void load_state_dict(const std::map<std::string, ShardTensor>& state);
  /// Sets training mode on the whole tree (eval: train(false)).
  void train(bool on = true);
  void eval() { train(false); }
  bool training() const { return training_; }
  /// Drops every parameter's gradient.
  void zero_grad();
  /// Sets the dtype the layers of the whole tree compute in (mixed precision: parameters cast to
  /// it where used, inputs cast to it; ops/nn/mixed_precision.hpp); nullopt: the parameters' own.
  void set_compute_dtype(std::optional<DType> dtype);
  std::optional<DType> compute_dtype() const { return compute_dtype_; }

 protected:
  /// Registers a parameter under `name` (unique among this module's parameters and children).
  Parameter add_parameter(const std::string& name, ShardTensor value);
  /// Registers a buffer (state saved with the parameters but not trained) under `name`.
  void add_buffer(const std::string& name, ShardTensor value);
  /// The buffer called `name`.
  const ShardTensor& buffer(const std::string& name) const;
  /// Replaces the value of buffer `name` (same global shape and dtype).
  void set_buffer(const std::string& name, ShardTensor value);
  /// `parameter` as the forward uses it: cast to the compute dtype when one is set (the gradient
  /// comes back to the parameter in its own dtype), the parameter's tensor otherwise.
  ShardTensor compute_value(const Parameter& parameter) const;
  /// The same for an optional parameter (nullopt when undefined).
  std::optional<ShardTensor> compute_optional(const Parameter& parameter) const;
  /// `x` cast to the compute dtype when one is set (activations flow in it), x otherwise.
  ShardTensor compute_input(const ShardTensor& x) const;
  /// Registers an integer counter under `name` with its initial value.
  void add_counter(const std::string& name, int64_t value);
  /// The counter called `name`, to read or advance.
  int64_t& counter(const std::string& name);
  /// Registers a child module under `name`; returns it.
  template <typename M>
  std::shared_ptr<M> add_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> module);
  void check_new_name(const std::string& name) const;
  void collect(const std::string& prefix,
               std::vector<std::pair<std::string, Parameter>>& out) const;
  void collect_buffers(const std::string& prefix,
                       std::vector<std::pair<std::string, Module*>>& out) const;
  void collect_counters(const std::string& prefix,
                        std::vector<std::pair<std::string, int64_t*>>& out) const;
  size_t buffer_index(const std::string& name) const;

  std::vector<std::pair<std::string, Parameter>> parameters_;
  std::vector<std::pair<std::string, ShardTensor>> buffers_;
  std::vector<std::pair<std::string, int64_t>> counters_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
  std::optional<DType> compute_dtype_;
};

/// Runs its children in order.
class Sequential : public Module {
 public:
  Sequential() = default;
  /// Appends `module` under the name "<index>" (as torch.nn.Sequential does).
  Sequential& append(std::shared_ptr<Module> module);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  std::vector<std::shared_ptr<Module>> layers_;
};

}  // namespace tessera::nn
