// Elementwise arithmetic that the core itself needs (gradient accumulation), on any device.
#pragma once

#include "core/tensor.hpp"

namespace tessera {

/// dst += src elementwise (same shape, dtype and device; any strides). dst may be a view.
void add_into(Tensor dst, const Tensor& src);

}  // namespace tessera
