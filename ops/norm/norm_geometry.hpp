// The layout of one local piece of a normalization, as the cpu and cuda kernels read it: plain
// C++17 (included by norm_cuda.cu too). The contiguous piece is `batch` x `channels` planes of
// `length` elements (group, batch and instance norm: [n, c, spatial..]; layer norm: the leading
// dims flattened into batch, one channel, the normalized dims flattened into length). Every plane
// belongs to one statistics slot; slots are what is reduced across ranks:
//   batch_norm     slot = global channel            (slot_stride 0, slot_offset = first channel)
//   group_norm     slot = n * groups + global group (slot_stride = groups, channels_per_slot)
//   instance_norm  slot = n * channels + c          (slot_stride = channels)
//   layer_norm     slot = n                         (slot_stride 1, one channel)
// The functions are constexpr so that device code calls them too (norm_cuda.cu is compiled with
// --expt-relaxed-constexpr).
#pragma once

#include <cstdint>

namespace tessera::ops::kernels {

/// Which normalization.
enum class NormKind : int { group, batch, instance, layer };

/// One local piece and its statistics slots.
struct NormGeometry {
  NormKind kind = NormKind::group;
  int64_t batch = 0;                ///< outer planes' count (n)
  int64_t channels = 1;             ///< planes per n
  int64_t length = 0;               ///< elements per plane
  int64_t slots = 0;                ///< statistics slots
  int64_t slot_stride = 0;          ///< slots per n (0: every n shares the slots)
  int64_t slot_offset = 0;          ///< added to the local channel before dividing
  int64_t channels_per_slot = 1;    ///< channels (after slot_offset) per slot
  int64_t channel_offset = 0;       ///< global channel of local channel 0 (the index into w, b)
  bool per_element_affine = false;  ///< layer_norm: w, b index the position within a plane
  double eps = 1e-5;

  /// Planes of the piece.
  constexpr int64_t planes() const { return batch * channels; }
  /// Elements of the piece.
  constexpr int64_t numel() const { return batch * channels * length; }
  /// The slot of plane `plane`.
  constexpr int64_t slot_of(int64_t plane) const {
    return (plane / channels) * slot_stride + (plane % channels + slot_offset) / channels_per_slot;
  }
  /// The index into w and b of plane `plane` (per-plane affine).
  constexpr int64_t channel_of(int64_t plane) const { return plane % channels + channel_offset; }
};

/// The planes of one slot: n in [n_lo, n_hi) x local channels [c_lo, c_hi).
struct SlotPlanes {
  int64_t n_lo = 0, n_hi = 0, c_lo = 0, c_hi = 0;
};

/// The planes of slot `slot` (none when this piece holds none of it).
constexpr SlotPlanes slot_planes(const NormGeometry& g, int64_t slot) {
  SlotPlanes result;
  int64_t group = slot;
  if (g.slot_stride == 0) {
    result.n_lo = 0;
    result.n_hi = g.batch;
  } else {
    result.n_lo = slot / g.slot_stride;
    result.n_hi = result.n_lo + 1;
    group = slot % g.slot_stride;
  }
  int64_t lo = group * g.channels_per_slot - g.slot_offset;
  int64_t hi = lo + g.channels_per_slot;
  result.c_lo = lo < 0 ? 0 : (lo > g.channels ? g.channels : lo);
  result.c_hi = hi < result.c_lo ? result.c_lo : (hi > g.channels ? g.channels : hi);
  if (result.n_hi > g.batch) result.n_hi = g.batch;
  if (result.n_lo > result.n_hi) result.n_lo = result.n_hi;
  return result;
}

/// Chan's pairwise combination of the moments (count, mean, M2) of two disjoint sets into the
/// first; an empty side leaves the other exactly as it is.
constexpr void combine_moments(double& count, double& mean, double& m2, double other_count,
                               double other_mean, double other_m2) {
  if (other_count == 0) return;
  if (count == 0) {
    count = other_count;
    mean = other_mean;
    m2 = other_m2;
    return;
  }
  const double total = count + other_count;
  const double delta = other_mean - mean;
  mean += delta * (other_count / total);
  m2 += other_m2 + delta * delta * (count * other_count / total);
  count = total;
}

}  // namespace tessera::ops::kernels
