// The cuda bodies of pad (host side): pad_cuda.cpp launches the kernels of
// pad_cuda.cu on the given stream; a build without CUDA gets no_pad_cuda.cpp,
// where every function throws NotAvailable. Results are new contiguous tensors on the input's
// device; nothing synchronizes.
#pragma once

#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"
#include "ops/pad/pad_taps.hpp"

namespace tessera::ops {

/// y (`y_shape`) = the padding of the haloed piece x under `plan`.
Tensor pad_forward_cuda(const kernels::PadPlan& plan, const Tensor& x, const Shape& y_shape,
                        const Stream& stream);

/// dx (`x_shape`, gy's dtype and device) from gy, as pad_backward_cpu computes it (atomic
/// adds: the order of the sums, and so the last bits of dx, may change from run to run).
Tensor pad_backward_cuda(const kernels::PadPlan& plan, const Shape& x_shape, const Tensor& gy,
                         const Stream& stream);

}  // namespace tessera::ops
