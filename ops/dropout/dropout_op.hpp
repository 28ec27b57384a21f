// dropout with torch.nn.functional.dropout's semantics (zero with probability p, scale the kept
// elements by 1 / (1 - p); identity when not training), whose mask is a pure function of the
// seed and each element's GLOBAL index: every layout of every mesh drops the same elements.
#pragma once

#include <cstdint>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Whether the element at global row-major index `index` is kept by dropout(p, seed).
bool dropout_keeps(uint64_t seed, uint64_t index, double p);

/// x with each element zeroed with probability p (a function of seed and its global index) and
/// the others scaled by 1 / (1 - p); x itself (a copy) when !training or p == 0.
ShardTensor dropout(const ShardTensor& x, double p, uint64_t seed, bool training = true);

}  // namespace tessera::ops
