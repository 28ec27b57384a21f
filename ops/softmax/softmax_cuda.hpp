// The cuda bodies of softmax and log_softmax (host side): softmax_cuda.cpp launches the kernels
// of softmax_cuda.cu on the stream and combines the per-slot statistics over a communicator on
// device buffers; a build without CUDA gets no_softmax_cuda.cpp, which throws NotAvailable.
#pragma once

#include <cstdint>

#include "core/comm/comm.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"

namespace tessera::ops {

/// A local piece as [outer, length, inner] around the softmax dim.
struct SoftmaxPiece {
  int64_t outer = 1, length = 1, inner = 1;
};

/// Collective over `comm` when given (the ranks sharding the dim): y of x on its device.
Tensor softmax_forward_cuda(const Tensor& x, const SoftmaxPiece& piece, Comm* comm, bool log,
                            const Stream& stream);

/// Collective over `comm` when given: the gradient of x from y and g.
Tensor softmax_backward_cuda(const Tensor& y, const Tensor& g, const SoftmaxPiece& piece,
                             Comm* comm, bool log, const Stream& stream);

}  // namespace tessera::ops
