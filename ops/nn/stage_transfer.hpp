// Differentiable send and receive of a ShardTensor between two pipeline stages. Stage s holds an
// activation on its mesh (the slice of ranks at its pp coordinate) in any layout; stage s + 1
// wants it on its own mesh in the layout it names. The pieces move point to point between the two
// slices (ops/nn/stage_boxes.hpp: each receiving rank gets exactly its box), and both ends are
// recorded on the active tape like any op:
//   - send(y) posts the sends and returns a scalar token; the token's backward receives y's
//     gradient from stage s + 1 (in the layout y was sent in) and hands it on to y's producers.
//   - receive() waits for the pieces and returns x, which requires a gradient; x's backward moves
//     the gradient to x's layout on stage s + 1 and sends it back the same way.
// Sends never block (posted, completed by wait_sends()), so a schedule only waits where it needs
// data. With `with_layout` the sender first sends the tensor's global shape, dtype and both
// layouts (a few integers, on a tag of their own); the receiver keeps them for the transfers that
// follow without, so a pipeline describes the layout once per step and the transfers of its
// micro-batches move only data.
//
// Errors: every transfer starts with a status message, so a stage that fails (an op's error, a
// bad loss) tells its neighbours instead of leaving them waiting: it sends its error in place of
// each activation and gradient it owes (send_failure, answer_failure), still takes what it is
// sent (discard_gradient, receive), and a receive or a gradient that brings an error throws it.
// Every stage thus learns the error within the step (ops/nn/pipeline.cpp agrees on it at the end).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::nn {

/// What one end of a boundary moved (this rank).
struct StageTransferStats {
  int64_t bytes_sent = 0;      ///< activation and gradient bytes sent (not the layout headers)
  int64_t bytes_received = 0;  ///< activation and gradient bytes received
  int64_t layouts_sent = 0;    ///< layout headers sent
  double wait_seconds = 0;     ///< time blocked waiting for an activation or a gradient
};

/// The error that stopped a stage: what travels in place of its data.
struct StageError {
  std::string op, message;
};

/// The boundary between two stages as one of its ranks sees it (both ends make the same one).
class StageBoundary {
 public:
  /// `world`: the communicator of the whole mesh; `sender_ranks[i]` (`receiver_ranks[i]`): the
  /// world rank of rank i of the sending (receiving) stage's mesh, meshes of the same shape;
  /// `tag`: the first of the message tags the boundary uses (activations, gradients,
  /// layouts, statuses: four), distinct from every other boundary's between the same ranks.
  StageBoundary(std::shared_ptr<Comm> world, std::vector<int> sender_ranks,
                std::vector<int> receiver_ranks, int tag);

  /// Sending stage, collective over y's mesh: posts y's pieces to the receiving stage, laid out
  /// there as `placements` (one per mesh dim, not Partial; empty: y's placements) with the default
  /// extents. A Partial y is reduced on its mesh first (a recorded redistribute). Returns a scalar
  /// token; a backward pass from it (Tape::backward(token)) receives y's gradient.
  ShardTensor send(const ShardTensor& y, const std::vector<Placement>& placements,
                   bool with_layout);

  /// Receiving stage, collective over `mesh` (this rank's stage mesh): waits for this rank's box
  /// and returns the tensor, requiring a gradient. Without `with_layout` the layout of the last
  /// transfer is expected again.
  ShardTensor receive(const DeviceMesh& mesh, bool with_layout);

  /// Receiving stage, after the backward pass of the micro-batch that received `x`: when no
  /// gradient reached x (its stage ignored it), sends zeros instead, since the sender waits for
  /// one.
  void finish_backward(const ShardTensor& x);

  /// Sending stage, in place of send() when the stage failed: the receivers' receive() throws
  /// `error`.
  void send_failure(const StageError& error);

  /// Receiving stage, in place of the backward of the micro-batch that received `x` (nullopt:
  /// its receive brought an error) when the stage failed: unless x's gradient went back already,
  /// sends `error` in its place.
  void answer_failure(const std::optional<ShardTensor>& x, const StageError& error);

  /// Sending stage, in place of the backward of a micro-batch whose send returned `token`
  /// (nullopt: send_failure went instead) when the stage failed: takes the gradient transfer
  /// the receivers owe (data or error) and drops it, unless it was received already.
  void discard_gradient(const std::optional<ShardTensor>& token);

  /// Completes every posted send (their buffers live until then).
  void wait_sends();

  /// Counters since construction.
  StageTransferStats stats() const;

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the records' backward functions
};

}  // namespace tessera::nn
