// Broadcasting of a replicated operand b against the local piece of a sharded operand a: b's
// dims sit at a's dims [align, align + b.ndim), each of extent 1 (broadcast) or a's global
// extent (then sliced to the local box).
#pragma once

#include "core/tensor.hpp"

namespace tessera::ops {

/// Where b's first dim sits in a (resolves align = -1, numpy's right alignment); throws
/// InvalidArgument (tagged `op`) when b does not broadcast against a.
int broadcast_offset(const Shape& a_global, const Shape& b_shape, int64_t align,
                     const std::string& op);

/// b expanded to the local box `a_box` of a (contiguous, a_box's shape, on b's device).
Tensor expand_to_box(const Tensor& b, const Box& a_box, int offset);

/// The sum of `grad` (a_box's shape) onto b's shape: entries outside a_box along non-broadcast
/// dims stay zero (other ranks contribute them).
Tensor reduce_to_operand(const Tensor& grad, const Shape& b_shape, const Box& a_box, int offset);

}  // namespace tessera::ops
