// Host helpers of the op kernels' cuda launches (included only by files compiled with CUDA):
// the element type of a dtype, the checks of the operands, the launch status check and the
// stream handle.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "core/errors.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"
#include "ops/pointwise/pointwise_cuda.cuh"

namespace tessera::ops {

/// The kernels' element type of a floating dtype; throws InvalidArgument tagged `op` otherwise.
inline kernels::ElementType element_type(DType dtype, const std::string& op) {
  switch (dtype) {
    case DType::f32: return kernels::ElementType::f32;
    case DType::f64: return kernels::ElementType::f64;
    case DType::f16: return kernels::ElementType::f16;
    case DType::bf16: return kernels::ElementType::bf16;
    default: break;
  }
  throw InvalidArgument(
      op, fmt::format("cuda kernel needs a floating tensor, got {}", dtype_name(dtype)));
}

/// Throws InvalidArgument tagged `op` unless every tensor is a floating cuda tensor of the first
/// one's dtype and device; then makes that device current for the launches that follow.
inline void require_cuda_operands(const std::vector<const Tensor*>& tensors,
                                  const std::string& op) {
  const Tensor& first = *tensors.front();
  TESSERA_CHECK_ARG(first.device().is_cuda(), op, "cuda kernel got a {} tensor", first.str());
  element_type(first.dtype(), op);
  for (const Tensor* tensor : tensors)
    TESSERA_CHECK_ARG(tensor->device() == first.device() && tensor->dtype() == first.dtype(), op,
                      "operands {} and {} differ in device or dtype", first.str(), tensor->str());
  gpu::set_device(first.device().index);
}

/// The cudaStream_t of a cuda Stream.
inline cudaStream_t stream_handle(const Stream& stream) {
  return static_cast<cudaStream_t>(stream.handle);
}

/// Throws Error tagged `op` when a launch failed.
inline void check_launch(cudaError_t status, const std::string& op, Device device,
                         const char* kernel) {
  if (status != cudaSuccess)
    throw Error(op, fmt::format("{} launch failed on {}: {} ({})", kernel, device.str(),
                                cudaGetErrorString(status), cudaGetErrorName(status)));
}

/// `pointer` advanced by `elements` elements of `element_size` bytes.
inline const void* advanced(const void* pointer, int64_t elements, size_t element_size) {
  return static_cast<const char*>(pointer) + elements * static_cast<int64_t>(element_size);
}

}  // namespace tessera::ops
