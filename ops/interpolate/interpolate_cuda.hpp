// The cuda bodies of interpolate (host side): interpolate_cuda.cpp launches the kernels of
// interpolate_cuda.cu on the given stream; a build without CUDA gets no_interpolate_cuda.cpp,
// where every function throws NotAvailable. Results are new contiguous tensors on the input's
// device; nothing synchronizes.
#pragma once

#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"
#include "ops/interpolate/interpolate_taps.hpp"

namespace tessera::ops {

/// y [N, C, out..] = the interpolation of the haloed piece x [N, C, in..] under `plan`.
Tensor interpolate_forward_cuda(const kernels::InterpPlan& plan, const Tensor& x,
                                const Shape& y_shape, const Stream& stream);

/// dx (`x_shape`, gy's dtype and device) from gy, as interpolate_backward_cpu computes it (atomic
/// adds: the order of the sums, and so the last bits of dx, may change from run to run).
Tensor interpolate_backward_cuda(const kernels::InterpPlan& plan, const Shape& x_shape,
                                 const Tensor& gy, const Stream& stream);

}  // namespace tessera::ops
