// `attention`: softmax(scale q k^T (+ causal mask)) v of q [B, Sq, heads, D], k [B, Sk, heads,
// D], v [B, Sk, heads, Dv], with the sequence dim sharded on any layout (uneven, empty shards),
// batch and heads sharded too. K/V blocks travel around the ring of ranks that shard the
// sequence while each rank keeps an online softmax of its queries; the attention matrix is never
// formed beyond one block. Exact against dense attention (docs/ops.md).
#pragma once

#include <optional>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Options of attention.
struct AttentionOptions {
  bool causal = false;          ///< query i sees keys j <= i (global indices; PyTorch's tril mask)
  std::optional<double> scale;  ///< unset: 1 / sqrt(D)
};

/// Collective: o [B, Sq, heads, Dv] and the log-sum-exp of every query's scores lse [B, Sq,
/// heads], both in q's layout.
std::vector<ShardTensor> attention(const ShardTensor& q, const ShardTensor& k, const ShardTensor& v,
                                   const AttentionOptions& options = {});

}  // namespace tessera::ops
