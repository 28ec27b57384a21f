// Autograd: a small reverse-mode tape over ShardTensors. While a Tape is alive on a thread (one
// per rank), every op applied to inputs that require a gradient is recorded with its backward,
// and so is every redistribute of such a tensor; backward(loss) runs them in reverse. Gradients of
// leaves come back in the leaf's own layout; partial sums (e.g. the gradient of a replicated
// weight whose activations are sharded) are reduced exactly once, when the leaf's gradient is
// final: right after the reverse pass has run the earliest recorded call that read the leaf, so
// gradient hooks (Parameter accumulation, data-parallel reducers) run while the rest of the
// backward pass still computes. Each record's saved tensors are released as soon as backward has
// used it, so a step holds its activations once; a tape can run backward once unless
// retain_graph is asked for.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "core/op_registry.hpp"

namespace tessera {

class Tape {
 public:
  /// Starts recording on this thread (restores the previously active tape when destroyed).
  Tape();
  /// Tag of a tape that does not start recording when made.
  struct Idle {};
  /// A tape that records only while a TapeScope of it is alive: schedules that keep several
  /// tapes alive at once and record into each in turn (pipeline micro-batches, whose forwards
  /// and backwards interleave) make their tapes this way, so no tape's lifetime has to nest.
  explicit Tape(Idle);
  ~Tape();
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;

  /// The tape recording on this thread, or null.
  static Tape* active();
  /// Appends a forward call (called by apply_op and by differentiable redistribute).
  void record(OpRecord record);
  /// Collective: reverse pass from a scalar `loss` (one element), seeded with d(loss) = 1. Without
  /// `retain_graph` the records' saved tensors are released as the pass uses them (a second
  /// backward on this tape is then an error).
  void backward(const ShardTensor& loss, bool retain_graph = false);
  /// Collective: reverse pass seeded with d(loss)/d(output) = `output_grad` (any layout of
  /// output's shape): the vector-Jacobian product of everything recorded up to `output`.
  void backward(const ShardTensor& output, const ShardTensor& output_grad,
                bool retain_graph = false);
  /// The gradient of `leaf` in the leaf's layout (nullopt if none reached it).
  std::optional<ShardTensor> grad(const ShardTensor& leaf) const;
  /// Number of recorded calls.
  size_t size() const { return records_.size(); }

 private:
  std::vector<OpRecord> records_;
  std::map<uint64_t, ShardTensor> leaves_;  // inputs requiring grad that no recorded op produced
  std::map<uint64_t, size_t> first_use_;    // leaf id -> index of the first record reading it
  std::map<uint64_t, ShardTensor> grads_;   // finalized leaf gradients
  std::set<uint64_t> produced_;             // ids of recorded outputs
  bool released_ = false;                   // saved tensors released by a backward pass
  bool restores_ = true;                    // made active at construction (not Idle)
  Tape* previous_ = nullptr;
};

/// While alive, `tape` records on this thread; the tape active before is restored when the scope
/// ends. Nests with Tape and NoGrad (NoGrad still turns recording off).
class TapeScope {
 public:
  explicit TapeScope(Tape& tape);
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape* previous_;
};

/// While alive on this thread, nothing is recorded (Tape::active() is null) and results of ops
/// and redistributes do not require gradients: evaluation, metrics, optimizer updates. Nests.
class NoGrad {
 public:
  NoGrad();
  ~NoGrad();
  NoGrad(const NoGrad&) = delete;
  NoGrad& operator=(const NoGrad&) = delete;
};

/// Called with a leaf's gradient (in the leaf's layout) when a backward pass has made it final.
/// Hooks of one leaf run in registration order; leaves in the order their gradients become final
/// (the same on every rank, so hooks may start collectives).
using GradHook = std::function<void(const ShardTensor& grad)>;

/// Keeps a hook registered; unregisters it when destroyed. Movable.
class GradHookHandle {
 public:
  GradHookHandle() = default;
  GradHookHandle(uint64_t leaf, uint64_t token) : leaf_(leaf), token_(token) {}
  ~GradHookHandle();
  GradHookHandle(GradHookHandle&& other) noexcept;
  GradHookHandle& operator=(GradHookHandle&& other) noexcept;
  GradHookHandle(const GradHookHandle&) = delete;
  GradHookHandle& operator=(const GradHookHandle&) = delete;

 private:
  uint64_t leaf_ = 0, token_ = 0;
};

/// Registers `hook` for the leaf whose id is `leaf` (every later backward pass, any tape and
/// thread) while the returned handle lives.
[[nodiscard]] GradHookHandle register_grad_hook(uint64_t leaf, GradHook hook);

/// Takes over the gradient of the leaf whose id is `leaf` (every later backward pass, any tape
/// and thread) while the returned handle lives: the tape hands the leaf's final gradient to `sink`
/// as it stands, Partial sums NOT reduced, instead of reducing it, keeping it (Tape::grad) and
/// running the leaf's hooks. Data-parallel reducers use this to reduce many gradients in one
/// bucketed collective. At most one sink per leaf.
[[nodiscard]] GradHookHandle set_grad_sink(uint64_t leaf, GradHook sink);

/// Records `y = x.redistribute(...)` on the active tape when x requires a gradient (marking y as
/// requiring one); its backward moves the gradient back to x's layout. Called by redistribute.
void record_redistribute(const ShardTensor& x, ShardTensor& y);

/// Collective: a + b for two ShardTensors of the same global shape (b is moved to a's layout).
ShardTensor add_same_shape(const ShardTensor& a, const ShardTensor& b);

}  // namespace tessera
