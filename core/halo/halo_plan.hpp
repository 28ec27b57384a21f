// HaloPlan: which boxes of which ranks' owned pieces fill this rank's haloed tensor. A plan is
// data, built once per (layout, needed boxes, boundary modes) by pure functions (no
// communication: every rank can build every rank's plan) and cached.
//
// Each rank names the box of GLOBAL indices it needs (usually its owned box grown by the halo
// widths), which may reach past a global edge. Per tensor dim the boundary mode says what lies
// there: `zero` (the part outside is zero-filled) or `periodic` (indices wrap, possibly across
// several periods). The plan is the list of intersections of the needed box with every
// owner's box; so a halo wider than a neighbour's shard is served by several ranks, empty and
// thin shards need no special case, corners and edges of 2-d/3-d meshes arrive in the same
// exchange, and a periodic wrap onto this rank itself is just a local copy.
#pragma once

#include <memory>
#include <vector>

#include "core/layout.hpp"

namespace tessera {

/// What lies beyond a global edge of a tensor dim.
enum class BoundaryMode : uint8_t { zero, periodic };

/// One box to copy between an owner's piece and a receiver's haloed tensor.
struct HaloTransfer {
  int peer;        ///< mesh rank of the other side
  Box owned_box;   ///< in the owner's local (owned-piece) coordinates
  Box haloed_box;  ///< in the receiver's haloed-tensor coordinates
};

/// The halo plan of one rank.
class HaloPlan {
 public:
  /// Builds the plan of mesh rank `rank` for the layout `spec`, where rank q needs the global
  /// box needed[q] (one per mesh rank). Shard and Replicate placements only; along replicated
  /// mesh dims the data comes from the replica with the receiver's coordinate.
  static HaloPlan build(const ShardSpec& spec, const std::vector<Box>& needed,
                        const std::vector<BoundaryMode>& boundary, int rank);

  /// Global (unwrapped) index box of the haloed tensor.
  const Box& needed_box() const { return needed_; }
  /// Shape of the haloed tensor.
  Shape haloed_shape() const { return needed_.shape(); }
  /// This rank's owned box, in haloed-tensor coordinates.
  Box interior_box() const;
  /// Boxes this rank sends, ordered by peer then message order.
  const std::vector<HaloTransfer>& sends() const { return sends_; }
  /// Boxes this rank receives, ordered by peer then message order.
  const std::vector<HaloTransfer>& recvs() const { return recvs_; }
  /// Boxes copied within this rank (its interior, and periodic wraps onto itself).
  const std::vector<HaloTransfer>& self_copies() const { return self_copies_; }
  /// Parts of the haloed tensor beyond a zero-boundary edge (haloed coordinates).
  const std::vector<Box>& zero_boxes() const { return zero_boxes_; }
  /// The layout the plan was built for.
  const ShardSpec& spec() const { return spec_; }
  /// This rank.
  int rank() const { return rank_; }

 private:
  ShardSpec spec_;
  int rank_ = 0;
  Box needed_;
  Box owned_;
  std::vector<HaloTransfer> sends_, recvs_, self_copies_;
  std::vector<Box> zero_boxes_;
};

/// The needed boxes of the common case: every rank's owned box grown by `lo` widths on the low
/// side and `hi` widths on the high side of each tensor dim (negative widths shrink it).
std::vector<Box> grown_boxes(const ShardSpec& spec, const std::vector<int64_t>& lo,
                             const std::vector<int64_t>& hi);

/// What identifies a halo plan: the layout, every rank's needed box, the boundary modes and the
/// rank. The key of the one process-wide plan cache.
struct HaloPlanKey {
  ShardSpec spec;
  std::vector<Box> needed;
  std::vector<BoundaryMode> boundary;
  int rank = 0;
  bool operator==(const HaloPlanKey&) const = default;
};

/// A hash of every field of `key` (equal keys hash equally).
size_t hash_of(const HaloPlanKey& key);

/// The plan of `key`, from the process-wide cache (built on first use; thread-safe).
std::shared_ptr<const HaloPlan> cached_halo_plan(const HaloPlanKey& key);

/// The plan of `rank` for boxes grown by (lo, hi), from the process-wide cache.
std::shared_ptr<const HaloPlan> cached_halo_plan(const ShardSpec& spec,
                                                 const std::vector<int64_t>& lo,
                                                 const std::vector<int64_t>& hi,
                                                 const std::vector<BoundaryMode>& boundary,
                                                 int rank);

}  // namespace tessera
