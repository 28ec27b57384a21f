// Launch interface of the attention block kernels (device code in attention_cuda.cu, C++17 for
// nvcc). Every launch is queued on `stream` and returns the launch status; none synchronizes.
// q, k, v, go are contiguous [batch, rows, heads, D] of one element type (f32, f64, f16, bf16);
// the softmax state and the gradients accumulate in the computation type (double for f64,
// float otherwise), written `acc` below.
#pragma once

#include <cuda_runtime.h>

#include "ops/pointwise/pointwise_cuda.cuh"
#include "ops/ring_attention/attention_block.hpp"

namespace tessera::ops::kernels {

/// The online-softmax update of every query row by the held K/V block: per row the running max
/// `peak`, the sum `total` and the output accumulator `acc` [rows, dv] (all of type acc).
cudaError_t launch_attention_forward_block(const AttentionBlock& block, ElementType type,
                                           const void* q, const void* k, const void* v, void* peak,
                                           void* total, void* acc, cudaStream_t stream);

/// o = acc / total (0 where no key was seen) and lse = peak + log(total), both of `type`.
cudaError_t launch_attention_finish(int64_t rows, int64_t dv, ElementType type, const void* peak,
                                    const void* total, const void* acc, void* o, void* lse,
                                    cudaStream_t stream);

/// Per row (acc): delta = go . o - glse (glse may be null) and lse in the computation type.
cudaError_t launch_attention_backward_prepare(int64_t rows, int64_t dv, ElementType type,
                                              const void* o, const void* go, const void* lse,
                                              const void* glse, void* delta, void* lse_acc,
                                              cudaStream_t stream);

/// The gradients of one block (FlashAttention's backward given lse): dq [rows, d] += scale ds k,
/// and the travelling block's dk += scale ds q, dv += p go (atomically; acc).
cudaError_t launch_attention_backward_block(const AttentionBlock& block, ElementType type,
                                            const void* q, const void* k, const void* v,
                                            const void* go, const void* lse_acc, const void* delta,
                                            void* dq, void* dk, void* dv, cudaStream_t stream);

}  // namespace tessera::ops::kernels
