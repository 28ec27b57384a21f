// split_last and merge_last: the last dim of a tensor split into [n, inner] and the last two dims
// merged back, on any layout. A mesh dim sharding the split dim in whole multiples of `inner`
// keeps sharding it (as Shard of n), so attention heads made by a column-parallel projection stay
// on their rank and nothing moves.
#pragma once

#include <cstdint>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// x [..., n * inner] as [..., n, inner] (heads from features).
ShardTensor split_last(const ShardTensor& x, int64_t inner);

/// x [..., n, inner] as [..., n * inner] (features from heads).
ShardTensor merge_last(const ShardTensor& x);

}  // namespace tessera::ops
