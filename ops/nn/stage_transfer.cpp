// Differentiable stage-to-stage transfers (ops/nn/stage_transfer.hpp).
#include "ops/nn/stage_transfer.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "core/autograd.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/trace.hpp"
#include "ops/nn/stage_boxes.hpp"

namespace tessera::nn {

namespace {

// A layout header is a fixed block of integers: the tensor's rank, shape and dtype, then per mesh
// dim the sender's and the receiver's placement (kind, tensor dim). The sender's extents of its
// Shard dims follow in a second message whose length both ends derive from the header.
constexpr int kMaxDims = 8;
constexpr size_t kHeaderSize = 1 + kMaxDims + 1 + 4 * kMaxDims;

/// Tag offsets of a boundary's four kinds of message. Every transfer (an activation forward, a
/// gradient backward) starts with a status on the sender's twin (the rank of the same index in
/// the other stage): {0} when the data follows, or {1, op length, message length} and the text
/// of the error that stopped the sending stage, in place of the data.
enum Channel : int { activations = 0, gradients = 1, layouts = 2, statuses = 3 };
constexpr size_t kStatusWords = 3;

int64_t encode(const Placement& placement) {
  return placement.is_shard() ? placement.dim : -1;  // Replicate; Partial never moves
}

Placement decode(int64_t code) {
  return code >= 0 ? Placement::shard(static_cast<int>(code)) : Placement::replicate();
}

std::vector<int64_t> header_of(const ShardSpec& from, const ShardSpec& to, DType dtype) {
  std::vector<int64_t> header(kHeaderSize, 0);
  header[0] = static_cast<int64_t>(from.global_shape.size());
  for (size_t d = 0; d < from.global_shape.size(); ++d) header[1 + d] = from.global_shape[d];
  header[1 + kMaxDims] = static_cast<int64_t>(dtype);
  for (size_t m = 0; m < from.placements.size(); ++m) {
    header[2 + kMaxDims + 2 * m] = encode(from.placements[m]);
    header[2 + kMaxDims + 2 * m + 1] = encode(to.placements[m]);
  }
  return header;
}

/// The extents of the Shard dims of `spec`, concatenated in mesh-dim order.
std::vector<int64_t> extents_of(const ShardSpec& spec) {
  std::vector<int64_t> extents;
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_shard())
      extents.insert(extents.end(), spec.extents[m].begin(), spec.extents[m].end());
  return extents;
}

/// How many extents follow a header, for a mesh of `mesh_shape`.
size_t extents_count(const std::vector<int64_t>& header, const std::vector<int>& mesh_shape) {
  size_t count = 0;
  for (size_t m = 0; m < mesh_shape.size(); ++m)
    if (header[2 + kMaxDims + 2 * m] >= 0) count += static_cast<size_t>(mesh_shape[m]);
  return count;
}

/// Placements with Partial ones replaced by Replicate: what a tensor is reduced to before it moves.
std::vector<Placement> without_partial(std::vector<Placement> placements) {
  for (Placement& placement : placements)
    if (placement.is_partial()) placement = Placement::replicate();
  return placements;
}

/// A scalar of `dtype` replicated on `mesh`: the token a send returns.
ShardTensor scalar_on(const DeviceMesh& mesh, DType dtype, Device device) {
  return ShardTensor(
      Tensor::zeros({}, dtype, device), mesh,
      ShardSpec::make({}, mesh.shape(), std::vector<Placement>(mesh.ndim(), Placement::replicate()),
                      {}, "pipeline"));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

struct StageBoundary::State {
  std::shared_ptr<Comm> world;
  std::vector<int> sender_ranks, receiver_ranks;
  int tag = 0;
  int sender_index = -1;    // this rank in the sending stage's mesh, or -1
  int receiver_index = -1;  // this rank in the receiving stage's mesh, or -1
  /// The layouts of the last transfer this rank received (from, to) and their pieces.
  std::optional<std::pair<ShardSpec, ShardSpec>> received_layout;
  std::optional<DType> received_dtype;
  struct Posted {
    std::unique_ptr<P2PBatch> batch;
    std::vector<Tensor> buffers;        // kept alive until the sends complete
    std::vector<int64_t> header_words;  // the same for a layout header
    std::vector<int64_t> extent_words;
    std::vector<int64_t> status_words;
    std::vector<char> text;  // an error's op and message (a vector: its buffer survives moves)
  };
  std::vector<Posted> posted;
  /// Received tensors whose gradient was not sent back yet, with the layouts they came in.
  struct Received {
    ShardSpec from, to;
    DType dtype;
  };
  std::map<uint64_t, Received> unanswered;
  /// Sent activations (by their token's id) whose gradient was not received yet.
  struct Awaited {
    Shape shape;
    std::vector<int64_t> origin;
    DType dtype;
    Device device;
    ShardSpec from, to;
  };
  std::map<uint64_t, Awaited> awaited;
  StageTransferStats stats;

  /// Posts the failure status of a transfer: the error (op, message) in place of the data.
  void post_failure(int peer, const StageError& error) {
    Posted posting;
    posting.status_words = {1, static_cast<int64_t>(error.op.size()),
                            static_cast<int64_t>(error.message.size())};
    // Host memory, not a Tensor: in estimate mode tensors hold no data, but the text must move.
    const std::string text = error.op + error.message;
    posting.text.assign(text.begin(), text.end());
    std::vector<P2POp> ops{P2POp::send(posting.status_words.data(), kStatusWords * sizeof(int64_t),
                                       peer, tag + statuses)};
    if (!posting.text.empty())
      ops.push_back(P2POp::send(posting.text.data(), posting.text.size(), peer, tag + statuses));
    posting.batch = world->start_send_recv(ops);
    posted.push_back(std::move(posting));
  }

  /// Waits for the status of the next transfer from `peer`: nullopt when the data follows, else
  /// the sending stage's error (no data follows).
  std::optional<StageError> receive_status(int peer) {
    std::vector<int64_t> words(kStatusWords);
    const auto start = std::chrono::steady_clock::now();
    const std::vector<P2POp> first{
        P2POp::recv(words.data(), kStatusWords * sizeof(int64_t), peer, tag + statuses)};
    world->send_recv(first);
    std::optional<StageError> error;
    if (words[0] != 0) {
      std::string text(static_cast<size_t>(words[1] + words[2]), ' ');
      if (!text.empty()) {
        const std::vector<P2POp> second{
            P2POp::recv(text.data(), text.size(), peer, tag + statuses)};
        world->send_recv(second);
      }
      error = StageError{text.substr(0, static_cast<size_t>(words[1])),
                         text.substr(static_cast<size_t>(words[1]))};
    }
    stats.wait_seconds += seconds_since(start);
    return error;
  }

  /// Posts the pieces of `local` (laid out by `pieces`' source spec on this rank, whose box
  /// starts at `origin`) that `pieces` send from `my_index` to ranks of `peers`, on `channel`.
  void post_pieces(const Tensor& local, const std::vector<int64_t>& origin,
                   const std::vector<StageBox>& pieces, int my_index, const std::vector<int>& peers,
                   Channel channel, Posted posting = {}) {
    std::vector<P2POp> ops;
    // The status of the transfer goes to the twin, which waits for it before the data.
    posting.status_words.assign(kStatusWords, 0);
    ops.push_back(P2POp::send(posting.status_words.data(), kStatusWords * sizeof(int64_t),
                              peers[my_index], tag + statuses));
    if (!posting.header_words.empty()) {
      ops.push_back(P2POp::send(posting.header_words.data(),
                                posting.header_words.size() * sizeof(int64_t), peers[my_index],
                                tag + layouts));
      if (!posting.extent_words.empty())
        ops.push_back(P2POp::send(posting.extent_words.data(),
                                  posting.extent_words.size() * sizeof(int64_t), peers[my_index],
                                  tag + layouts));
      ++stats.layouts_sent;
    }
    for (const StageBox& piece : pieces) {
      if (piece.sender != my_index) continue;
      Tensor buffer = local.view_box(piece.box.relative_to(origin)).contiguous();
      ops.push_back(
          P2POp::send(buffer.comm_data(), buffer.nbytes(), peers[piece.receiver], tag + channel));
      stats.bytes_sent += static_cast<int64_t>(buffer.nbytes());
      posting.buffers.push_back(std::move(buffer));
    }
    posting.batch = world->start_send_recv(ops);
    posted.push_back(std::move(posting));
  }

  /// Receives the pieces `pieces` send to `my_index` (from ranks of `peers`, on `channel`) into a
  /// new tensor of `shape` whose box starts at `origin`.
  Tensor receive_pieces(const Shape& shape, const std::vector<int64_t>& origin, DType dtype,
                        Device device, const std::vector<StageBox>& pieces, int my_index,
                        const std::vector<int>& peers, Channel channel) {
    Tensor local = Tensor::empty(shape, dtype, device);
    std::vector<P2POp> ops;
    std::vector<std::pair<Box, Tensor>> buffers;
    for (const StageBox& piece : pieces) {
      if (piece.receiver != my_index) continue;
      Tensor buffer = Tensor::empty(piece.box.shape(), dtype, device);
      ops.push_back(
          P2POp::recv(buffer.comm_data(), buffer.nbytes(), peers[piece.sender], tag + channel));
      stats.bytes_received += static_cast<int64_t>(buffer.nbytes());
      buffers.emplace_back(piece.box.relative_to(origin), std::move(buffer));
    }
    if (!ops.empty()) {
      const auto start = std::chrono::steady_clock::now();
      world->send_recv(ops);
      stats.wait_seconds += seconds_since(start);
    }
    for (auto& [box, buffer] : buffers) local.view_box(box).copy_from(buffer);
    return local;
  }

  /// Receiving stage: sends `grad` (x's gradient, any layout of x's shape) back to the senders.
  void send_gradient(ShardTensor grad, const ShardSpec& from, const ShardSpec& to, DType dtype) {
    NoGrad plain;
    if (grad.spec() != to) grad = grad.redistribute(to.placements, to.extents);
    Tensor local = grad.to_local();
    if (local.dtype() != dtype) local = local.to_dtype(dtype);
    post_pieces(local, grad.local_box().lo, stage_boxes(to, from), receiver_index, sender_ranks,
                gradients);
  }
};

StageBoundary::StageBoundary(std::shared_ptr<Comm> world, std::vector<int> sender_ranks,
                             std::vector<int> receiver_ranks, int tag)
    : state_(std::make_shared<State>()) {
  State& state = *state_;
  check_arg(sender_ranks.size() == receiver_ranks.size(), "pipeline",
            "a boundary between stages of {} and {} ranks (the stage meshes must match)",
            sender_ranks.size(), receiver_ranks.size());
  const int me = world->rank();
  for (size_t i = 0; i < sender_ranks.size(); ++i) {
    if (sender_ranks[i] == me) state.sender_index = static_cast<int>(i);
    if (receiver_ranks[i] == me) state.receiver_index = static_cast<int>(i);
  }
  state.world = std::move(world);
  state.sender_ranks = std::move(sender_ranks);
  state.receiver_ranks = std::move(receiver_ranks);
  state.tag = tag;
}

ShardTensor StageBoundary::send(const ShardTensor& y, const std::vector<Placement>& placements,
                                bool with_layout) {
  State& state = *state_;
  check_arg(state.sender_index >= 0, "pipeline", "rank {} sends on a boundary it does not send on",
            state.world->rank());
  check_arg(y.global_shape().size() <= kMaxDims && y.mesh().ndim() <= kMaxDims, "pipeline",
            "an activation of global shape {} on a {}-d mesh (at most {} dims each move between "
            "stages)",
            y.global_shape(), y.mesh().ndim(), kMaxDims);
  trace::Span span("pipeline", "stage send");
  // A Partial activation is reduced on its own stage first: only whole values cross.
  ShardTensor sent = y;
  if (y.spec().has_partial()) {
    const ShardSpec reduced =
        ShardSpec::make(y.global_shape(), y.mesh().shape(), without_partial(y.placements()));
    sent = y.redistribute(reduced.placements, reduced.extents);
  }
  const ShardSpec from = sent.spec();
  const ShardSpec to =
      ShardSpec::make(from.global_shape, from.mesh_shape,
                      placements.empty() ? from.placements : placements, {}, "pipeline");
  State::Posted posting;
  if (with_layout) {
    posting.header_words = header_of(from, to, sent.dtype());
    posting.extent_words = extents_of(from);
  }
  state.post_pieces(sent.to_local(), sent.local_box().lo, stage_boxes(from, to), state.sender_index,
                    state.receiver_ranks, activations, std::move(posting));
  ShardTensor token = scalar_on(sent.mesh(), sent.dtype(), sent.device());
  if (Tape* tape = Tape::active()) {
    // The token's backward: y's gradient comes back the way y went, into y's (reduced) layout.
    auto op = std::make_shared<const OpDef>(OpDef{
        .name = "pipeline_send",
        .summary = "An activation sent to the next pipeline stage (not registered)",
        .backward = [weak = std::weak_ptr<State>(state_), from, to](
                        const OpRecord& record, const std::vector<std::optional<ShardTensor>>&)
            -> std::vector<std::optional<ShardTensor>> {
          auto state = weak.lock();
          check_arg(state != nullptr, "pipeline", "a gradient for a boundary that is gone");
          const ShardTensor& sent = record.inputs[0];
          state->awaited.erase(record.outputs[0].id());  // its gradient transfer is this one
          if (auto error = state->receive_status(state->receiver_ranks[state->sender_index]))
            throw InvalidArgument(error->op, error->message);
          const Tensor local = state->receive_pieces(
              sent.to_local().shape(), sent.local_box().lo, sent.dtype(), sent.device(),
              stage_boxes(to, from), state->sender_index, state->receiver_ranks, gradients);
          return {ShardTensor(local, sent.mesh(), from)};
        }});
    token.set_requires_grad();
    tape->record(OpRecord{op, {}, {}, {sent}, {}, {}, {token}});
  }
  state.awaited.emplace(token.id(), State::Awaited{sent.to_local().shape(), sent.local_box().lo,
                                                   sent.dtype(), sent.device(), from, to});
  return token;
}

ShardTensor StageBoundary::receive(const DeviceMesh& mesh, bool with_layout) {
  State& state = *state_;
  check_arg(state.receiver_index >= 0, "pipeline",
            "rank {} receives on a boundary it does not receive on", state.world->rank());
  trace::Span span("pipeline", "stage receive");
  const int peer = state.sender_ranks[state.receiver_index];
  if (auto error = state.receive_status(peer)) throw InvalidArgument(error->op, error->message);
  if (with_layout) {
    std::vector<int64_t> header(kHeaderSize);
    const auto start = std::chrono::steady_clock::now();
    const std::vector<P2POp> first{
        P2POp::recv(header.data(), header.size() * sizeof(int64_t), peer, state.tag + layouts)};
    state.world->send_recv(first);
    std::vector<int64_t> extents(extents_count(header, mesh.shape()));
    if (!extents.empty()) {
      const std::vector<P2POp> second{
          P2POp::recv(extents.data(), extents.size() * sizeof(int64_t), peer, state.tag + layouts)};
      state.world->send_recv(second);
    }
    state.stats.wait_seconds += seconds_since(start);
    const Shape shape(header.begin() + 1, header.begin() + 1 + header[0]);
    std::vector<Placement> from_placements, to_placements;
    std::vector<std::vector<int64_t>> from_extents(mesh.ndim());
    size_t next = 0;
    for (int m = 0; m < mesh.ndim(); ++m) {
      from_placements.push_back(decode(header[2 + kMaxDims + 2 * m]));
      to_placements.push_back(decode(header[2 + kMaxDims + 2 * m + 1]));
      if (from_placements.back().is_shard()) {
        from_extents[m].assign(extents.begin() + static_cast<int64_t>(next),
                               extents.begin() + static_cast<int64_t>(next + mesh.shape()[m]));
        next += static_cast<size_t>(mesh.shape()[m]);
      }
    }
    state.received_layout.emplace(
        ShardSpec::make(shape, mesh.shape(), from_placements, from_extents, "pipeline"),
        ShardSpec::make(shape, mesh.shape(), to_placements, {}, "pipeline"));
    state.received_dtype = static_cast<DType>(header[1 + kMaxDims]);
  }
  check_arg(state.received_layout.has_value(), "pipeline",
            "the first transfer over a boundary must describe its layout");
  const auto& [from, to] = *state.received_layout;
  const DType dtype = *state.received_dtype;
  const Box box = to.local_box(mesh.coord());
  const Tensor local = state.receive_pieces(box.shape(), box.lo, dtype,
                                            current_rank_context().device(), stage_boxes(from, to),
                                            state.receiver_index, state.sender_ranks, activations);
  ShardTensor x(local, mesh, to);
  x.set_requires_grad();
  state.unanswered.emplace(x.id(), State::Received{from, to, dtype});
  if (Tape* tape = Tape::active()) {
    // x's backward: its gradient goes back to the sending stage, in the layout x came in.
    auto op = std::make_shared<const OpDef>(
        OpDef{.name = "pipeline_receive",
              .summary = "An activation received from the previous pipeline stage (not registered)",
              .backward = [weak = std::weak_ptr<State>(state_), from = from, to = to, dtype](
                              const OpRecord& record,
                              const std::vector<std::optional<ShardTensor>>& grads)
                  -> std::vector<std::optional<ShardTensor>> {
                auto state = weak.lock();
                check_arg(state != nullptr, "pipeline", "a gradient for a boundary that is gone");
                if (grads[0] && state->unanswered.erase(record.outputs[0].id()))
                  state->send_gradient(*grads[0], from, to, dtype);
                return {};
              }});
    tape->record(OpRecord{op, {}, {}, {}, {}, {}, {x}});
  }
  return x;
}

void StageBoundary::finish_backward(const ShardTensor& x) {
  State& state = *state_;
  auto it = state.unanswered.find(x.id());
  if (it == state.unanswered.end()) return;
  const State::Received received = it->second;
  state.unanswered.erase(it);
  Tensor zeros = Tensor::zeros(x.to_local().shape(), x.dtype(), x.device());
  state.send_gradient(ShardTensor(zeros, x.mesh(), x.spec()), received.from, received.to,
                      received.dtype);
}

void StageBoundary::send_failure(const StageError& error) {
  State& state = *state_;
  state.post_failure(state.receiver_ranks[state.sender_index], error);
}

void StageBoundary::answer_failure(const std::optional<ShardTensor>& x, const StageError& error) {
  State& state = *state_;
  if (x && state.unanswered.erase(x->id()) == 0) return;  // its gradient went back already
  state.post_failure(state.sender_ranks[state.receiver_index], error);
}

void StageBoundary::discard_gradient(const std::optional<ShardTensor>& token) {
  State& state = *state_;
  std::optional<State::Awaited> awaited;
  if (token) {
    auto it = state.awaited.find(token->id());
    if (it == state.awaited.end()) return;  // received already
    awaited = it->second;
    state.awaited.erase(it);
  }
  if (state.receive_status(state.receiver_ranks[state.sender_index]) || !awaited) return;
  state.receive_pieces(awaited->shape, awaited->origin, awaited->dtype, awaited->device,
                       stage_boxes(awaited->to, awaited->from), state.sender_index,
                       state.receiver_ranks, gradients);
}

void StageBoundary::wait_sends() {
  State& state = *state_;
  for (State::Posted& posting : state.posted) posting.batch->wait();
  state.posted.clear();
}

StageTransferStats StageBoundary::stats() const {
  return state_->stats;
}

}  // namespace tessera::nn
