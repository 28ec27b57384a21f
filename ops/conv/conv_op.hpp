// The sharded convolution op (conv1d/2d/3d): options, padding resolution, and the user call.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Options of a convolution, per spatial dim (a single value applies to every dim).
struct ConvOptions {
  std::vector<int64_t> stride{1};
  std::vector<int64_t> dilation{1};
  /// Explicit per-dim padding on the low side (and the high side unless `padding_hi` is given);
  /// ignored when `padding_name` is "same" or "valid".
  std::vector<int64_t> padding{0};
  /// Explicit per-dim padding on the high side (empty: the same as `padding`).
  std::vector<int64_t> padding_hi;
  /// "" (use `padding`), "same" (stride 1: output extent = input extent) or "valid" (none).
  std::string padding_name;
  int64_t groups = 1;
  /// "zeros" or "circular".
  std::string padding_mode = "zeros";
};

/// Collective: y = conv(x, w) (+ b) for x [N, C, spatial..] sharded on any spatial dims (and
/// optionally the batch dim), w [Cout, C/groups, k..] and b [Cout] replicated. Output element o
/// along a dim is owned by the rank owning input index clamp(o*stride, 0, L_in-1); user padding
/// applies only at global edges (circular wraps through the halo).
ShardTensor conv(const ShardTensor& x, const ShardTensor& w, const std::optional<ShardTensor>& b,
                 const ConvOptions& options = {});

}  // namespace tessera::ops
