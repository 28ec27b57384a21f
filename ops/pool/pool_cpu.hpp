// The cpu kernels of max and avg pooling on one local (haloed) piece: one thread per chunk of
// (N, C) planes, windows from pool_windows.hpp. f32 and f64 compute in their own type, f16 and
// bf16 in float.
#pragma once

#include <optional>
#include <vector>

#include "core/tensor.hpp"
#include "ops/pool/pool_windows.hpp"

namespace tessera::ops {

/// y [N, C, out..] = the pooling of x [N, C, in..] (the haloed piece) over `windows`, and for max
/// its indices (i64, y's shape): per output the global index of its window's maximum
/// (pool_global_index; the first maximum in window order, the last NaN when there is one, the
/// first real cell when all are -inf), -1 for a window with no real cell.
std::vector<Tensor> pool_forward_cpu(const kernels::PoolWindows& windows, const Tensor& x,
                                     const Shape& y_shape);

/// dx (of shape x_shape, gy's dtype) from gy: routed to the cell each output's index names (max;
/// `indices` as the forward returned them) or spread as gy / divisor over each window's real
/// cells (avg; `indices` unused).
Tensor pool_backward_cpu(const kernels::PoolWindows& windows, const Shape& x_shape,
                         const std::optional<Tensor>& indices, const Tensor& gy);

}  // namespace tessera::ops
