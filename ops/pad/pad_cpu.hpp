// The cpu kernels of pad on one local (haloed) piece: one thread per chunk of planes, the source
// of every output index tabulated once per padded dim (pad_taps.hpp). Any floating dtype (f16 and
// bf16 sum gradients in float).
#pragma once

#include "core/tensor.hpp"
#include "ops/pad/pad_taps.hpp"

namespace tessera::ops {

/// y (`y_shape`) = the padding of x (the haloed piece) under `plan`.
Tensor pad_forward_cpu(const kernels::PadPlan& plan, const Tensor& x, const Shape& y_shape);

/// dx (`x_shape`): every gy cell that is not a constant padding cell added to its source cell.
Tensor pad_backward_cpu(const kernels::PadPlan& plan, const Shape& x_shape, const Tensor& gy);

}  // namespace tessera::ops
