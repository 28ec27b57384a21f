// The cuda bodies of the pooling ops (host side): pool_cuda.cpp launches the kernels of
// pool_cuda.cu on the given stream; a build without CUDA gets no_pool_cuda.cpp, where every
// function throws NotAvailable. Results are new contiguous tensors on the input's device;
// nothing synchronizes.
#pragma once

#include <vector>

#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"
#include "ops/pool/pool_windows.hpp"

namespace tessera::ops {

/// y [N, C, out..] = the pooling of the haloed piece x [N, C, in..] over `windows`, and for max
/// its indices, as pool_forward_cpu returns them.
std::vector<Tensor> pool_forward_cuda(const kernels::PoolWindows& windows, const Tensor& x,
                                      const Shape& y_shape, const Stream& stream);

/// dx (x's shape) from gy, as pool_backward_cpu computes it.
Tensor pool_backward_cuda(const kernels::PoolWindows& windows, const Tensor& x, const Tensor& gy,
                          const Stream& stream);

}  // namespace tessera::ops
