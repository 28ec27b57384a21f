// The cpu kernels of max and avg pooling on one local (haloed) piece: one thread per chunk of
// (N, C) planes, windows from pool_windows.hpp. f32 and f64 compute in their own type, f16 and
// bf16 in float.
#pragma once

#include "core/tensor.hpp"
#include "ops/pool/pool_windows.hpp"

namespace tessera::ops {

/// y [N, C, out..] = the pooling of x [N, C, in..] (the haloed piece) over `windows`.
Tensor pool_forward_cpu(const kernels::PoolWindows& windows, const Tensor& x, const Shape& y_shape);

/// dx (x's shape): gy routed to each window's argmax (max; the first maximum in window order, the
/// last NaN when there is one, found from the forward's output y) or spread as gy / divisor over
/// its real cells (avg; y unused).
Tensor pool_backward_cpu(const kernels::PoolWindows& windows, const Tensor& x, const Tensor& y,
                         const Tensor& gy);

}  // namespace tessera::ops
