// The cuda bodies of pad (see pad_cuda.hpp): operand checks, then the launches of
// pad_cuda.cu on the stream.
#include "ops/pad/pad_cuda.hpp"

#include "core/backend/backend.hpp"
#include "ops/cuda_support.hpp"
#include "ops/pad/pad_cuda.cuh"

namespace tessera::ops {

namespace {
constexpr const char* kOp = "pad";
}  // namespace

Tensor pad_forward_cuda(const kernels::PadPlan& plan, const Tensor& x, const Shape& y_shape,
                        const Stream& stream) {
  require_cuda_operands({&x}, kOp);
  const Tensor input = x.contiguous();
  Tensor y = Tensor::empty(y_shape, x.dtype(), x.device());
  if (y.numel() == 0) return y;
  check_launch(kernels::launch_pad_forward(plan, element_type(x.dtype(), kOp), input.raw_data(),
                                           y.raw_data(), stream_handle(stream)),
               kOp, x.device(), "pad forward");
  return y;
}

Tensor pad_backward_cuda(const kernels::PadPlan& plan, const Shape& x_shape, const Tensor& gy,
                         const Stream& stream) {
  require_cuda_operands({&gy}, kOp);
  const Tensor grad = gy.contiguous();
  // Summed in the computation type (f32 for f16/bf16), rounded once at the end.
  const bool half = gy.dtype() == DType::f16 || gy.dtype() == DType::bf16;
  Tensor dx = Tensor::empty(x_shape, half ? DType::f32 : gy.dtype(), gy.device());
  if (dx.numel() == 0) return half ? dx.to_dtype(gy.dtype()) : dx;
  backend_for(dx.device()).fill(strided_ref(dx), dx.dtype(), 0.0, stream);
  check_launch(kernels::launch_pad_backward(plan, element_type(gy.dtype(), kOp), grad.raw_data(),
                                            dx.raw_data(), stream_handle(stream)),
               kOp, gy.device(), "pad backward");
  return half ? dx.to_dtype(gy.dtype()) : dx;
}

}  // namespace tessera::ops
