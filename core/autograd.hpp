// Autograd: a small reverse-mode tape over ShardTensors. While a Tape is alive on a thread (one
// per rank), every op applied to inputs that require a gradient is recorded with its backward;
// backward(loss) runs them in reverse. Gradients of leaves come back in the leaf's own layout;
// partial sums (e.g. the gradient of a replicated weight whose activations are sharded) are
// reduced exactly once, when the leaf's gradient is finalized.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <vector>

#include "core/op_registry.hpp"

namespace tessera {

class Tape {
 public:
  /// Starts recording on this thread (restores the previously active tape when destroyed).
  Tape();
  ~Tape();
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;

  /// The tape recording on this thread, or null.
  static Tape* active();
  /// Appends a forward call (called by apply_op and by differentiable redistribute).
  void record(OpRecord record);
  /// Collective: reverse pass from a scalar `loss` (one element), seeded with d(loss) = 1.
  void backward(const ShardTensor& loss);
  /// Collective: reverse pass seeded with d(loss)/d(output) = `output_grad` (any layout of
  /// output's shape): the vector-Jacobian product of everything recorded up to `output`.
  void backward(const ShardTensor& output, const ShardTensor& output_grad);
  /// The gradient of `leaf` in the leaf's layout (nullopt if none reached it).
  std::optional<ShardTensor> grad(const ShardTensor& leaf) const;
  /// Number of recorded calls.
  size_t size() const { return records_.size(); }

 private:
  std::vector<OpRecord> records_;
  std::map<uint64_t, ShardTensor> leaves_;  // inputs requiring grad that no recorded op produced
  std::map<uint64_t, ShardTensor> grads_;   // finalized leaf gradients
  std::set<uint64_t> produced_;             // ids of recorded outputs
  Tape* previous_ = nullptr;
};

/// Collective: x.redistribute(...) recorded on the active tape (its backward moves the
/// gradient back to x's layout).
ShardTensor redistribute_recorded(const ShardTensor& x, const ShardSpec& target);

/// Collective: a + b for two ShardTensors of the same global shape (b is moved to a's layout).
ShardTensor add_same_shape(const ShardTensor& a, const ShardTensor& b);

}  // namespace tessera
