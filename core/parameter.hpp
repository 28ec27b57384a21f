// Parameter: a trainable ShardTensor with a stable identity. Ops take parameter.tensor() (or the
// Parameter itself, which converts); every backward pass that reaches it adds its gradient, in the
// parameter's own layout, to parameter.grad() the moment that gradient is final (so gradient
// accumulation over micro-batches is a loop of backward calls, and reducers hooked on the
// gradient overlap the rest of backward). Optimizers update the values in place (assign_local):
// the identity, layout and storage stay, so every copy of the tensor sees the new values.
//
//   Parameter w(ShardTensor::distribute(init, mesh, {Placement::replicate()}), "conv1.weight");
//   { Tape tape; tape.backward(ops::mse_loss(ops::conv(x, w, b, same), target)); }
//   w.grad();  // Replicate, like w
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/autograd.hpp"
#include "core/shard_tensor.hpp"

namespace tessera {

class Parameter {
 public:
  /// An undefined parameter (defined() is false).
  Parameter() = default;
  /// A parameter holding `value` (marked as requiring gradients). Partial layouts are refused:
  /// a parameter holds its full values.
  explicit Parameter(ShardTensor value, std::string name = {});

  /// True for a parameter made from a value.
  bool defined() const { return state_ != nullptr; }
  /// The tensor ops take; the same id for the parameter's whole life.
  const ShardTensor& tensor() const;
  operator const ShardTensor&() const { return tensor(); }
  /// The name given at construction (modules set dotted paths like "encoder.conv1.weight").
  const std::string& name() const;
  /// The gradient accumulated since the last zero_grad, in the parameter's layout (nullopt when no
  /// backward reached the parameter since).
  std::optional<ShardTensor> grad() const;
  /// Drops the gradient (the next backward starts a new one).
  void zero_grad();
  /// Replaces the gradient (e.g. after a reducer averaged it); nullopt drops it. The gradient must
  /// have the parameter's global shape, dtype and layout.
  void set_grad(std::optional<ShardTensor> grad);
  /// Adds `grad` (any layout of the parameter's shape; moved to the parameter's layout) to the
  /// gradient. Called by the tape when a backward pass finalizes the parameter's gradient.
  void accumulate_grad(const ShardTensor& grad);
  /// Writes `values` (this rank's piece: same shape and dtype as tensor().to_local(), any
  /// device) into the parameter's storage in place.
  void assign_local(const Tensor& values);

  /// Collective: moves the stored value to another layout on its mesh (FSDP shards replicated
  /// parameters this way), keeping the name; the gradient is dropped and the tensor gets a new id
  /// (hooks registered on the old id stay there), so reshard before making optimizers or reducers
  /// over the parameter.
  void reshard(const std::vector<Placement>& placements,
               const std::vector<std::vector<int64_t>>& extents = {});
  /// While set, tensor() returns `value` (same global shape and dtype, any layout) instead of the
  /// stored value: FSDP hands a layer's forward the gathered copy this way. nullopt restores the
  /// stored value.
  void set_compute_value(std::optional<ShardTensor> value);
  /// The stored value, whatever set_compute_value holds.
  const ShardTensor& stored() const;

 private:
  void hook_value();

  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace tessera
