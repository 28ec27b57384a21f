// Stub of the CUDA runtime layer for builds without CUDA.
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
void* allocate(size_t, int) {
  unavailable("device allocation");
}
void release(void*, int) noexcept {}
void* allocate_pinned(size_t) {
  unavailable("pinned host allocation");
}
void release_pinned(void*) noexcept {}
void copy_bytes(void* dst, const void* src, size_t bytes) {
  // Without CUDA every pointer is a host pointer.
  if (bytes) std::memcpy(dst, src, bytes);
}
void zero_bytes(void*, size_t, int) {
  unavailable("device memset");
}
void copy_strided(void*, const int64_t*, const void*, const int64_t*, const int64_t*, int, size_t,
                  int) {
  unavailable("device strided copy");
}

}  // namespace tessera::gpu
