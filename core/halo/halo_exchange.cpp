// Halo exchange (see halo_exchange.hpp). One message per peer carries all of that peer's
// boxes packed back to back, in the plan's order on both sides.
#include "core/halo/halo_exchange.hpp"

#include <map>

#include "core/tensor_arith.hpp"

namespace tessera {

namespace {

/// Bytes of every transfer, grouped per peer: (peer, [transfer indices], total bytes).
struct PeerMessage {
  int peer;
  std::vector<size_t> transfers;
  size_t bytes = 0;
};

std::vector<PeerMessage> group_by_peer(const std::vector<HaloTransfer>& transfers, size_t element) {
  std::vector<PeerMessage> messages;
  for (size_t i = 0; i < transfers.size(); ++i) {
    if (messages.empty() || messages.back().peer != transfers[i].peer)
      messages.push_back({transfers[i].peer, {}, 0});
    messages.back().transfers.push_back(i);
    messages.back().bytes += static_cast<size_t>(transfers[i].owned_box.volume()) * element;
  }
  return messages;
}

Tensor byte_buffer(size_t bytes) {
  return Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8);
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

HaloExchange halo_begin(const HaloPlan& plan, const Tensor& owned, Comm& comm, int tag) {
  const Box owned_global = plan.spec().local_box_of_rank(plan.rank());
  check_arg(owned.shape() == owned_global.shape(), "halo",
            "owned piece of shape {} on rank {}, the layout says {}", owned.shape(), plan.rank(),
            owned_global.shape());
  const size_t element = owned.element_size();
  HaloExchange exchange;
  exchange.in_flight_ = std::make_unique<HaloExchange::InFlight>();
  auto& state = *exchange.in_flight_;
  state.plan = &plan;
  const Tensor source = owned.to(Device::cpu());
  exchange.haloed_ = Tensor::empty(plan.haloed_shape(), owned.dtype());

  std::vector<P2POp> ops;
  state.incoming = group_by_peer(plan.recvs(), element);
  for (const PeerMessage& message : state.incoming) {
    state.recv_buffers.push_back(byte_buffer(message.bytes));
    ops.push_back(
        P2POp::recv(state.recv_buffers.back().raw_data(), message.bytes, message.peer, tag));
  }
  for (const PeerMessage& message : group_by_peer(plan.sends(), element)) {
    Tensor buffer = byte_buffer(message.bytes);
    auto* out = static_cast<char*>(buffer.raw_data());
    for (size_t index : message.transfers) {
      const Box& box = plan.sends()[index].owned_box;
      source.pack_box(box, out);
      out += static_cast<size_t>(box.volume()) * element;
    }
    ops.push_back(P2POp::send(buffer.raw_data(), message.bytes, message.peer, tag));
    state.send_buffers.push_back(std::move(buffer));
  }
  state.batch = comm.start_send_recv(ops);

  // While messages travel: interior, periodic self-wraps and zero slabs.
  for (const HaloTransfer& copy : plan.self_copies())
    exchange.haloed_.view_box(copy.haloed_box).copy_from(source.view_box(copy.owned_box));
  for (const Box& box : plan.zero_boxes()) exchange.haloed_.view_box(box).fill(0);
  return exchange;
}

Tensor HaloExchange::finish() {
  if (!in_flight_) return haloed_;
  auto& state = *in_flight_;
  state.batch->wait();
  const size_t element = haloed_.element_size();
  for (size_t m = 0; m < state.incoming.size(); ++m) {
    const auto* in = static_cast<const char*>(state.recv_buffers[m].raw_data());
    for (size_t index : state.incoming[m].transfers) {
      const Box& box = state.plan->recvs()[index].haloed_box;
      haloed_.unpack_box(box, in);
      in += static_cast<size_t>(box.volume()) * element;
    }
  }
  in_flight_.reset();
  return haloed_;
}

Tensor halo_end(HaloExchange& exchange) {
  return exchange.finish();
}

Tensor halo_adjoint(const HaloPlan& plan, const Tensor& haloed_grad, Comm& comm, int tag) {
  check_arg(haloed_grad.shape() == plan.haloed_shape(), "halo",
            "haloed gradient of shape {} on rank {}, the plan says {}", haloed_grad.shape(),
            plan.rank(), plan.haloed_shape());
  const Tensor grad = haloed_grad.to(Device::cpu());
  const size_t element = grad.element_size();
  const Box owned_global = plan.spec().local_box_of_rank(plan.rank());
  Tensor owned_grad = Tensor::zeros(owned_global.shape(), grad.dtype());
  // Reverse roles: what was received goes back to its owner; what was sent comes back.
  std::vector<PeerMessage> outgoing = group_by_peer(plan.recvs(), element);
  std::vector<PeerMessage> incoming = group_by_peer(plan.sends(), element);
  std::vector<Tensor> send_buffers, recv_buffers;
  std::vector<P2POp> ops;
  for (const PeerMessage& message : incoming) {
    recv_buffers.push_back(byte_buffer(message.bytes));
    ops.push_back(P2POp::recv(recv_buffers.back().raw_data(), message.bytes, message.peer, tag));
  }
  for (const PeerMessage& message : outgoing) {
    Tensor buffer = byte_buffer(message.bytes);
    auto* out = static_cast<char*>(buffer.raw_data());
    for (size_t index : message.transfers) {
      const Box& box = plan.recvs()[index].haloed_box;
      grad.pack_box(box, out);
      out += static_cast<size_t>(box.volume()) * element;
    }
    ops.push_back(P2POp::send(buffer.raw_data(), message.bytes, message.peer, tag));
    send_buffers.push_back(std::move(buffer));
  }
  auto batch = comm.start_send_recv(ops);
  for (const HaloTransfer& copy : plan.self_copies())
    add_into(owned_grad.view_box(copy.owned_box), grad.view_box(copy.haloed_box));
  batch->wait();
  for (size_t m = 0; m < incoming.size(); ++m) {
    const auto* in = static_cast<const char*>(recv_buffers[m].raw_data());
    for (size_t index : incoming[m].transfers) {
      const Box& box = plan.sends()[index].owned_box;
      const Tensor piece = Tensor::empty(box.shape(), grad.dtype());
      std::memcpy(piece.raw_data(), in, piece.nbytes());
      add_into(owned_grad.view_box(box), piece);
      in += piece.nbytes();
    }
  }
  return owned_grad.to(haloed_grad.device());
}

}  // namespace tessera
