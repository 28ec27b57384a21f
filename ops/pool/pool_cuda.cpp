// The cuda bodies of the pooling ops (see pool_cuda.hpp): operand checks, then the launches of
// pool_cuda.cu on the stream.
#include "ops/pool/pool_cuda.hpp"

#include <optional>

#include "ops/cuda_support.hpp"
#include "ops/pool/pool_cuda.cuh"

namespace tessera::ops {

namespace {
const char* op_name(const kernels::PoolWindows& windows) {
  return windows.kind == kernels::PoolKind::max ? "max_pool" : "avg_pool";
}
}  // namespace

std::vector<Tensor> pool_forward_cuda(const kernels::PoolWindows& windows, const Tensor& x,
                                      const Shape& y_shape, const Stream& stream) {
  const char* op = op_name(windows);
  require_cuda_operands({&x}, op);
  const bool max = windows.kind == kernels::PoolKind::max;
  const Tensor input = x.contiguous();
  Tensor y = Tensor::empty(y_shape, x.dtype(), x.device());
  Tensor indices = max ? Tensor::empty(y_shape, DType::i64, x.device()) : Tensor();
  if (y.numel() > 0)
    check_launch(
        kernels::launch_pool_forward(
            windows, element_type(x.dtype(), op), input.raw_data(), y.raw_data(),
            max ? static_cast<int64_t*>(indices.raw_data()) : nullptr, stream_handle(stream)),
        op, x.device(), "pooling forward");
  std::vector<Tensor> outputs{std::move(y)};
  if (max) outputs.push_back(std::move(indices));
  return outputs;
}

Tensor pool_backward_cuda(const kernels::PoolWindows& windows, const Tensor& x, const Tensor& gy,
                          const Stream& stream) {
  const char* op = op_name(windows);
  require_cuda_operands({&x, &gy}, op);
  const Tensor input = x.contiguous(), grad = gy.contiguous();
  Tensor dx = Tensor::empty(input.shape(), x.dtype(), x.device());
  if (dx.numel() == 0) return dx;
  // The argmax scratch (max only): its storage goes back to the device's stream-ordered
  // allocator, so it is not reused before the queued kernels have read it.
  std::optional<Tensor> argmax;
  if (windows.kind == kernels::PoolKind::max)
    argmax = Tensor::empty(grad.shape(), DType::i64, x.device());
  check_launch(
      kernels::launch_pool_backward(
          windows, element_type(x.dtype(), op), input.raw_data(), grad.raw_data(), dx.raw_data(),
          argmax ? static_cast<int64_t*>(argmax->raw_data()) : nullptr, stream_handle(stream)),
      op, x.device(), "pooling backward");
  return dx;
}

}  // namespace tessera::ops
