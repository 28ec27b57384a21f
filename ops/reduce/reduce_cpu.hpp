// The cpu bodies of sum and mean (and their gradient) for f32 and f64 when the reduced dims form
// one block of x's dims (x seen as [outer, reduced, inner], extent-1 dims ignored): typed,
// vectorised and on the compute threads, summing in f64 in an order that depends on the shapes
// only (f32 sums over a block followed by inner dims: blocks of 32 rows in float lanes, the
// blocks' sums in f64). Other cases return nullopt (the caller's general loop runs).
#pragma once

#include <optional>
#include <vector>

#include "core/tensor.hpp"

namespace tessera::ops {

/// scale * the sum of x over `dims` (sorted), in x's dtype with the reduced dims kept as 1.
std::optional<Tensor> blocked_sum_cpu(const Tensor& x, const std::vector<int64_t>& dims,
                                      double scale);

/// g (x's shape with the reduced `dims` as 1) broadcast back over `shape`, times scale.
std::optional<Tensor> blocked_broadcast_cpu(const Tensor& g, const Shape& shape,
                                            const std::vector<int64_t>& dims, double scale);

}  // namespace tessera::ops
