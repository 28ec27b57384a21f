// Device code of dropout (see dropout_cuda.cuh): one thread per element, grid-stride.
#include <cstdint>

#include "ops/cuda_elements.cuh"
#include "ops/dropout/dropout_cuda.cuh"

namespace tessera::ops::kernels {

namespace {

template <typename T>
__global__ void dropout_kernel(DropoutPiece piece, int64_t count, const T* x, T* y, uint64_t seed,
                               double p, double scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t global = 0;
    int64_t rest = i;
    for (int d = piece.ndim - 1; d >= 0; --d) {
      const int64_t index = rest % piece.extent[d];
      rest /= piece.extent[d];
      global += static_cast<uint64_t>((piece.lo[d] + index) * piece.global_stride[d]);
    }
    const Compute<T> factor = static_cast<Compute<T>>(dropout_keeps(seed, global, p) ? scale : 0.0);
    y[i] = from_compute<T>(to_compute(x[i]) * factor);
  }
}

}  // namespace

cudaError_t launch_dropout(ElementType type, const DropoutPiece& piece, const void* x, void* y,
                           uint64_t seed, double p, double scale, cudaStream_t stream) {
  int64_t count = 1;
  for (int d = 0; d < piece.ndim; ++d) count *= piece.extent[d];
  if (count == 0) return cudaSuccess;
  const int64_t wanted = (count + 255) / 256;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    dropout_kernel<T><<<blocks, 256, 0, stream>>>(piece, count, static_cast<const T*>(x),
                                                  static_cast<T*>(y), seed, p, scale);
    return cudaGetLastError();
  };
  switch (type) {
    case ElementType::f32: return launch(float{});
    case ElementType::f64: return launch(double{});
    case ElementType::f16: return launch(__half{});
    case ElementType::bf16: return launch(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace tessera::ops::kernels
