// Caching allocator for host tensor storage. Blocks of 64 KiB and more are kept after release
// and handed out again for requests of the same size class, so steady-state ops do not pay
// mmap/munmap and first-touch page faults on every call. Thread-safe (local ranks share it).
#pragma once

#include <cstddef>
#include <string>

namespace tessera {

struct AllocatorStats;

/// 64-byte aligned host memory of at least `bytes` (never null; throws an Error tagged with `op`
/// naming the bytes asked, in use and cached when the system has no memory left).
void* host_allocate(size_t bytes, const std::string& op = "tensor");
/// Returns memory from host_allocate(bytes) (same `bytes`).
void host_release(void* pointer, size_t bytes) noexcept;
/// Bytes currently held in the cache (released, not yet reused or freed).
size_t host_cache_bytes();
/// Frees every cached block.
void host_cache_clear();
/// Bytes in use, peak, cached, the cache limit and the system allocations so far.
AllocatorStats host_allocator_stats();

}  // namespace tessera
