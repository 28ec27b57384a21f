// The CUDA runtime layer (host side): device queries, streams, events, memory and copies.
// Thin wrappers: each turns a failed call into an Error naming the call, the device and the op.
#include "core/gpu_runtime.hpp"

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <atomic>

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

std::string driver_version() {
  int version = 0;
  if (cudaDriverGetVersion(&version) != cudaSuccess || version == 0) {
    cudaGetLastError();
    return "";
  }
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

std::string device_description(int index) {
  cudaDeviceProp properties{};
  TESSERA_CUDA_CHECK(cudaGetDeviceProperties(&properties, index), index);
  return fmt::format("{}, {:.0f} GiB, sm_{}{}", properties.name,
                     static_cast<double>(properties.totalGlobalMem) / (1 << 30), properties.major,
                     properties.minor);
}

void check_device(int index, const std::string& op) {
  const int count = device_count();
  check_arg(index >= 0 && index < count, op,
            "device cuda:{} does not exist: {} CUDA device(s) visible{}", index, count,
            count == 0 ? " (no GPU or no driver on this machine)" : "");
}

void set_device(int index) {
  TESSERA_CUDA_CHECK(cudaSetDevice(index), index);
}

void range_push(const char* name) noexcept {
  nvtxRangePushA(name);
}

void range_pop() noexcept {
  nvtxRangePop();
}

StreamHandle create_stream(int device) {
  set_device(device);
  cudaStream_t stream = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), device);
  return stream;
}

void destroy_stream(StreamHandle stream, int device) noexcept {
  if (!stream || cudaSetDevice(device) != cudaSuccess) return;
  cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

namespace {
std::atomic<uint64_t> waits{0};  // host_waits()
}  // namespace

uint64_t host_waits() {
  return waits.load(std::memory_order_relaxed);
}

void synchronize_stream(StreamHandle stream, int device) {
  waits.fetch_add(1, std::memory_order_relaxed);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), device);
}

EventHandle create_event(int device) {
  set_device(device);
  cudaEvent_t event = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), device);
  return event;
}

void destroy_event(EventHandle event, int device) noexcept {
  if (!event || cudaSetDevice(device) != cudaSuccess) return;
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void record_event(EventHandle event, StreamHandle stream, int device) {
  TESSERA_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)), device);
}

void stream_wait_event(StreamHandle stream, EventHandle event, int device) {
  TESSERA_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
      device);
}

bool event_done(EventHandle event, int device) {
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  TESSERA_CUDA_CHECK(status, device);
  return true;
}

void synchronize_event(EventHandle event, int device) {
  waits.fetch_add(1, std::memory_order_relaxed);
  TESSERA_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), device);
}

int pointer_device(const void* pointer) {
  if (!pointer) return -1;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();  // no driver, or a pointer CUDA never saw: host memory
    return -1;
  }
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged)
    return attributes.device;
  return -1;
}

void* allocate(size_t bytes, int device) {
  set_device(device);
  void* pointer = nullptr;
  const cudaError_t status = cudaMalloc(&pointer, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return nullptr;  // the caching allocator trims its cache and retries, then reports
  }
  TESSERA_CUDA_CHECK(status, device);
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

void memory_info(int device, size_t* free_bytes, size_t* total_bytes) {
  set_device(device);
  TESSERA_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes), device);
}

void copy_bytes_async(void* dst, const void* src, size_t bytes, StreamHandle stream, int device) {
  if (!bytes) return;
  TESSERA_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
      device);
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  waits.fetch_add(1, std::memory_order_relaxed);
  TESSERA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), -1);
  // From pageable host memory cudaMemcpy returns once the bytes are staged, before the DMA to the
  // device lands; work queued next on a non-blocking stream could then run first (a fill
  // overwritten by the copy it follows). Wait for the device.
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize(), -1);
}

void zero_bytes_async(void* dst, size_t bytes, StreamHandle stream, int device) {
  if (!bytes) return;
  TESSERA_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(stream)), device);
}

void copy_strided_async(void* dst, const int64_t* dst_strides, const void* src,
                        const int64_t* src_strides, const int64_t* shape, int ndim,
                        size_t element_size, StreamHandle stream, int device) {
  check_arg(ndim <= kernels::kMaxStridedDims, "cuda",
            "strided copy of a {}-d tensor (at most {} dims)", ndim, kernels::kMaxStridedDims);
  TESSERA_CUDA_CHECK(kernels::launch_strided_copy(dst, dst_strides, src, src_strides, shape, ndim,
                                                  element_size, static_cast<cudaStream_t>(stream)),
                     device);
}

}  // namespace tessera::gpu
