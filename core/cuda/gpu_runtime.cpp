// The CUDA runtime layer (host side): device queries, memory and synchronous copies.
#include "core/gpu_runtime.hpp"

#include <cuda_runtime.h>

#include "core/cuda/check.hpp"
#include "core/cuda/strided_copy.cuh"

namespace tessera::gpu {

bool compiled() {
  return true;
}

int device_count() {
  int count = 0;
  // No driver or no GPU is not an error here: the answer is simply zero devices.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::string runtime_version() {
  int version = 0;
  cudaRuntimeGetVersion(&version);
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

void* allocate(size_t bytes, int device) {
  TESSERA_CUDA_CHECK(cudaSetDevice(device), device);
  void* pointer = nullptr;
  TESSERA_CUDA_CHECK(cudaMalloc(&pointer, bytes), device);
  return pointer;
}

void release(void* pointer, int device) noexcept {
  if (cudaSetDevice(device) == cudaSuccess) cudaFree(pointer);
}

void* allocate_pinned(size_t bytes) {
  void* pointer = nullptr;
  TESSERA_CUDA_CHECK(cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable), -1);
  return pointer;
}

void release_pinned(void* pointer) noexcept {
  if (pointer) cudaFreeHost(pointer);
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes) TESSERA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), -1);
}

void zero_bytes(void* dst, size_t bytes, int device) {
  TESSERA_CUDA_CHECK(cudaSetDevice(device), device);
  TESSERA_CUDA_CHECK(cudaMemset(dst, 0, bytes), device);
}

}  // namespace tessera::gpu

namespace tessera::gpu {

void copy_strided(void* dst, const int64_t* dst_strides, const void* src,
                  const int64_t* src_strides, const int64_t* shape, int ndim, size_t element_size,
                  int device) {
  check_arg(ndim <= kernels::kMaxStridedDims, "cuda",
            "strided copy of a {}-d tensor (at most {} dims)", ndim, kernels::kMaxStridedDims);
  TESSERA_CUDA_CHECK(cudaSetDevice(device), device);
  TESSERA_CUDA_CHECK(kernels::launch_strided_copy(dst, dst_strides, src, src_strides, shape, ndim,
                                                  element_size, nullptr),
                     device);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(nullptr), device);
}

}  // namespace tessera::gpu
