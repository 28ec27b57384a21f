// Halo plan construction (see halo_plan.hpp).
//
// For receiver q, the needed box is cut into pieces, one per combination of periodic images
// along the dims (a single piece without periodic dims): piece U with shift s such that
// U + s lies inside the global box. Every owner p that the receiver may take data from (same
// coordinate on non-shard mesh dims) contributes I = (U + s) ∩ owned(p): the owner copies
// I - owned(p).lo, the receiver writes it at (I - s) - needed(q).lo. Sender and receiver run
// the same loops, so both list the boxes of one message in the same order.
#include "core/halo/halo_plan.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <unordered_map>

#include "core/errors.hpp"

namespace tessera {

namespace {

/// One periodic image of part of the needed box.
struct Piece {
  Box unwrapped;               ///< global unwrapped indices (inside the needed box)
  std::vector<int64_t> shift;  ///< unwrapped + shift lies in [0, L)
};

/// Cuts `needed` into pieces by period along periodic dims and clips zero-boundary dims.
std::vector<Piece> pieces_of(const Box& needed, const Shape& global,
                             const std::vector<BoundaryMode>& boundary) {
  const size_t ndim = global.size();
  // Per dim: list of (lo, hi, shift) segments.
  std::vector<std::vector<std::array<int64_t, 3>>> segments(ndim);
  for (size_t d = 0; d < ndim; ++d) {
    const int64_t lo = needed.lo[d], hi = needed.hi[d], extent = global[d];
    if (hi <= lo || extent == 0) return {};
    if (boundary[d] == BoundaryMode::zero) {
      const int64_t a = std::max<int64_t>(lo, 0), b = std::min(hi, extent);
      if (a >= b) return {};
      segments[d].push_back({a, b, 0});
      continue;
    }
    auto floor_div = [](int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); };
    for (int64_t k = floor_div(lo, extent); k <= floor_div(hi - 1, extent); ++k)
      segments[d].push_back(
          {std::max(lo, k * extent), std::min(hi, (k + 1) * extent), -k * extent});
  }
  std::vector<Piece> pieces;
  std::vector<size_t> choice(ndim, 0);
  while (true) {
    Piece piece{needed, std::vector<int64_t>(ndim)};
    for (size_t d = 0; d < ndim; ++d) {
      piece.unwrapped.lo[d] = segments[d][choice[d]][0];
      piece.unwrapped.hi[d] = segments[d][choice[d]][1];
      piece.shift[d] = segments[d][choice[d]][2];
    }
    pieces.push_back(std::move(piece));
    size_t d = ndim;
    while (d > 0 && ++choice[d - 1] == segments[d - 1].size()) choice[--d] = 0;
    if (d == 0) break;
  }
  return pieces;
}

/// Mesh ranks a receiver at `coord` takes data from: its coordinate on non-shard mesh dims.
std::vector<int> candidate_owners(const ShardSpec& spec, const std::vector<int>& coord) {
  std::vector<int> owners;
  for (int rank = 0; rank < mesh_size(spec.mesh_shape); ++rank) {
    const std::vector<int> other = coord_of(rank, spec.mesh_shape);
    bool same = true;
    for (size_t m = 0; m < spec.mesh_shape.size(); ++m)
      same = same && (spec.placements[m].is_shard() || other[m] == coord[m]);
    if (same) owners.push_back(rank);
  }
  return owners;
}

/// Transfers from `owners` (a subsequence of the receiver's candidate owners) that fill the
/// haloed tensor of a receiver needing `needed`, in message order.
std::vector<HaloTransfer> transfers_into(const ShardSpec& spec, const Box& needed,
                                         const std::vector<BoundaryMode>& boundary,
                                         const std::vector<int>& owners) {
  std::vector<HaloTransfer> transfers;
  for (const Piece& piece : pieces_of(needed, spec.global_shape, boundary)) {
    const Box wrapped = piece.unwrapped.shifted(piece.shift);
    for (int owner : owners) {
      const Box owned = spec.local_box_of_rank(owner);
      const Box common = intersect(wrapped, owned);
      if (common.empty()) continue;
      std::vector<int64_t> unshift(piece.shift.size());
      for (size_t d = 0; d < unshift.size(); ++d) unshift[d] = -piece.shift[d];
      transfers.push_back(
          {owner, common.relative_to(owned.lo), common.shifted(unshift).relative_to(needed.lo)});
    }
  }
  return transfers;
}

/// Whether `needed` reaches beyond [0, L) along a periodic dim (so it takes a wrapped image).
bool needs_image(const Box& needed, const Shape& global,
                 const std::vector<BoundaryMode>& boundary) {
  for (size_t d = 0; d < global.size(); ++d)
    if (boundary[d] != BoundaryMode::zero && (needed.lo[d] < 0 || needed.hi[d] > global[d]))
      return true;
  return false;
}

/// Whether boxes `a` and `b` share an index (allocation-free intersect(a, b).empty()).
bool overlaps(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.ndim(); ++d)
    if (std::max(a.lo[d], b.lo[d]) >= std::min(a.hi[d], b.hi[d])) return false;
  return true;
}

}  // namespace

