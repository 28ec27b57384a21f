// The sharded neighborhood attention op (na1d/2d/3d, NATTEN semantics): options and the user
// call. See docs/neighborhood-attention.md.
#pragma once

#include <optional>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Options of neighborhood attention, per spatial axis (a single value applies to every axis).
struct NaOptions {
  std::vector<int64_t> kernel_size{7};
  std::vector<int64_t> dilation{1};
  std::vector<int64_t> causal{0};  ///< 0 or 1 per axis
  /// Logits are scale * q.k; default D^-0.5.
  std::optional<double> scale;
  /// Relative positional bias [heads, 2k1-1(, 2k2-1..)], replicated; non-causal odd kernels only.
  std::optional<ShardTensor> rpb;
};

/// The outputs: o [B, X.., heads, D] in q's layout and lse [B, X.., heads] (natural log of the
/// softmax denominator) in the same layout without the last dim.
struct NaResult {
  ShardTensor output;
  ShardTensor lse;
};

/// Collective: neighborhood attention of q, k, v [B, X(, Y(, Z)), heads, D] sharded on any
/// spatial axes (and optionally the batch dim). Windows come from global indices and extents;
/// k and v get exactly the key box each rank's queries read through the halo plan.
NaResult neighborhood_attention(const ShardTensor& q, const ShardTensor& k, const ShardTensor& v,
                                const NaOptions& options = {});

}  // namespace tessera::ops
