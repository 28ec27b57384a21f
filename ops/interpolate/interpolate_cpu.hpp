// The cpu kernels of interpolate on one local (haloed) piece: one thread per chunk of (N, C)
// planes, the source cells and weights of every output index precomputed once per spatial dim
// (interpolate_taps.hpp). f32 and f64 compute in their own type, f16 and bf16 in float.
#pragma once

#include "core/tensor.hpp"
#include "ops/interpolate/interpolate_taps.hpp"

namespace tessera::ops {

/// y [N, C, out..] = the interpolation of x [N, C, in..] (the haloed piece) under `plan`.
Tensor interpolate_forward_cpu(const kernels::InterpPlan& plan, const Tensor& x,
                               const Shape& y_shape);

/// dx [N, C, in..] (`x_shape`): every gy cell added to its source cells with the forward's
/// weights.
Tensor interpolate_backward_cpu(const kernels::InterpPlan& plan, const Shape& x_shape,
                                const Tensor& gy);

}  // namespace tessera::ops
