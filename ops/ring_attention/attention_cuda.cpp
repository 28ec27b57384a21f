// The cuda bodies of attention's block step (see attention_cuda.hpp): operand checks, then the
// launches of attention_cuda.cu on the stream.
#include "ops/ring_attention/attention_cuda.hpp"

#include <limits>

#include "core/backend/backend.hpp"
#include "ops/cuda_support.hpp"
#include "ops/ring_attention/attention_cuda.cuh"

namespace tessera::ops {

namespace {

constexpr const char* kOp = "attention";

Tensor filled(const Shape& shape, DType dtype, Device device, double value, const Stream& stream) {
  Tensor t = Tensor::empty(shape, dtype, device);
  if (t.numel() > 0) backend_for(device).fill(strided_ref(t), dtype, value, stream);
  return t;
}

}  // namespace

AttentionState attention_state_cuda(int64_t rows, int64_t dv, DType dtype, Device device,
                                    const Stream& stream) {
  const DType acc = attention_accumulation_dtype(dtype);
  return {filled({rows}, acc, device, -std::numeric_limits<double>::infinity(), stream),
          filled({rows}, acc, device, 0.0, stream), filled({rows, dv}, acc, device, 0.0, stream)};
}

void attention_forward_block_cuda(const kernels::AttentionBlock& block, const Tensor& q,
                                  const Tensor& k, const Tensor& v, AttentionState& state,
                                  const Stream& stream) {
  require_cuda_operands({&q, &k, &v}, kOp);
  check_launch(kernels::launch_attention_forward_block(
                   block, element_type(q.dtype(), kOp), q.raw_data(), k.raw_data(), v.raw_data(),
                   state.peak.raw_data(), state.total.raw_data(), state.acc.raw_data(),
                   stream_handle(stream)),
               kOp, q.device(), "attention forward block");
}

std::pair<Tensor, Tensor> attention_finish_cuda(const AttentionState& state, const Shape& o_shape,
                                                const Shape& lse_shape, DType dtype,
                                                const Stream& stream) {
  Tensor o = Tensor::empty(o_shape, dtype, state.acc.device());
  Tensor lse = Tensor::empty(lse_shape, dtype, state.acc.device());
  check_launch(kernels::launch_attention_finish(
                   state.peak.numel(), state.acc.numel() / std::max<int64_t>(state.peak.numel(), 1),
                   element_type(dtype, kOp), state.peak.raw_data(), state.total.raw_data(),
                   state.acc.raw_data(), o.raw_data(), lse.raw_data(), stream_handle(stream)),
               kOp, o.device(), "attention finish");
  return {o, lse};
}

std::pair<Tensor, Tensor> attention_backward_prepare_cuda(const Tensor& o, const Tensor& go,
                                                          const Tensor& lse, const Tensor* glse,
                                                          const Stream& stream) {
  require_cuda_operands({&o, &go, &lse}, kOp);
  const int64_t rows = lse.numel();
  const DType acc = attention_accumulation_dtype(o.dtype());
  Tensor delta = Tensor::empty({rows}, acc, o.device());
  Tensor lse_acc = Tensor::empty({rows}, acc, o.device());
  check_launch(
      kernels::launch_attention_backward_prepare(
          rows, o.numel() / std::max<int64_t>(rows, 1), element_type(o.dtype(), kOp), o.raw_data(),
          go.raw_data(), lse.raw_data(), glse != nullptr ? glse->raw_data() : nullptr,
          delta.raw_data(), lse_acc.raw_data(), stream_handle(stream)),
      kOp, o.device(), "attention backward prepare");
  return {delta, lse_acc};
}

void attention_backward_block_cuda(const kernels::AttentionBlock& block, const Tensor& q,
                                   const Tensor& k, const Tensor& v, const Tensor& go,
                                   const Tensor& lse_acc, const Tensor& delta, Tensor& dq,
                                   Tensor& dk, Tensor& dv, const Stream& stream) {
  require_cuda_operands({&q, &k, &v, &go}, kOp);
  check_launch(kernels::launch_attention_backward_block(
                   block, element_type(q.dtype(), kOp), q.raw_data(), k.raw_data(), v.raw_data(),
                   go.raw_data(), lse_acc.raw_data(), delta.raw_data(), dq.raw_data(),
                   dk.raw_data(), dv.raw_data(), stream_handle(stream)),
               kOp, q.device(), "attention backward block");
}

}  // namespace tessera::ops
