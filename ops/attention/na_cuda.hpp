// The cuda bodies of neighborhood attention (host side): na_cuda.cpp checks the operands and
// launches the kernels of na_cuda.cu on the given stream; a build without CUDA gets
// no_na_cuda.cpp, where every function throws NotAvailable. Same arguments and outputs as the
// cpu kernels (na_cpu.hpp) plus the stream; results are new tensors on q's device and nothing
// synchronizes.
#pragma once

#include <optional>

#include "core/runtime/rank_context.hpp"
#include "ops/attention/na_cuda_plan.hpp"
#include "ops/attention/na_reference.hpp"

namespace tessera::ops {

/// The kernel na_cuda_forward picks for q (the dispatch of choose_na_kernel).
kernels::NaKernel na_cuda_kernel_for(const Tensor& q);

/// The mma forward's blocks per SM (TESSERA_NA_MMA_FORWARD_BLOCKS, parse_na_mma_forward_blocks;
/// 0: auto).
int na_cuda_mma_forward_blocks();

/// Forward like na_forward on cuda tensors q, k, v (rpb: on the same device, any floating
/// dtype). `kernel` forces a kernel (the fused one only where na_cuda_kernel_for picks it);
/// by default the dispatch picks it.
NaForward na_cuda_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                          const NaGeometry& geometry, const NaPieces& pieces, const Stream& stream,
                          std::optional<kernels::NaKernel> kernel = std::nullopt);

/// Backward like na_backward, from the forward's `output` and `lse` (the probabilities are
/// recomputed as exp(s - lse); the fused kernel takes delta = go . o from `output`, and without
/// it (nullptr) the plain kernel runs); deterministic: the same inputs give the same bits.
NaGradients na_cuda_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                             const Tensor* output, const Tensor& lse, const Tensor& grad_output,
                             const Tensor* grad_lse, const NaGeometry& geometry,
                             const NaPieces& pieces, const Stream& stream,
                             std::optional<kernels::NaKernel> kernel = std::nullopt);

}  // namespace tessera::ops
