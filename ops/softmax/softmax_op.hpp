// softmax and log_softmax over one dim of x, with the semantics of torch.softmax and
// torch.log_softmax, on any layout: when the dim is sharded, the maximum and the sum of
// exponentials are combined over exactly the mesh dims that shard it (docs/ops.md).
#pragma once

#include <cstdint>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Collective: exp(x - max) / sum(exp(x - max)) along `dim` (negative counts from the end);
/// the output has x's layout (without Partial).
ShardTensor softmax(const ShardTensor& x, int64_t dim = -1);

/// Collective: x - max - log(sum(exp(x - max))) along `dim`, as softmax.
ShardTensor log_softmax(const ShardTensor& x, int64_t dim = -1);

}  // namespace tessera::ops
