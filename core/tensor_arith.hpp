// Elementwise arithmetic on host tensors that the core itself needs (gradient accumulation).
#pragma once

#include "core/tensor.hpp"

namespace tessera {

/// dst += src elementwise (same shape and dtype; any strides; cpu tensors). dst may be a view.
void add_into(Tensor dst, const Tensor& src);

}  // namespace tessera
