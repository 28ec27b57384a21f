// linear and matmul with the semantics of torch.nn.functional.linear and torch.matmul, on x
// (or a) sharded on any of its dims but the contracted one (docs/ops.md). Sharding the
// contracted dim (tensor parallelism) is the model-parallel rules' business.
#pragma once

#include <optional>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// x [..., in] @ w^T + b with w [out, in] and optional b [out] (replicated); y [..., out] in x's
/// layout (a sharded last dim of x is gathered first).
ShardTensor linear(const ShardTensor& x, const ShardTensor& w,
                   const std::optional<ShardTensor>& b = std::nullopt);

/// a [..., M, K] @ b: b [K, N] (replicated, applied to every matrix of a) or b [..., K, N] with
/// a's batch dims (sharded like a's). y [..., M, N] in a's layout (a's last dim gathered first).
ShardTensor matmul(const ShardTensor& a, const ShardTensor& b);

}  // namespace tessera::ops
