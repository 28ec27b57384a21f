// ShardTensor: this rank's local Tensor + the DeviceMesh + the ShardSpec that says which
// global indices every rank holds. Every rank knows every rank's extents, so no op has to ask.
#pragma once

#include <vector>

#include "core/device_mesh.hpp"
#include "core/layout.hpp"
#include "core/tensor.hpp"

namespace tessera {

class ShardTensor {
 public:
  /// Wraps a local tensor that is known to match `spec` on this rank (no checks, no
  /// communication; use from_local for user input).
  ShardTensor(Tensor local, DeviceMesh mesh, ShardSpec spec);

  /// Collective: wraps each rank's piece of a global tensor of `global_shape` laid out by
  /// `placements` and `extents` (empty = default split). Every rank raises the same
  /// AgreedError when a local shape, dtype, or the layout differs between ranks.
  static ShardTensor from_local(Tensor local, DeviceMesh mesh, Shape global_shape,
                                std::vector<Placement> placements,
                                std::vector<std::vector<int64_t>> extents = {});
  /// Collective: as above, with the global shape and extents taken from the local shapes
  /// (gathered once).
  static ShardTensor from_local(Tensor local, DeviceMesh mesh, std::vector<Placement> placements);
  /// Collective: `root` holds the full tensor (other ranks pass anything, e.g. Tensor()); each
  /// rank receives only its own shard (scatter_v). Partial(sum) puts the values on the ranks
  /// at coordinate 0 of the partial dims and zeros elsewhere; other partial ops copy them.
  /// Each piece lands on its rank's device (TESSERA_DEVICE); with cpu ranks the root's piece
  /// stays on the full tensor's device. A cuda tensor on the root moves device to device.
  static ShardTensor scatter(const Tensor& full, DeviceMesh mesh, std::vector<Placement> placements,
                             std::vector<std::vector<int64_t>> extents = {}, int root = 0);
  /// Collective: every rank holds the same full tensor and keeps its own shard (no data moves).
  static ShardTensor distribute(const Tensor& replicated, DeviceMesh mesh,
                                std::vector<Placement> placements,
                                std::vector<std::vector<int64_t>> extents = {});

  /// This rank's piece. It may be a strided view (split's parts are views of their input, as
  /// torch.split's are): read it through its strides, or call contiguous() first.
  const Tensor& to_local() const { return local_; }
  /// The same tensor (same identity for autograd, same layout) whose local piece is contiguous:
  /// this tensor itself when it already is, else one with a contiguous copy of the piece.
  ShardTensor contiguous() const;
  const DeviceMesh& mesh() const { return mesh_; }
  const ShardSpec& spec() const { return spec_; }
  const Shape& global_shape() const { return spec_.global_shape; }
  const std::vector<Placement>& placements() const { return spec_.placements; }
  DType dtype() const { return local_.dtype(); }
  Device device() const { return local_.device(); }
  /// Global indices of this rank's piece.
  Box local_box() const { return spec_.local_box(mesh_.coord()); }

  /// Collective: the same global tensor in another layout on the same mesh (extents empty =
  /// default split). Moves exactly the bytes that change owner.
  ShardTensor redistribute(std::vector<Placement> placements,
                           std::vector<std::vector<int64_t>> extents = {}) const;
  /// Collective: redistribute to `target` without first agreeing on it: for a layout every rank
  /// derived the same way from layouts already agreed (an op rule's, a gradient's), where the
  /// agreement's all-reduce would only cost latency. A rank-local choice of layout must go
  /// through redistribute().
  ShardTensor redistribute_to(const ShardSpec& target) const;
  /// Collective: the full global tensor on every rank.
  Tensor full_tensor() const;
  /// Collective: the full global tensor on `root`, Tensor() elsewhere.
  Tensor gather(int root = 0) const;

  /// Identity used by autograd: copies share it, every op result gets a new one.
  uint64_t id() const { return id_; }
  /// Marks this tensor as a leaf whose gradient backward() computes.
  ShardTensor& set_requires_grad(bool enabled = true) {
    requires_grad_ = enabled;
    return *this;
  }
  /// True for leaves marked with set_requires_grad and for results of ops recorded on a tape.
  bool requires_grad() const { return requires_grad_; }

 private:
  Tensor local_;
  DeviceMesh mesh_;
  ShardSpec spec_;
  uint64_t id_;
  bool requires_grad_ = false;
};

}  // namespace tessera
