// The cuda body of dropout in a build without CUDA: it throws NotAvailable.
#include "core/errors.hpp"
#include "ops/dropout/dropout_cuda.hpp"

namespace tessera::ops {

Tensor dropout_cuda(const Tensor&, const Shape&, const Box&, uint64_t, double, const Stream&) {
  throw NotAvailable("dropout", "cuda kernel asked for, but this Tessera was built without CUDA");
}

}  // namespace tessera::ops
