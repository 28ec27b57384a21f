// The cuda bodies of sum, mean and mse_loss and of their gradients (host side): reduce_cuda.cpp
// launches the kernels of reduce_cuda.cu and pointwise_cuda.cu on the given stream; a build
// without CUDA gets no_reduce_cuda.cpp, where every function throws NotAvailable. Sums are
// deterministic (ops/reduce/reduce_plan.hpp) and accumulate in float for f16, bf16 and f32, in
// double for f64. Nothing synchronizes.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"

namespace tessera::ops {

/// scale * the sum of x over the dims where reduced[d] (any strides), written at `out` (a device
/// pointer to x's dtype) with strides `out_strides` (one per dim of x; reduced dims ignored).
void sum_into_cuda(const Tensor& x, const std::vector<bool>& reduced, void* out,
                   const std::vector<int64_t>& out_strides, double scale, const Stream& stream,
                   const std::string& op);

/// scale * the sum of x over `dims` (sorted, distinct), in the keepdim shape.
Tensor sum_cuda(const Tensor& x, const std::vector<int64_t>& dims, double scale,
                const Stream& stream, const std::string& op);

/// scale * the sum of (a - b)^2 over every element, fused (a 0-d tensor).
Tensor squared_difference_sum_cuda(const Tensor& a, const Tensor& b, double scale,
                                   const Stream& stream);

/// g (a keepdim shape: extent 1 along the reduced dims) broadcast to `shape`, times scale.
Tensor broadcast_back_cuda(const Tensor& g, const Shape& shape, double scale, const Stream& stream,
                           const std::string& op);

/// The mse_loss gradients da = factor * (a - b) * g and db = -da in one pass, with g the
/// one-element loss gradient on the device (factor = 2 / the global element count).
std::pair<Tensor, Tensor> mse_backward_cuda(const Tensor& a, const Tensor& b, const Tensor& g,
                                            double factor, const Stream& stream);

}  // namespace tessera::ops
