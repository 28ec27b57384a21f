// The cuda bodies of attention's block step (host side): attention_cuda.cpp launches the kernels
// of attention_cuda.cu on the stream; a build without CUDA gets no_attention_cuda.cpp, which
// throws NotAvailable. The ring around them (passing blocks, moving rows) is the op's
// (ring_attention_op.cpp); these functions see one rank's tensors only.
#pragma once

#include <utility>

#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"
#include "ops/ring_attention/attention_block.hpp"

namespace tessera::ops {

/// The dtype the kernels accumulate `dtype` in: f64 for f64, f32 otherwise.
DType attention_accumulation_dtype(DType dtype);

/// A ring forward's state on the device, in the accumulation dtype: per query row the running
/// max `peak` and sum `total` ([rows]) and the output accumulator `acc` ([rows, dv]).
struct AttentionState {
  Tensor peak, total, acc;
};

/// The state before any block: peak -inf, total and acc 0.
AttentionState attention_state_cuda(int64_t rows, int64_t dv, DType dtype, Device device,
                                    const Stream& stream);

/// The online-softmax update of `state` by the held block k, v (contiguous, q's dtype).
void attention_forward_block_cuda(const kernels::AttentionBlock& block, const Tensor& q,
                                  const Tensor& k, const Tensor& v, AttentionState& state,
                                  const Stream& stream);

/// o (`o_shape`) and lse (`lse_shape`) of `dtype` from the final state.
std::pair<Tensor, Tensor> attention_finish_cuda(const AttentionState& state, const Shape& o_shape,
                                                const Shape& lse_shape, DType dtype,
                                                const Stream& stream);

/// Per query row (accumulation dtype): delta = go . o - glse (glse may be undefined) and lse.
std::pair<Tensor, Tensor> attention_backward_prepare_cuda(const Tensor& o, const Tensor& go,
                                                          const Tensor& lse, const Tensor* glse,
                                                          const Stream& stream);

/// dq += the block's part; the held block's dk, dv (accumulation dtype) += theirs.
void attention_backward_block_cuda(const kernels::AttentionBlock& block, const Tensor& q,
                                   const Tensor& k, const Tensor& v, const Tensor& go,
                                   const Tensor& lse_acc, const Tensor& delta, Tensor& dq,
                                   Tensor& dk, Tensor& dv, const Stream& stream);

}  // namespace tessera::ops