HaloPlan HaloPlan::build(const ShardSpec& spec, const std::vector<Box>& needed,
                         const std::vector<BoundaryMode>& boundary, int rank) {
  const int ranks = mesh_size(spec.mesh_shape);
  check_arg(static_cast<int>(needed.size()) == ranks, "halo",
            "{} needed boxes given for a mesh of {} ranks", needed.size(), ranks);
  check_arg(boundary.size() == spec.global_shape.size(), "halo",
            "{} boundary modes given for a {}-d tensor", boundary.size(), spec.global_shape.size());
  TESSERA_CHECK_ARG(!spec.has_partial(), "halo",
                    "a halo exchange needs values, not partial sums: {}", spec.str());
  // The box is formatted only when wrong: this loop runs over every rank's box on every rank.
  for (const Box& box : needed)
    if (box.ndim() != spec.global_shape.size())
      throw InvalidArgument("halo", fmt::format("needed box {} of a {}-d tensor", box.str(),
                                                spec.global_shape.size()));

  HaloPlan plan;
  plan.spec_ = spec;
  plan.rank_ = rank;
  plan.needed_ = needed[rank];
  plan.owned_ = spec.local_box_of_rank(rank);
  const std::vector<int> coord = coord_of(rank, spec.mesh_shape);
  for (HaloTransfer& transfer :
       transfers_into(spec, needed[rank], boundary, candidate_owners(spec, coord))) {
    if (transfer.peer == rank)
      plan.self_copies_.push_back(transfer);
    else
      plan.recvs_.push_back(transfer);
  }
  // What this rank sends: its part of every other receiver's transfers, in their order. Only
  // this rank's transfers are formed (not every owner's), so the plan costs O(ranks), not
  // O(ranks^2): estimate mode builds it on each of thousands of simulated ranks.
  const std::vector<int> only_this_rank{rank};
  for (int receiver = 0; receiver < ranks; ++receiver) {
    if (receiver == rank) continue;
    // Most receivers are far away: one that needs no periodic image and whose box misses this
    // rank's is skipped before any allocation.
    if (!needs_image(needed[receiver], spec.global_shape, boundary) &&
        !overlaps(needed[receiver], plan.owned_))
      continue;
    // This rank serves a receiver only when their coordinates agree on the non-shard mesh dims.
    const std::vector<int> receiver_coord = coord_of(receiver, spec.mesh_shape);
    bool serves = true;
    for (size_t m = 0; m < spec.mesh_shape.size(); ++m)
      serves = serves && (spec.placements[m].is_shard() || coord[m] == receiver_coord[m]);
    if (!serves) continue;
    for (HaloTransfer& transfer :
         transfers_into(spec, needed[receiver], boundary, only_this_rank)) {
      transfer.peer = receiver;
      plan.sends_.push_back(transfer);
    }
  }
  std::stable_sort(plan.recvs_.begin(), plan.recvs_.end(),
                   [](const HaloTransfer& a, const HaloTransfer& b) { return a.peer < b.peer; });
  // Zero-filled slabs beyond zero-boundary edges, cut so they do not overlap.
  Box rest = plan.needed_;
  for (size_t d = 0; d < rest.ndim(); ++d) {
    if (boundary[d] != BoundaryMode::zero) continue;
    const int64_t extent = spec.global_shape[d];
    if (rest.lo[d] < 0) {
      Box slab = rest;
      slab.hi[d] = std::min<int64_t>(0, rest.hi[d]);
      if (!slab.empty()) plan.zero_boxes_.push_back(slab.relative_to(plan.needed_.lo));
      rest.lo[d] = std::min<int64_t>(0, rest.hi[d]);
    }
    if (rest.hi[d] > extent) {
      Box slab = rest;
      slab.lo[d] = std::max(extent, rest.lo[d]);
      if (!slab.empty()) plan.zero_boxes_.push_back(slab.relative_to(plan.needed_.lo));
      rest.hi[d] = std::max(extent, rest.lo[d]);
    }
  }
  return plan;
}

