// Launch interface of the neighborhood attention cuda kernels (device code in na_cuda.cu, C++17
// for nvcc). Every launch is queued on `stream` and returns the launch status; none
// synchronizes. Elements are f32, f64, f16 or bf16; the computation (and lse, glse, the
// backward's per-row scratch) is in float for f32/f16/bf16 and in double for f64. Operands are
// contiguous, shaped as NaCall says; rpb and drpb have q's element type.
#pragma once

#include <cuda_runtime.h>

#include "ops/attention/na_cuda_plan.hpp"
#include "ops/pointwise/pointwise_cuda.cuh"

namespace tessera::ops::kernels {

/// Operands of the forward (rpb: null without a bias).
struct NaForwardArgs {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *rpb = nullptr;
  void *o = nullptr, *lse = nullptr;
  int mma_blocks = 4;  ///< the mma forward's blocks per SM (parse_na_mma_forward_blocks; 0: auto)
};

/// Operands of the backward: the forward's inputs, o (the fused kernel's delta' = go . o - glse;
/// null: the plain kernel runs) and lse, the gradients go of o and glse of lse (null: none), the
/// outputs dq, dk, dv (the tile's shape, every row written) and drpb (with rpb), and `delta`,
/// scratch of one compute value per (query, head).
struct NaBackwardArgs {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *rpb = nullptr, *o = nullptr, *lse = nullptr;
  const void *go = nullptr, *glse = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *drpb = nullptr, *delta = nullptr;
};

/// o and lse of `call` with kernel `kernel` (fused: the caller checked choose_na_kernel).
cudaError_t launch_na_forward(NaKernel kernel, const NaCall& call, ElementType type,
                              const NaForwardArgs& args, cudaStream_t stream);

/// o and lse of `call` with the register-tiled forward (na_cuda_mma.cu): f16/bf16, head dim 32,
/// 64 or 128, the calls the fused kernel takes.
cudaError_t launch_na_forward_mma(const NaCall& call, ElementType type, const NaForwardArgs& args,
                                  cudaStream_t stream);

/// The dynamic shared memory one block of the mma forward (backward) kernels takes for `call`:
/// the fixed layout and the membership tables, which grow with kernel x dilation. A call whose
/// bytes exceed the device's opt-in limit runs the fused kernels instead.
size_t na_mma_shared_bytes(const NaCall& call, bool backward);

/// dq, dk and dv of `call` with the register-tiled backward kernels (na_cuda_mma.cu): f16/bf16,
/// head dim 32, 64 or 128; reads args.lse and args.delta (delta' = go . o - glse per (query,
/// head), already computed on the stream); d rpb is not theirs.
cudaError_t launch_na_backward_mma(const NaCall& call, ElementType type, const NaBackwardArgs& args,
                                   cudaStream_t stream);

/// dq, dk, dv (and drpb) of `call` with kernel `kernel`; deterministic (no atomics: dq per
/// query, dk and dv per key over the queries whose window holds it, drpb per bias entry).
cudaError_t launch_na_backward(NaKernel kernel, const NaCall& call, ElementType type,
                               const NaBackwardArgs& args, cudaStream_t stream);

}  // namespace tessera::ops::kernels
