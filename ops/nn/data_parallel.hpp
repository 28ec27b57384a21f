// GradReducer: data parallelism's gradient reduction, bucketed and overlapped with backward.
//
// With the batch sharded over a mesh dim ("dp") and the domain over others, every op already
// returns the weight gradients as Partial(sum) over the mesh dims that shard its activations
// (the loss is a mean over the global batch, so nothing needs averaging). Without a reducer the
// tape reduces each parameter's gradient on its own, blocking, as it becomes final. A reducer
// takes those gradients over (set_grad_sink): it packs them into buckets (bucket_bytes, default
// 25 MiB, in the reverse of the parameters' order: roughly the order backward finalizes them)
// and starts one all-reduce per bucket the moment its last gradient is final, so the reduction
// travels while backward computes the earlier layers. finish() waits and adds the reduced
// gradients to the parameters. Every replica receives the same reduced bits (one collective
// result, broadcast), so replicated parameters stay bit-identical for the whole run.
//
//   nn::GradReducer reducer(model.parameters());
//   for (...) {
//     optimizer.zero_grad();
//     { Tape tape; tape.backward(ops::mse_loss(model.forward(x), y)); }
//     reducer.finish();
//     optimizer.step();
//   }
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/parameter.hpp"

namespace tessera::nn {

/// Options of a GradReducer.
struct ReducerOptions {
  /// Largest bucket in bytes (a parameter larger than this gets a bucket of its own).
  size_t bucket_bytes = size_t{25} << 20;
  /// false: no bucket starts before finish() (every reduction exposed; for measurement).
  bool overlap = true;
};

/// What a reducer did since it was made.
struct ReducerStats {
  int64_t collectives = 0;      ///< all-reduces started
  int64_t bytes_reduced = 0;    ///< their bytes on this rank
  int64_t backward_passes = 0;  ///< finish() calls that reduced something
};

class GradReducer {
 public:
  /// Takes over the gradients of `parameters` (each may belong to one reducer at a time) until
  /// destroyed.
  explicit GradReducer(std::vector<Parameter> parameters, ReducerOptions options = {});
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  /// Collective: starts the buckets that are not started yet (those with parameters that got no
  /// gradient), waits for every reduction of the backward passes since the last finish(), and
  /// adds each reduced gradient to its parameter's grad(). Call after backward, before step().
  /// Does nothing while sync is off.
  void finish();

  /// While false, backward passes only sum the gradients locally (gradient accumulation over
  /// micro-batches without communication); the first backward after it is set true again reduces
  /// the whole sum once. Default true.
  void set_sync(bool sync);

  /// Counters since construction.
  ReducerStats stats() const;

  /// The buckets: parameter indices (into the constructor's list) per bucket, in launch order.
  std::vector<std::vector<size_t>> buckets() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace tessera::nn
