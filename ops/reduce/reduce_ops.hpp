// The reductions as plain functions (each is apply_op of a registered op): sum, mean, mse_loss.
#pragma once

#include <cstdint>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Sum over `dims` (all when empty); sharded reduced dims give Partial(sum).
ShardTensor sum(const ShardTensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
/// Mean over `dims` (all when empty); exact on uneven shards.
ShardTensor mean(const ShardTensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
/// mean((a - b)^2) over every element: a scalar.
ShardTensor mse_loss(const ShardTensor& a, const ShardTensor& b);

}  // namespace tessera::ops
