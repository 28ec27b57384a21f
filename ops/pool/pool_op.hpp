// The sharded pooling ops max_pool and avg_pool (1/2/3-d by the rank of x): options and the user
// calls, with the semantics of torch.nn.functional.max_pool*d / avg_pool*d.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Options of a pooling, per spatial dim (a single value applies to every dim).
struct PoolOptions {
  std::vector<int64_t> kernel_size{2};
  /// Empty: kernel_size.
  std::vector<int64_t> stride{};
  /// Implicit padding on both sides, at most half the kernel (max: -inf cells; avg: see
  /// count_include_pad).
  std::vector<int64_t> padding{0};
  /// Cells between the cells of a window (max_pool only).
  std::vector<int64_t> dilation{1};
  /// Output extents rounded up: a last, partial window that starts inside the input or the left
  /// padding.
  bool ceil_mode = false;
  /// avg_pool: the divisor counts the padding cells of a window (never cells past the padded
  /// extent).
  bool count_include_pad = true;
  /// avg_pool: the divisor of every window when non-zero.
  int64_t divisor_override = 0;
};

/// Collective: max_pool1d/2d/3d of x [N, C, spatial..] sharded on any dims. Output o along a
/// spatial dim is owned by the rank owning input clamp(o*stride, 0, L-1); windows crossing shard
/// borders read the halo.
ShardTensor max_pool(const ShardTensor& x, const PoolOptions& options);

/// Collective: max_pool's y and its indices (i64, y's layout), as torch's max_pool*d with
/// return_indices=True: per output the flat index, in the global input's spatial plane, of its
/// window's maximum (the first maximum in window order, the last NaN when there is one, the
/// first real cell when every real cell is -inf; -1 for a window with no real cell, possible
/// only with dilation). The indices are the same however x is sharded; they take no gradient.
std::pair<ShardTensor, ShardTensor> max_pool_with_indices(const ShardTensor& x,
                                                          const PoolOptions& options);

/// Collective: avg_pool1d/2d/3d of x [N, C, spatial..] sharded on any dims (dilation must be 1),
/// laid out as max_pool's output.
ShardTensor avg_pool(const ShardTensor& x, const PoolOptions& options);

}  // namespace tessera::ops
