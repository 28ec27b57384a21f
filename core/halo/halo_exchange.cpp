// Halo exchange (see halo_exchange.hpp). One message per peer carries all of that peer's
// boxes packed back to back, in the plan's order on both sides. Everything stays on the owned
// piece's device: message buffers, packing and unpacking go through the device's backend on
// the rank's compute stream, and Comm orders its copies after them (core/comm/comm.hpp).
#include "core/halo/halo_exchange.hpp"

#include <algorithm>
#include <map>

#include "core/tensor_arith.hpp"
#include "core/trace.hpp"

namespace tessera {

namespace {

/// Elements of every transfer, grouped per peer: (peer, [transfer indices], total elements).
struct PeerMessage {
  int peer;
  std::vector<size_t> transfers;
  int64_t elements = 0;
};

std::vector<PeerMessage> group_by_peer(const std::vector<HaloTransfer>& transfers) {
  std::vector<PeerMessage> messages;
  for (size_t i = 0; i < transfers.size(); ++i) {
    if (messages.empty() || messages.back().peer != transfers[i].peer)
      messages.push_back({transfers[i].peer, {}, 0});
    messages.back().transfers.push_back(i);
    messages.back().elements += transfers[i].owned_box.volume();
  }
  return messages;
}

/// A message buffer of `elements` elements on `like`'s device.
Tensor message_buffer(int64_t elements, const Tensor& like) {
  return Tensor::empty({elements}, like.dtype(), like.device());
}

/// The `box`-shaped piece of a message buffer starting at element `offset` (a view).
Tensor piece_of(const Tensor& buffer, int64_t offset, const Box& box) {
  return buffer.slice(0, offset, offset + box.volume()).reshape(box.shape());
}

}  // namespace

struct HaloExchange::InFlight {
  const HaloPlan* plan;
  std::vector<Tensor> send_buffers;
  std::vector<Tensor> recv_buffers;
  std::vector<PeerMessage> incoming;
  std::unique_ptr<P2PBatch> batch;
};

HaloExchange::HaloExchange(HaloExchange&&) noexcept = default;
HaloExchange& HaloExchange::operator=(HaloExchange&&) noexcept = default;
HaloExchange::~HaloExchange() = default;

namespace {

/// True when the haloed tensor of `plan` is exactly this rank's owned piece: no message, no
/// zero box, one self copy of the whole piece.
bool needs_no_halo(const HaloPlan& plan) {
  if (!plan.sends().empty() || !plan.recvs().empty() || !plan.zero_boxes().empty() ||
      plan.self_copies().size() != 1)
    return false;
  const HaloTransfer& copy = plan.self_copies().front();
  const Shape haloed = plan.haloed_shape();
  return copy.haloed_box == Box::of_shape(haloed) && copy.owned_box == Box::of_shape(haloed) &&
         plan.spec().local_box_of_rank(plan.rank()).shape() == haloed;
}

}  // namespace

/// Posts the exchange of `plan` reading the owned piece from `source` into `haloed`; with
/// `skip_interior` the copy of the whole owned piece into the interior is skipped (`source` is
/// the interior of `haloed` itself, or the kernel reads it where it lies).
/// Records on `span` the bytes it copies (packing, self copies; zero fills as half a copy's
/// traffic) and their contiguous runs.
HaloExchange start_exchange(const HaloPlan& plan, const Tensor& source, Tensor haloed,
                            bool skip_interior, Comm& comm, int tag, trace::Span& span) {
  const size_t element = source.element_size();
  HaloExchange exchange;
  exchange.in_flight_ = std::make_unique<HaloExchange::InFlight>();
  auto& state = *exchange.in_flight_;
  state.plan = &plan;
  exchange.haloed_ = std::move(haloed);

  std::vector<P2POp> ops;
  state.incoming = group_by_peer(plan.recvs());
  for (const PeerMessage& message : state.incoming) {
    state.recv_buffers.push_back(message_buffer(message.elements, source));
    ops.push_back(P2POp::recv(state.recv_buffers.back().comm_data(), message.elements * element,
                              message.peer, tag));
  }
  trace::CopyTally copies(span);
  for (const PeerMessage& message : group_by_peer(plan.sends())) {
    Tensor buffer = message_buffer(message.elements, source);
    for (size_t index : message.transfers)
      copies.copy(source.view_box(plan.sends()[index].owned_box));
    if (!buffer.is_shape_only()) {  // estimate mode sends the message without packing it
      auto* out = static_cast<char*>(buffer.raw_data());
      for (size_t index : message.transfers) {
        const Box& box = plan.sends()[index].owned_box;
        source.pack_box(box, out);
        out += static_cast<size_t>(box.volume()) * element;
      }
    }
    ops.push_back(P2POp::send(buffer.comm_data(), message.elements * element, message.peer, tag));
    state.send_buffers.push_back(std::move(buffer));
  }
  state.batch = comm.start_send_recv(ops);

  // While messages travel: interior, periodic self-wraps and zero slabs.
  const Box interior = plan.interior_box();
  const Box whole = Box::of_shape(source.shape());
  for (const HaloTransfer& copy : plan.self_copies()) {
    if (skip_interior && copy.owned_box == whole && copy.haloed_box == interior) {
      exchange.interior_unfilled_ = true;
      continue;
    }
    Tensor target = exchange.haloed_.view_box(copy.haloed_box);
    const Tensor from = source.view_box(copy.owned_box);
    copies.copy(target, &from);
    target.copy_from(from);
  }
  for (const Box& box : plan.zero_boxes()) {
    Tensor target = exchange.haloed_.view_box(box);
    copies.fill(target);
    target.fill(0);
  }
  copies.record(span);
  return exchange;
}

/// halo_begin and halo_begin_around: a new haloed tensor, its interior copied or left.
HaloExchange begin_from_owned(const HaloPlan& plan, const Tensor& owned, Comm& comm, int tag,
                              bool skip_interior) {
  trace::Span span("halo", "halo_begin");
  const Box owned_global = plan.spec().local_box_of_rank(plan.rank());
  check_arg(owned.shape() == owned_global.shape(), "halo",
            "owned piece of shape {} on rank {}, the layout says {}", owned.shape(), plan.rank(),
            owned_global.shape());
  if (needs_no_halo(plan)) {  // the haloed tensor is the owned piece: nothing to copy or send
    HaloExchange exchange;
    exchange.haloed_ = owned;
    return exchange;
  }
  return start_exchange(plan, owned,
                        Tensor::empty(plan.haloed_shape(), owned.dtype(), owned.device()),
                        skip_interior, comm, tag, span);
}

HaloExchange halo_begin(const HaloPlan& plan, const Tensor& owned, Comm& comm, int tag) {
  return begin_from_owned(plan, owned, comm, tag, /*skip_interior=*/false);
}

HaloExchange halo_begin_around(const HaloPlan& plan, const Tensor& owned, Comm& comm, int tag) {
  return begin_from_owned(plan, owned, comm, tag, /*skip_interior=*/true);
}

HaloExchange halo_begin_in_place(const HaloPlan& plan, const Tensor& haloed, Comm& comm, int tag) {
  trace::Span span("halo", "halo_begin");
  check_arg(haloed.shape() == plan.haloed_shape(), "halo",
            "haloed tensor of shape {} on rank {}, the plan says {}", haloed.shape(), plan.rank(),
            plan.haloed_shape());
  HaloExchange exchange = start_exchange(plan, haloed.view_box(plan.interior_box()), haloed,
                                         /*skip_interior=*/true, comm, tag, span);
  exchange.interior_unfilled_ = false;  // the interior already holds the owned piece
  return exchange;
}

Tensor HaloExchange::finish() {
  if (!in_flight_) return haloed_;
  trace::Span span("halo", "halo_end");
  auto& state = *in_flight_;
  state.batch->wait();
  trace::CopyTally copies(span);
  for (size_t m = 0; m < state.incoming.size(); ++m) {
    int64_t offset = 0;
    for (size_t index : state.incoming[m].transfers) {
      const Box& box = state.plan->recvs()[index].haloed_box;
      Tensor target = haloed_.view_box(box);
      copies.copy(target);
      target.copy_from(piece_of(state.recv_buffers[m], offset, box));
      offset += box.volume();
    }
  }
  copies.record(span);
  in_flight_.reset();
  return haloed_;
}

Tensor halo_end(HaloExchange& exchange) {
  return exchange.finish();
}

Tensor halo_adjoint(const HaloPlan& plan, const Tensor& haloed_grad, Comm& comm, int tag) {
  trace::Span span("halo", "halo_adjoint");
  check_arg(haloed_grad.shape() == plan.haloed_shape(), "halo",
            "haloed gradient of shape {} on rank {}, the plan says {}", haloed_grad.shape(),
            plan.rank(), plan.haloed_shape());
  if (needs_no_halo(plan)) return haloed_grad;  // every cell is owned here, once
  const Tensor& grad = haloed_grad;
  const size_t element = grad.element_size();
  const Box owned_global = plan.spec().local_box_of_rank(plan.rank());
  // The self copy of the whole owned piece (the interior of the haloed tensor, present whenever
  // the piece is not empty) is the first contribution to every element: copied, not added to
  // zeros. The other contributions (wraps, halos from peers) are added to it.
  const Box whole = Box::of_shape(owned_global.shape());
  const auto& self_copies = plan.self_copies();
  const auto interior =
      std::find_if(self_copies.begin(), self_copies.end(),
                   [&](const HaloTransfer& copy) { return copy.owned_box == whole; });
  Tensor owned_grad = interior == self_copies.end()
                          ? Tensor::zeros(owned_global.shape(), grad.dtype(), grad.device())
                          : grad.view_box(interior->haloed_box).clone();
  // Reverse roles: what was received goes back to its owner; what was sent comes back.
  std::vector<PeerMessage> outgoing = group_by_peer(plan.recvs());
  std::vector<PeerMessage> incoming = group_by_peer(plan.sends());
  std::vector<Tensor> send_buffers, recv_buffers;
  std::vector<P2POp> ops;
  for (const PeerMessage& message : incoming) {
    recv_buffers.push_back(message_buffer(message.elements, grad));
    ops.push_back(P2POp::recv(recv_buffers.back().comm_data(), message.elements * element,
                              message.peer, tag));
  }
  for (const PeerMessage& message : outgoing) {
    Tensor buffer = message_buffer(message.elements, grad);
    if (!buffer.is_shape_only()) {  // estimate mode sends the message without packing it
      auto* out = static_cast<char*>(buffer.raw_data());
      for (size_t index : message.transfers) {
        const Box& box = plan.recvs()[index].haloed_box;
        grad.pack_box(box, out);
        out += static_cast<size_t>(box.volume()) * element;
      }
    }
    ops.push_back(P2POp::send(buffer.comm_data(), message.elements * element, message.peer, tag));
    send_buffers.push_back(std::move(buffer));
  }
  auto batch = comm.start_send_recv(ops);
  for (auto copy = self_copies.begin(); copy != self_copies.end(); ++copy)
    if (copy != interior)
      add_into(owned_grad.view_box(copy->owned_box), grad.view_box(copy->haloed_box));
  batch->wait();
  for (size_t m = 0; m < incoming.size(); ++m) {
    int64_t offset = 0;
    for (size_t index : incoming[m].transfers) {
      const Box& box = plan.sends()[index].owned_box;
      add_into(owned_grad.view_box(box), piece_of(recv_buffers[m], offset, box));
      offset += box.volume();
    }
  }
  return owned_grad;
}

}  // namespace tessera
