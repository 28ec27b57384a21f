// Stub of the CUDA runtime layer for builds without CUDA: the queries answer "none", every call
// that needs a device throws NotAvailable.
#include <cstring>

#include "core/errors.hpp"
#include "core/gpu_runtime.hpp"

namespace tessera::gpu {

namespace {
[[noreturn]] void unavailable(const char* what) {
  throw NotAvailable("cuda", fmt::format("{}: this Tessera was built without CUDA "
                                         "(TESSERA_WITH_CUDA=OFF)",
                                         what));
}
}  // namespace

bool compiled() {
  return false;
}
int device_count() {
  return 0;
}
std::string runtime_version() {
  return "";
}
std::string driver_version() {
  return "";
}
std::string device_description(int) {
  unavailable("device query");
}
void check_device(int index, const std::string& op) {
  throw NotAvailable(op, fmt::format("device cuda:{} asked for, but this Tessera was built "
                                     "without CUDA (TESSERA_WITH_CUDA=OFF)",
                                     index));
}
void set_device(int) {
  unavailable("cudaSetDevice");
}

void range_push(const char*) noexcept {}

void range_pop() noexcept {}
StreamHandle create_stream(int) {
  unavailable("stream creation");
}
void destroy_stream(StreamHandle, int) noexcept {}
void synchronize_stream(StreamHandle, int) {
  unavailable("stream synchronization");
}
EventHandle create_event(int) {
  unavailable("event creation");
}
void destroy_event(EventHandle, int) noexcept {}
void record_event(EventHandle, StreamHandle, int) {
  unavailable("event record");
}
void stream_wait_event(StreamHandle, EventHandle, int) {
  unavailable("stream wait");
}
bool event_done(EventHandle, int) {
  unavailable("event query");
}
void synchronize_event(EventHandle, int) {
  unavailable("event synchronization");
}
uint64_t host_waits() {
  return 0;
}
int pointer_device(const void*) {
  return -1;  // every pointer is a host pointer
}
void* allocate(size_t, int) {
  unavailable("device allocation");
}
void release(void*, int) noexcept {}
void* allocate_pinned(size_t) {
  unavailable("pinned allocation");
}
void release_pinned(void*) noexcept {}
void memory_info(int, size_t*, size_t*) {
  unavailable("device memory query");
}
void copy_bytes_async(void*, const void*, size_t, StreamHandle, int) {
  unavailable("device copy");
}
void copy_bytes(void* dst, const void* src, size_t bytes) {
  // Without CUDA every pointer is a host pointer.
  if (bytes) std::memcpy(dst, src, bytes);
}
void zero_bytes_async(void*, size_t, StreamHandle, int) {
  unavailable("device memset");
}
void copy_strided_async(void*, const int64_t*, const void*, const int64_t*, const int64_t*, int,
                        size_t, StreamHandle, int) {
  unavailable("device strided copy");
}

}  // namespace tessera::gpu
