// Cost functions of the built-in ops' local kernels (OpDef::cost): the floating-point
// operations and bytes read plus written of one call, from the local (haloed) input and output
// shapes and the attributes. They count the arithmetic of the textbook algorithm (2 flops per
// multiply-add), not what a particular library does, so that a trace costs the same on every
// device; the calibrated throughputs of the cost model absorb each library's efficiency.
#pragma once

#include <vector>

#include "core/op_registry.hpp"

namespace tessera::ops {

/// Bytes of `tensors` (numel times element size).
double bytes_of(const std::vector<Tensor>& tensors);

/// conv: 2 * |y| * (C/groups) * prod(k); w [Cout, C/groups, k..].
OpCost conv_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
                 const std::vector<Tensor>& outputs);
/// conv_transpose: 2 * |x| * (Cout/groups) * prod(k); w [C, Cout/groups, k..].
OpCost conv_transpose_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
                           const std::vector<Tensor>& outputs);
/// linear and matmul: 2 * |y| * K (K: the last dim of the first input).
OpCost matmul_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
                   const std::vector<Tensor>& outputs);
/// na: 4 * |q| * prod(kernel_size) (q.k and the weighted sum of v over each window).
OpCost na_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
               const std::vector<Tensor>& outputs);
/// attention over the whole sequence: 4 * |q| * S_k (S_k: the global key length).
OpCost attention_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
                      const std::vector<Tensor>& outputs);
/// Norms: 8 flops per element of x (two reductions, normalize, scale and shift).
OpCost norm_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
                 const std::vector<Tensor>& outputs);
/// Pointwise: one flop per output element and input.
OpCost pointwise_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
                      const std::vector<Tensor>& outputs);
/// Pools: |y| * prod(kernel_size) (one compare or add per window cell).
OpCost pool_cost(const KernelContext& context, const std::vector<Tensor>& inputs,
                 const std::vector<Tensor>& outputs);

}  // namespace tessera::ops
