// cast: x converted elementwise to another floating dtype (round to nearest even), the layout
// kept, Partial placements included (a Partial sum cast to f32 is then reduced in f32). Its
// gradient is the output gradient cast back to x's dtype, so a master weight in f32 used through
// cast(w, bf16) receives an f32 gradient: mixed precision's casts (ops/nn/mixed_precision.hpp).
#pragma once

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// x with its elements converted to `dtype` (f32, f64, f16 or bf16; x itself when x already has
/// it); differentiable, the gradient cast back to x's dtype.
ShardTensor cast(const ShardTensor& x, DType dtype);

}  // namespace tessera::ops
