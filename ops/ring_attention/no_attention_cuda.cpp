// The cuda bodies of attention's block step in a build without CUDA: they throw NotAvailable.
#include "core/errors.hpp"
#include "ops/ring_attention/attention_cuda.hpp"

namespace tessera::ops {

namespace {
[[noreturn]] void unavailable() {
  throw NotAvailable("attention", "cuda kernel asked for, but this Tessera was built without CUDA");
}
}  // namespace

AttentionState attention_state_cuda(int64_t, int64_t, DType, Device, const Stream&) {
  unavailable();
}
void attention_forward_block_cuda(const kernels::AttentionBlock&, const Tensor&, const Tensor&,
                                  const Tensor&, AttentionState&, const Stream&) {
  unavailable();
}
std::pair<Tensor, Tensor> attention_finish_cuda(const AttentionState&, const Shape&, const Shape&,
                                                DType, const Stream&) {
  unavailable();
}
std::pair<Tensor, Tensor> attention_backward_prepare_cuda(const Tensor&, const Tensor&,
                                                          const Tensor&, const Tensor*,
                                                          const Stream&) {
  unavailable();
}
void attention_backward_block_cuda(const kernels::AttentionBlock&, const Tensor&, const Tensor&,
                                   const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   Tensor&, Tensor&, Tensor&, const Stream&) {
  unavailable();
}

}  // namespace tessera::ops
