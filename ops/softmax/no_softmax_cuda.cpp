// The cuda bodies of softmax and log_softmax in a build without CUDA: they throw NotAvailable.
#include "core/errors.hpp"
#include "ops/softmax/softmax_cuda.hpp"

namespace tessera::ops {

Tensor softmax_forward_cuda(const Tensor&, const SoftmaxPiece&, Comm*, bool log, const Stream&) {
  throw NotAvailable(log ? "log_softmax" : "softmax",
                     "cuda kernel asked for, but this Tessera was built without CUDA");
}

Tensor softmax_backward_cuda(const Tensor&, const Tensor&, const SoftmaxPiece&, Comm*, bool log,
                             const Stream&) {
  throw NotAvailable(log ? "log_softmax" : "softmax",
                     "cuda kernel asked for, but this Tessera was built without CUDA");
}

}  // namespace tessera::ops
