// The cuda body of dropout (host side): dropout_cuda.cpp launches dropout_cuda.cu's kernel on
// the stream; a build without CUDA gets no_dropout_cuda.cpp, which throws NotAvailable.
#pragma once

#include <cstdint>

#include "core/layout.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"

namespace tessera::ops {

/// t times dropout's mask of its piece `box` of a tensor of `global` shape (kept: 1 / (1 - p)).
Tensor dropout_cuda(const Tensor& t, const Shape& global, const Box& box, uint64_t seed, double p,
                    const Stream& stream);

}  // namespace tessera::ops
