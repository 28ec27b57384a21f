// Caching allocator for host tensor storage. Blocks of 64 KiB and more are kept after release
// and handed out again for requests of the same size class, so steady-state ops do not pay
// mmap/munmap and first-touch page faults on every call. Thread-safe (local ranks share it).
#pragma once

#include <cstddef>

namespace tessera {

/// 64-byte aligned host memory of at least `bytes` (never null; throws std::bad_alloc).
void* host_allocate(size_t bytes);
/// Returns memory from host_allocate(bytes) (same `bytes`).
void host_release(void* pointer, size_t bytes) noexcept;
/// Bytes currently held in the cache (released, not yet reused or freed).
size_t host_cache_bytes();
/// Frees every cached block.
void host_cache_clear();

}  // namespace tessera
