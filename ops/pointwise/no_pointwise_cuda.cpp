// The cuda bodies of the pointwise ops in a build without CUDA: each throws NotAvailable.
#include "core/errors.hpp"
#include "ops/pointwise/pointwise_cuda.hpp"

namespace tessera::ops {

namespace {
[[noreturn]] void not_built(const std::string& op) {
  throw NotAvailable(op, "cuda kernel asked for, but this Tessera was built without CUDA");
}
}  // namespace

Tensor unary_forward_cuda(const std::string& name, const Tensor&, double, double, const Stream&) {
  not_built(name);
}

Tensor unary_backward_cuda(const std::string& name, const Tensor&, const Tensor&, const Tensor&,
                           double, double, const Stream&) {
  not_built(name);
}

Tensor binary_forward_cuda(const std::string& name, const Tensor&, const Tensor&,
                           const OperandView&, bool, const Stream&) {
  not_built(name);
}

std::pair<Tensor, Tensor> binary_backward_cuda(const std::string& name, const Tensor&,
                                               const Tensor&, const OperandView&, const Tensor&,
                                               bool, const Stream&) {
  not_built(name);
}

Tensor where_forward_cuda(const Tensor&, const Tensor&, const Tensor&, const Stream&) {
  not_built("where");
}

std::pair<Tensor, Tensor> where_backward_cuda(const Tensor&, const Tensor&, const Stream&) {
  not_built("where");
}

Tensor reduce_to_operand_cuda(const Tensor&, const Shape&, const Box&, int, const Stream&) {
  not_built("reduce_to_operand");
}

}  // namespace tessera::ops
