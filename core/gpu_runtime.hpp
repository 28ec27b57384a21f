// The few CUDA runtime services the core needs (device memory, copies, strided copy kernels),
// behind plain C++ declarations. Built from core/cuda/ when CUDA is enabled, from
// core/cuda/no_cuda.cpp otherwise (where every call but the queries throws NotAvailable).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera::gpu {

/// True when Tessera was built with CUDA.
bool compiled();
/// Number of visible CUDA devices (0 without CUDA, a driver or a GPU).
int device_count();
/// CUDA runtime version as "13.0", or "" when not built with CUDA.
std::string runtime_version();
/// cuDNN version as "9.14.0", or "" when not linked.
std::string cudnn_version();

/// Allocates `bytes` on `device` (synchronous).
void* allocate(size_t bytes, int device);
/// Frees memory from allocate().
void release(void* pointer, int device) noexcept;
/// Copies `bytes` between any two of host/device pointers (unified addressing), synchronously.
void copy_bytes(void* dst, const void* src, size_t bytes);
/// Sets `bytes` device bytes to zero.
void zero_bytes(void* dst, size_t bytes, int device);

/// N-d strided copy of elements of `element_size` bytes, where both pointers are device
/// pointers on `device`; strides are in elements. Synchronous.
void copy_strided(void* dst, const int64_t* dst_strides, const void* src,
                  const int64_t* src_strides, const int64_t* shape, int ndim, size_t element_size,
                  int device);

}  // namespace tessera::gpu
