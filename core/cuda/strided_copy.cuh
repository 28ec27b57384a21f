// Launch interface of the strided-copy kernel (device code in strided_copy.cu, C++17 for nvcc).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tessera::gpu::kernels {

/// Most dims a strided copy handles.
constexpr int kMaxStridedDims = 8;

/// Enqueues an N-d strided copy on `stream` (strides in elements; element_size 1/2/4/8 bytes, or
/// 16 for rows the host re-expressed in 16-byte words, see core/backend/strided_plan.hpp).
cudaError_t launch_strided_copy(void* dst, const int64_t* dst_strides, const void* src,
                                const int64_t* src_strides, const int64_t* shape, int ndim,
                                size_t element_size, cudaStream_t stream);

}  // namespace tessera::gpu::kernels
