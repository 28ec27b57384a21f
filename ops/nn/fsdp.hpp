// FullyShardedDataParallel: FSDP / ZeRO-3 (and hybrid sharding) over a Sequential model.
//
// Every parameter of the model is sharded over one mesh dim (FsdpOptions::shard_dim, "dp_shard"):
// Shard(0) there (uneven extents where the leading extent does not divide), Replicate on the
// other mesh dims, so each rank stores 1/P of every parameter, and the optimizer, which updates
// local pieces, keeps its state sharded the same way. Each layer of the Sequential with
// parameters is one unit:
//   - forward: the unit's parameters are all-gathered (Comm::start_all_gather_v) into a full
//     replicated copy just before the unit runs and dropped right after it; with prefetch the
//     next unit's gather is started before this unit computes. The unit runs without recording;
//     one record on the tape keeps only its input.
//   - backward: the unit's parameters are gathered again (the previous unit's gather started
//     first), the unit's forward is recomputed on an inner tape from the saved input, and its
//     backward runs there; each gathered parameter's gradient, Partial(sum) over the dims that
//     shard the activations, is reduced straight into the parameter's layout: reduce-scatter
//     over shard_dim, all-reduce over the others (domain dims, and "dp_replicate" for hybrid
//     sharding), in an order that does not depend on the rank, so replicas stay bit-identical.
//     Then the gathered copy and the unit's activations are dropped.
// Layers without parameters (activations, pools) are recorded on the tape as usual. The loss is
// a mean over the global batch, so the summed gradient is the data-parallel average.
//
// named_parameters() and state_dict() have the model's keys ("0.weight", ...) with sharded
// values, so training checkpoints move between FSDP, DDP, one rank and other domain splits. The
// model's layers hold the sharded parameters from then on: run them through this module's
// forward, not the model's own.
//
//   DeviceMesh mesh(comm, {2, 2, 2}, {"dp_replicate", "dp_shard", "rows"});
//   nn::FullyShardedDataParallel fsdp(mesh, model, {.shard_dim = "dp_shard",
//                                                   .batch_dims = {{"dp_replicate"}}});
//   optim::AdamW adam(fsdp.parameters(), {.lr = 1e-3});       // after sharding: sharded state
//   for (...) {
//     adam.zero_grad();
//     { Tape tape; tape.backward(ops::mse_loss(fsdp.forward(x), y)); }
//     adam.step();
//   }
//
// A unit's forward runs twice per step (its recomputation in backward), so units with parameters
// must compute the same function both times: such units holding a Dropout (its call counter) or
// buffers (BatchNorm's running statistics) are refused.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ops/nn/module.hpp"

namespace tessera::nn {

/// Options of FullyShardedDataParallel.
struct FsdpOptions {
  /// The mesh dim that parameters, gradients and optimizer state are sharded over.
  std::string shard_dim = "dp_shard";
  /// The mesh dims that split the batch (tensor dim 0 of the model's input), checked to split it
  /// evenly: nullopt means {shard_dim}; empty checks nothing (e.g. shard_dim splits the domain).
  std::optional<std::vector<std::string>> batch_dims{};
  /// Start the next unit's all-gather before this unit computes (forward and backward).
  bool prefetch = true;
};

/// What an FSDP model did since it was made (this rank).
struct FsdpStats {
  int64_t gathers = 0;              ///< all-gathers of a unit's parameters started
  int64_t bytes_gathered = 0;       ///< their full sizes in bytes
  int64_t gradient_reductions = 0;  ///< parameter gradients reduced into their shards
  int64_t bytes_reduced = 0;        ///< their unreduced local bytes
  double wait_seconds = 0;          ///< time blocked on gathers and gradient reductions
  int64_t max_gathered_bytes = 0;   ///< the most gathered parameter bytes alive at once
};

class FullyShardedDataParallel : public Module {
 public:
  /// Collective over `mesh`: shards every parameter of `model` over options.shard_dim. Every
  /// parameter must be replicated on `mesh`; a shard or batch dim missing from the mesh, or a
  /// parameter on another mesh, raises one error on every rank before anything moves. Make
  /// optimizers after this (over parameters()).
  FullyShardedDataParallel(const DeviceMesh& mesh, std::shared_ptr<Sequential> model,
                           FsdpOptions options = {});
  ~FullyShardedDataParallel() override;

  /// The model's forward with gathered parameters (see above). The input's batch (tensor dim 0)
  /// must be split evenly over the batch dims.
  ShardTensor forward(const ShardTensor& x) override;

  /// Counters since construction.
  FsdpStats stats() const;
  /// Bytes of the largest full parameters of two consecutive units (what is gathered at once,
  /// with prefetch), on this rank.
  int64_t gathered_bytes_bound() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace tessera::nn
