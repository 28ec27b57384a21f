// Caching allocator for host tensor storage. Blocks of 64 KiB and more are kept after release
// and handed out again for requests of the same size class, so steady-state ops do not pay
// mmap/munmap and first-touch page faults on every call. Thread-safe (local ranks share it).
// A request larger than the machine's physical memory (or TESSERA_HOST_MEMORY_LIMIT_MB when set)
// is refused up front, and a failed allocation raises OutOfMemory, never std::bad_alloc.
#pragma once

#include <cstddef>
#include <string>

#include "core/errors.hpp"

namespace tessera {

/// An allocation this machine cannot satisfy: "[op] out of memory: asked N bytes, ...".
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

struct AllocatorStats;

/// 64-byte aligned host memory of at least `bytes` (never null). Throws OutOfMemory tagged with
/// `op`, "[op] out of memory: asked N bytes, ...", past host_memory_limit() or when the system
/// has no memory left (naming the bytes in use and cached).
void* host_allocate(size_t bytes, const std::string& op = "tensor");
/// The most bytes one host allocation may ask: TESSERA_HOST_MEMORY_LIMIT_MB MiB when set, else
/// the machine's physical memory.
size_t host_memory_limit();
/// Returns memory from host_allocate(bytes) (same `bytes`).
void host_release(void* pointer, size_t bytes) noexcept;
/// Bytes currently held in the cache (released, not yet reused or freed).
size_t host_cache_bytes();
/// Frees every cached block.
void host_cache_clear();
/// Bytes in use, peak, cached, the cache limit and the system allocations so far.
AllocatorStats host_allocator_stats();
/// Starts a new peak: peak_in_use becomes the bytes in use now (for measuring one phase).
void host_allocator_reset_peak();

}  // namespace tessera