Box HaloPlan::interior_box() const {
  return intersect(owned_, needed_).relative_to(needed_.lo);
}

std::vector<Box> grown_boxes(const ShardSpec& spec, const std::vector<int64_t>& lo,
                             const std::vector<int64_t>& hi) {
  const size_t ndim = spec.global_shape.size();
  check_arg(lo.size() == ndim && hi.size() == ndim, "halo",
            "halo widths {} / {} given for a {}-d tensor", lo, hi, ndim);
  std::vector<Box> boxes;
  for (int rank = 0; rank < mesh_size(spec.mesh_shape); ++rank) {
    Box box = spec.local_box_of_rank(rank);
    for (size_t d = 0; d < ndim; ++d) {
      box.lo[d] -= lo[d];
      box.hi[d] = std::max(box.lo[d], box.hi[d] + hi[d]);
    }
    boxes.push_back(box);
  }
  return boxes;
}

namespace {

void hash_into(size_t& seed, uint64_t value) {
  // 64-bit mix (splitmix64 finalizer) folded into the running seed.
  value += 0x9E3779B97F4A7C15ull;
  value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9ull;
  value = (value ^ (value >> 27)) * 0x94D049BB133111EBull;
  seed ^= static_cast<size_t>(value ^ (value >> 31)) + (seed << 6) + (seed >> 2);
}

template <typename Range>
void hash_range(size_t& seed, const Range& values) {
  hash_into(seed, values.size());
  for (const auto& value : values) hash_into(seed, static_cast<uint64_t>(value));
}

struct KeyHash {
  size_t operator()(const HaloPlanKey& key) const { return hash_of(key); }
};

}  // namespace

size_t hash_of(const HaloPlanKey& key) {
  size_t seed = 0;
  hash_range(seed, key.spec.global_shape);
  hash_range(seed, key.spec.mesh_shape);
  for (const Placement& placement : key.spec.placements) {
    hash_into(seed, static_cast<uint64_t>(placement.kind));
    hash_into(seed, static_cast<uint64_t>(placement.dim));
    hash_into(seed, static_cast<uint64_t>(placement.reduce));
  }
  for (const auto& extents : key.spec.extents) hash_range(seed, extents);
  for (const Box& box : key.needed) {
    hash_range(seed, box.lo);
    hash_range(seed, box.hi);
  }
  for (BoundaryMode mode : key.boundary) hash_into(seed, static_cast<uint64_t>(mode));
  hash_into(seed, static_cast<uint64_t>(key.rank));
  return seed;
}

std::shared_ptr<const HaloPlan> cached_halo_plan(const HaloPlanKey& key) {
  static std::mutex mu;
  static std::unordered_map<HaloPlanKey, std::shared_ptr<const HaloPlan>, KeyHash> cache;
  {
    std::lock_guard lock(mu);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  auto plan = std::make_shared<const HaloPlan>(
      HaloPlan::build(key.spec, key.needed, key.boundary, key.rank));
  std::lock_guard lock(mu);
  if (cache.size() > 4096) cache.clear();  // layouts churn rarely; bound the memory anyway
  return cache.emplace(key, plan).first->second;
}

std::shared_ptr<const HaloPlan> cached_halo_plan(const ShardSpec& spec,
                                                 const std::vector<int64_t>& lo,
                                                 const std::vector<int64_t>& hi,
                                                 const std::vector<BoundaryMode>& boundary,
                                                 int rank) {
  return cached_halo_plan(HaloPlanKey{spec, grown_boxes(spec, lo, hi), boundary, rank});
}

}  // namespace tessera
