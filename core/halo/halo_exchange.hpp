// Halo exchange over a HaloPlan: halo_begin packs and posts every face, edge and corner box in
// one batch of messages (one per peer) and copies the interior; halo_end waits and unpacks.
// Interior compute can run between the two. halo_adjoint is the backward: gradient that landed
// in halo cells goes back to the owners, who add it.
#pragma once

#include <memory>

#include "core/comm/comm.hpp"
#include "core/halo/halo_plan.hpp"
#include "core/tensor.hpp"

namespace tessera {

namespace trace {
class Span;
}

/// An exchange in flight: the haloed tensor (interior and zero boxes already valid) and the
/// messages still on the wire.
class HaloExchange {
 public:
  HaloExchange(HaloExchange&&) noexcept;
  HaloExchange& operator=(HaloExchange&&) noexcept;
  ~HaloExchange();
  /// The haloed tensor; only its interior is valid before finish().
  const Tensor& haloed() const { return haloed_; }
  /// Waits for every message and unpacks the halo boxes; returns the complete haloed tensor
  /// (complete but for its interior when interior_unfilled()).
  Tensor finish();
  /// True when the exchange (halo_begin_around) left the interior, plan.interior_box(), unfilled.
  bool interior_unfilled() const { return interior_unfilled_; }

 private:
  friend HaloExchange begin_from_owned(const HaloPlan&, const Tensor&, Comm&, int, bool);
  friend HaloExchange halo_begin_in_place(const HaloPlan&, const Tensor&, Comm&, int);
  friend HaloExchange start_exchange(const HaloPlan&, const Tensor&, Tensor, bool, Comm&, int,
                                     trace::Span&);
  HaloExchange() = default;
  struct InFlight;
  std::unique_ptr<InFlight> in_flight_;
  Tensor haloed_;
  bool interior_unfilled_ = false;
};

/// Starts the exchange of `plan` for this rank's owned piece `owned` over the mesh
/// communicator `comm` (ranks are mesh ranks). Messages use `tag`. `plan` must outlive the
/// exchange. When the plan needs nothing beyond the owned piece (one rank with virtual padding,
/// or a piece whose ops read no neighbour), the haloed tensor IS `owned` (shared storage, not a
/// copy): kernels read it and never write it.
HaloExchange halo_begin(const HaloPlan& plan, const Tensor& owned, Comm& comm, int tag = 0);

/// As halo_begin, but the haloed tensor's interior (plan.interior_box(), where the owned piece
/// goes) is left unfilled when the plan needs a halo: for kernels that read the owned piece where
/// it lies and only the halo cells from the haloed tensor, which saves copying the owned piece.
/// exchange.interior_unfilled() says whether it was left.
HaloExchange halo_begin_around(const HaloPlan& plan, const Tensor& owned, Comm& comm, int tag = 0);

/// Starts the exchange of `plan` in place: `haloed` (of plan.haloed_shape()) already holds this
/// rank's owned piece in its interior (plan.interior_box()); only the halo cells are filled, and
/// the interior is not copied. For a time-stepping loop that keeps its state haloed. `haloed`
/// and `plan` must outlive the exchange, and the interior must not change before it finishes.
HaloExchange halo_begin_in_place(const HaloPlan& plan, const Tensor& haloed, Comm& comm,
                                 int tag = 0);

/// Waits for `exchange` and returns the haloed tensor.
Tensor halo_end(HaloExchange& exchange);

/// Backward of the exchange: from the gradient of the haloed tensor, the gradient of the owned
/// piece (halo cells' gradient is sent to their owners and added there). When the plan needs no
/// halo, that is `haloed_grad` itself (shared, not copied).
Tensor halo_adjoint(const HaloPlan& plan, const Tensor& haloed_grad, Comm& comm, int tag = 0);

}  // namespace tessera
