// Launch interface of the dropout cuda kernel (device code in dropout_cuda.cu, C++17 for nvcc).
#pragma once

#include <cuda_runtime.h>

#include "ops/dropout/dropout_mask.hpp"
#include "ops/pointwise/pointwise_cuda.cuh"

namespace tessera::ops::kernels {

/// y = x * (kept ? scale : 0) over a contiguous piece, the mask bit of each element from its
/// global index (dropout_mask.hpp). Queued on `stream`.
cudaError_t launch_dropout(ElementType type, const DropoutPiece& piece, const void* x, void* y,
                           uint64_t seed, double p, double scale, cudaStream_t stream);

}  // namespace tessera::ops::kernels
