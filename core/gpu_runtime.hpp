// The CUDA runtime services the core needs (devices, streams, events, memory, copies), behind
// plain C++ declarations so that no C++20 header includes cuda_runtime.h. Built from
// core/cuda/ when CUDA is enabled, from core/cuda/no_cuda.cpp otherwise (where the queries
// answer "none" and every call that needs a device throws NotAvailable).
//
// Streams and events are opaque handles (cudaStream_t / cudaEvent_t underneath). The null
// StreamHandle is the cpu "stream": work on it runs inline, so ordering calls on it are no-ops.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera::gpu {

/// An opaque cudaStream_t (nullptr: no stream; for the cpu, work runs inline).
using StreamHandle = void*;
/// An opaque cudaEvent_t.
using EventHandle = void*;

/// True when Tessera was built with CUDA.
bool compiled();
/// Number of visible CUDA devices (0 without CUDA, a driver or a GPU).
int device_count();
/// CUDA runtime version as "13.0", or "" when not built with CUDA.
std::string runtime_version();
/// CUDA driver version as "13.0", or "" without CUDA or a driver.
std::string driver_version();
/// cuDNN version as "9.14.0", or "" when not linked.
std::string cudnn_version();
/// Name, memory and compute capability of device `index` ("NVIDIA H200, 139 GiB, sm_90").
std::string device_description(int index);

/// Throws InvalidArgument tagged with `op` unless `index` names a visible device (a build
/// without CUDA throws NotAvailable).
void check_device(int index, const std::string& op);
/// Makes `index` the calling thread's current device.
void set_device(int index);

/// Opens an NVTX range named `name` on the calling thread (Nsight Systems shows it beside the
/// CUDA work); nothing without CUDA.
void range_push(const char* name) noexcept;
/// Closes the calling thread's innermost range_push.
void range_pop() noexcept;

/// Creates a non-blocking stream on `device` (never the legacy default stream).
StreamHandle create_stream(int device);
/// Destroys a stream from create_stream (after its work completes).
void destroy_stream(StreamHandle stream, int device) noexcept;
/// Blocks the calling thread until every piece of work queued on `stream` is done.
void synchronize_stream(StreamHandle stream, int device);
/// Creates an event without timing (cheap to record and wait on).
EventHandle create_event(int device);
/// Destroys an event from create_event.
void destroy_event(EventHandle event, int device) noexcept;
/// Records `event` on `stream`: it completes when the work queued so far completes.
void record_event(EventHandle event, StreamHandle stream, int device);
/// Makes future work on `stream` wait for `event` (no host synchronization).
void stream_wait_event(StreamHandle stream, EventHandle event, int device);
/// True when the work before `event` is done (non-blocking).
bool event_done(EventHandle event, int device);
/// Blocks the calling thread until `event` completes.
void synchronize_event(EventHandle event, int device);
/// How many calls so far blocked a host thread until device work was done (stream and event
/// synchronizations, blocking copies), over every thread of the process; 0 without CUDA. Tests
/// use it to check that a path keeps the host ahead of the device.
uint64_t host_waits();

/// Device that owns `pointer` (device memory or managed memory), -1 for host memory (pinned
/// or pageable) and for every pointer in a build without CUDA.
int pointer_device(const void* pointer);

/// Allocates `bytes` on `device` with cudaMalloc (synchronous; the caching allocator's source).
void* allocate(size_t bytes, int device);
/// Frees memory from allocate().
void release(void* pointer, int device) noexcept;
/// Page-locked host memory of `bytes` (for staging transfers).
void* allocate_pinned(size_t bytes);
/// Frees memory from allocate_pinned().
void release_pinned(void* pointer) noexcept;
/// Device memory in use by every process and the device's total, in bytes.
void memory_info(int device, size_t* free_bytes, size_t* total_bytes);

/// Copies `bytes` between any two of host/device pointers (unified addressing), ordered on
/// `stream` (asynchronous for device and pinned memory).
void copy_bytes_async(void* dst, const void* src, size_t bytes, StreamHandle stream, int device);
/// Copies `bytes` between any two of host/device pointers and waits until they are in place
/// (the device idle: a pageable host-to-device copy has landed before any later stream work).
void copy_bytes(void* dst, const void* src, size_t bytes);
/// Sets `bytes` device bytes to zero, ordered on `stream`.
void zero_bytes_async(void* dst, size_t bytes, StreamHandle stream, int device);

/// N-d strided copy of elements of `element_size` bytes, where both pointers are device
/// pointers reachable from `device`; strides are in elements. Ordered on `stream`.
void copy_strided_async(void* dst, const int64_t* dst_strides, const void* src,
                        const int64_t* src_strides, const int64_t* shape, int ndim,
                        size_t element_size, StreamHandle stream, int device);

}  // namespace tessera::gpu
