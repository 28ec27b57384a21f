// PinnedPool: reusable page-locked host slabs for staging device data through the host (HDF5
// IO, MPI without CUDA-aware transport). Page-locking memory is slow (milliseconds per call) and
// a scarce resource, so slabs are kept after use and handed out again. Plain C++ over an
// injected source (gpu::allocate_pinned/release_pinned for the process-wide pool, fakes in the
// unit tests).
//
// Slabs come in power-of-two sizes from 64 KiB; a request gets a cached slab of its size class
// or a new one. The pool keeps at most `cache_limit` bytes of idle slabs (TESSERA_PINNED_CACHE_MB,
// default 1024), freeing the oldest idle slabs past it; a failed allocation frees every idle
// slab and retries once before throwing. A slab goes back to the pool when its PinnedSlab handle
// is destroyed: the caller must have completed (synchronized) every asynchronous copy using it
// first. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

namespace tessera {

/// Where a PinnedPool gets page-locked memory.
struct PinnedSource {
  /// `bytes` of page-locked host memory, or nullptr when none can be had.
  std::function<void*(size_t bytes)> allocate;
  /// Frees memory from `allocate`.
  std::function<void(void* pointer)> release;
};

class PinnedPool;

/// A slab borrowed from a PinnedPool; returns to it when destroyed. Movable, not copyable.
class PinnedSlab {
 public:
  PinnedSlab() = default;
  ~PinnedSlab() { reset(); }
  PinnedSlab(PinnedSlab&& other) noexcept { *this = std::move(other); }
  PinnedSlab& operator=(PinnedSlab&& other) noexcept;
  PinnedSlab(const PinnedSlab&) = delete;
  PinnedSlab& operator=(const PinnedSlab&) = delete;

  /// The slab's first byte (null for an empty handle).
  void* data() const { return data_; }
  /// Usable bytes (at least what was asked).
  size_t size() const { return size_; }
  /// Gives the slab back to its pool now.
  void reset() noexcept;

 private:
  friend class PinnedPool;
  PinnedSlab(PinnedPool* pool, void* data, size_t size) : pool_(pool), data_(data), size_(size) {}
  PinnedPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
};

/// Statistics of a PinnedPool (bytes).
struct PinnedPoolStats {
  size_t in_use = 0;             ///< lent out in PinnedSlab handles
  size_t cached = 0;             ///< idle slabs kept for reuse
  uint64_t raw_allocations = 0;  ///< calls that reached the source
};

/// Size class of a pinned request: the power of two at or above max(bytes, 64 KiB).
size_t pinned_size_class(size_t bytes);

/// A pool of page-locked slabs (see the file comment).
class PinnedPool {
 public:
  /// A pool over `source` keeping at most `cache_limit` bytes of idle slabs.
  PinnedPool(PinnedSource source, size_t cache_limit);
  /// Frees the idle slabs (slabs still lent out must be returned first).
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  /// A slab of at least `bytes`. Throws Error tagged with `op` when no pinned memory can be had
  /// even after freeing the idle slabs.
  PinnedSlab acquire(size_t bytes, const std::string& op);
  /// The statistics now.
  PinnedPoolStats stats() const;
  /// Frees every idle slab.
  void clear();

 private:
  friend class PinnedSlab;
  void give_back(void* data, size_t size) noexcept;
  void free_idle_beyond(size_t keep_bytes) noexcept;

  PinnedSource source_;
  size_t cache_limit_;
  mutable std::mutex mutex_;
  std::deque<std::pair<void*, size_t>> idle_;  // oldest first
  PinnedPoolStats stats_;
};

/// The process-wide pool of pinned staging slabs (gpu::allocate_pinned underneath; limit from
/// TESSERA_PINNED_CACHE_MB, default 1024 MiB).
PinnedPool& pinned_staging_pool();

}  // namespace tessera
