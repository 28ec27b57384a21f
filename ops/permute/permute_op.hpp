// permute: torch.permute on a ShardTensor as a relabelling of the layout. The sharded dims move
// with the data (a mesh dim sharding input dim dims[i] shards output dim i, with the same
// extents; Partial stays Partial), so every rank permutes its own piece and nothing crosses
// ranks: a channels-last block ([N, H, W, C] for LayerNorm) keeps its spatial shards.
#pragma once

#include <cstdint>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Output dim i is input dim dims[i] (a permutation of 0..ndim-1; negative dims from the end).
ShardTensor permute(const ShardTensor& x, const std::vector<int64_t>& dims);

/// The layout of permute(x, dims) for x laid out by `spec` (pure; errors tagged "permute").
ShardSpec permuted_spec(const ShardSpec& spec, const std::vector<int64_t>& dims);

}  // namespace tessera::ops
