// concat and split with the semantics of torch.cat and torch.split, along any dim of tensors
// sharded on any layout, the concatenated dim included (docs/ops.md).
#pragma once

#include <cstdint>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Most inputs of concat and outputs of split (their signatures name x0..x7 and y0..y7).
inline constexpr int kMaxConcatParts = 8;

/// Collective: the inputs (2 to 8, equal but along `dim`) joined along `dim`. Along a sharded dim
/// each rank's output holds as many elements as its inputs did (the pieces move to the ranks
/// whose output boxes cover them); other dims keep the first input's layout.
ShardTensor concat(const std::vector<ShardTensor>& inputs, int64_t dim = 0);

/// x cut along `dim` into parts of `sizes` (summing to the dim's extent; one size s: parts of s,
/// the last smaller, as torch.split). Each part keeps x's layout, cut to the rank's box: no
/// communication.
std::vector<ShardTensor> split(const ShardTensor& x, const std::vector<int64_t>& sizes,
                               int64_t dim = 0);

}  // namespace tessera::ops
