// The cuda body of dropout (see dropout_cuda.hpp).
#include "ops/dropout/dropout_cuda.hpp"

#include "ops/cuda_support.hpp"
#include "ops/dropout/dropout_cuda.cuh"

namespace tessera::ops {

Tensor dropout_cuda(const Tensor& t_in, const Shape& global, const Box& box, uint64_t seed,
                    double p, const Stream& stream) {
  require_cuda_operands({&t_in}, "dropout");
  check_arg(global.size() <= kernels::kDropoutDims, "dropout",
            "a {}-d tensor (the cuda kernel takes at most {} dims)", global.size(),
            kernels::kDropoutDims);
  const Tensor t = t_in.contiguous();
  Tensor y = Tensor::empty(t.shape(), t.dtype(), t.device());
  kernels::DropoutPiece piece;
  piece.ndim = static_cast<int>(global.size());
  const std::vector<int64_t> strides = contiguous_strides(global);
  for (int d = 0; d < piece.ndim; ++d) {
    piece.extent[d] = t.shape()[d];
    piece.lo[d] = box.lo[d];
    piece.global_stride[d] = strides[d];
  }
  check_launch(
      kernels::launch_dropout(element_type(t.dtype(), "dropout"), piece, t.raw_data(), y.raw_data(),
                              seed, p, p < 1 ? 1 / (1 - p) : 0.0, stream_handle(stream)),
      "dropout", t.device(), "mask");
  return y;
}

}  // namespace tessera::ops
