// Device kernel for N-d strided copies (pack/unpack of boxes, contiguous(), copy_from).
// One thread per element; the multi-index is recomputed from the flat destination index,
// which keeps one kernel correct for every rank up to kMaxStridedDims.
#include <algorithm>

#include "core/cuda/strided_copy.cuh"

namespace tessera::gpu::kernels {

namespace {

struct StridedShape {
  int64_t extent[kMaxStridedDims];
  int64_t dst_stride[kMaxStridedDims];
  int64_t src_stride[kMaxStridedDims];
  int ndim;
};

template <typename Word>
__global__ void strided_copy_kernel(Word* dst, const Word* src, StridedShape shape, int64_t count) {
  for (int64_t flat = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; flat < count;
       flat += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = flat, dst_offset = 0, src_offset = 0;
    for (int d = shape.ndim - 1; d >= 0; --d) {
      const int64_t index = rest % shape.extent[d];
      rest /= shape.extent[d];
      dst_offset += index * shape.dst_stride[d];
      src_offset += index * shape.src_stride[d];
    }
    dst[dst_offset] = src[src_offset];
  }
}

template <typename Word>
void launch(void* dst, const void* src, const StridedShape& shape, int64_t count,
            cudaStream_t stream) {
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads, int64_t{65535} * 8);
  strided_copy_kernel<Word><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      static_cast<Word*>(dst), static_cast<const Word*>(src), shape, count);
}

}  // namespace

cudaError_t launch_strided_copy(void* dst, const int64_t* dst_strides, const void* src,
                                const int64_t* src_strides, const int64_t* shape, int ndim,
                                size_t element_size, cudaStream_t stream) {
  if (ndim > kMaxStridedDims) return cudaErrorInvalidValue;
  StridedShape layout{};
  layout.ndim = ndim;
  int64_t count = 1;
  for (int d = 0; d < ndim; ++d) {
    layout.extent[d] = shape[d];
    layout.dst_stride[d] = dst_strides[d];
    layout.src_stride[d] = src_strides[d];
    count *= shape[d];
  }
  if (count == 0) return cudaSuccess;
  switch (element_size) {
    case 1: launch<uint8_t>(dst, src, layout, count, stream); break;
    case 2: launch<uint16_t>(dst, src, layout, count, stream); break;
    case 4: launch<uint32_t>(dst, src, layout, count, stream); break;
    case 8: launch<uint64_t>(dst, src, layout, count, stream); break;
    case 16: launch<uint4>(dst, src, layout, count, stream); break;  // vectorized rows
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace tessera::gpu::kernels
