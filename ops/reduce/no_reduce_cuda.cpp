// The cuda bodies of the reductions in a build without CUDA: each throws NotAvailable.
#include "core/errors.hpp"
#include "ops/reduce/reduce_cuda.hpp"

namespace tessera::ops {

namespace {
[[noreturn]] void not_built(const std::string& op) {
  throw NotAvailable(op, "cuda kernel asked for, but this Tessera was built without CUDA");
}
}  // namespace

void sum_into_cuda(const Tensor&, const std::vector<bool>&, void*, const std::vector<int64_t>&,
                   double, const Stream&, const std::string& op) {
  not_built(op);
}

Tensor sum_cuda(const Tensor&, const std::vector<int64_t>&, double, const Stream&,
                const std::string& op) {
  not_built(op);
}

Tensor squared_difference_sum_cuda(const Tensor&, const Tensor&, double, const Stream&) {
  not_built("mse_loss");
}

Tensor broadcast_back_cuda(const Tensor&, const Shape&, double, const Stream&,
                           const std::string& op) {
  not_built(op);
}

std::pair<Tensor, Tensor> mse_backward_cuda(const Tensor&, const Tensor&, const Tensor&, double,
                                            const Stream&) {
  not_built("mse_loss");
}

}  // namespace tessera::ops
