// CachingAllocator: the stream-ordered cache of device memory behind DeviceBackend::allocate.
// Plain C++ over an injected raw source (cudaMalloc/cudaFree and cudaEvent hooks for a CUDA
// device, fakes in the unit tests), so every rule below is tested without a GPU.
//
// Rules:
//  - Sizes are rounded into size classes (size_class): requests up to 1 MiB to a multiple of
//    512 B, larger ones up to a multiple of 1/8 of the power of two below them (at most 12.5%
//    slack; steps of 2 MiB and more from 16 MiB on). A request is served only by a cached block of
//    exactly its class: no splitting, so the cache never fragments a block.
//  - A block released on stream S is reused at once by a request on S (work on one stream runs
//    in order, so the new owner's work queues after the old owner's).
//  - A block released on S is reused by a request on another stream only once the event
//    recorded on S at release has completed (queried, never waited for: no stream or device
//    synchronization).
//  - The cache keeps at most `cache_limit` bytes; past it the oldest cached blocks go back to
//    the raw source. A limit of 0 caches nothing.
//  - A raw allocation that fails frees the whole cache and retries once, then throws an Error
//    tagged with the op naming the request, the bytes in use and cached, and the limit setting.
// Thread-safe: local ranks are threads that may share one device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/backend/backend.hpp"

namespace tessera {

/// Where a CachingAllocator gets memory and how it orders reuse between streams. Streams and
/// events are opaque handles (cudaStream_t / cudaEvent_t for a CUDA device).
struct RawDeviceSource {
  using StreamKey = void*;
  using EventToken = void*;
  /// `bytes` of fresh memory, or nullptr when the device is out of memory.
  std::function<void*(size_t bytes)> allocate;
  /// Gives memory from `allocate` back; must be safe while work that used it is still queued
  /// (cudaFree waits for the device).
  std::function<void(void* pointer)> release;
  /// Records an event on `stream` (completes once the work queued so far is done).
  std::function<EventToken(StreamKey stream)> record;
  /// True when the event has completed (non-blocking).
  std::function<bool(EventToken event)> done;
  /// Returns an event from `record` that the allocator no longer needs (for reuse).
  std::function<void(EventToken event)> forget;
};

/// Bytes a request of `bytes` occupies: its size class (see the file comment).
size_t device_size_class(size_t bytes);

/// "512 B", "3.0 KiB", "1.50 GiB": a byte count for messages.
std::string human_bytes(size_t bytes);

/// The cache limit in bytes given TESSERA_DEVICE_CACHE_MB's text (null when unset) and the
/// device's total memory: the variable's MiB when set (0 disables caching), else the device's
/// total memory (no limit below the device). Throws InvalidArgument on a value that is not a
/// non-negative integer.
size_t device_cache_limit(const char* setting, size_t device_total_bytes);

/// A stream-ordered caching allocator of one device (see the file comment).
class CachingAllocator {
 public:
  using StreamKey = RawDeviceSource::StreamKey;

  /// An allocator over `source` for the device named `device_name` ("cuda:0", in messages),
  /// keeping at most `cache_limit` bytes cached; `limit_setting` is how the limit was given
  /// ("TESSERA_DEVICE_CACHE_MB=512" or "TESSERA_DEVICE_CACHE_MB unset"), quoted in errors.
  CachingAllocator(RawDeviceSource source, std::string device_name, size_t cache_limit,
                   std::string limit_setting);
  /// Frees every cached block (blocks still in use are the users' to release first).
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// A block of at least `bytes`, usable on `stream` at once. Throws Error tagged with `op`
  /// when the device is out of memory even after freeing the cache.
  void* allocate(size_t bytes, StreamKey stream, const std::string& op);
  /// Returns `pointer` (from allocate) after the work queued on `stream` that uses it; null is
  /// ignored. Never throws.
  void release(void* pointer, StreamKey stream) noexcept;
  /// The statistics now.
  AllocatorStats stats() const;
  /// Frees every cached block.
  void clear_cache();

 private:
  struct CachedBlock {
    void* pointer;
    size_t size;
    StreamKey stream;
    RawDeviceSource::EventToken event;
  };
  using Serial = uint64_t;

  // All under mutex_. Cached blocks are keyed by a serial that grows with release time, so the
  // oldest comes first in cached_; the two indexes hold serials (ordered, oldest first).
  void* take_cached_locked(size_t size, StreamKey stream, RawDeviceSource::EventToken* event);
  void erase_cached_locked(Serial serial);
  std::vector<CachedBlock> trim_locked(size_t keep_bytes);
  void release_blocks(const std::vector<CachedBlock>& blocks) noexcept;

  RawDeviceSource source_;
  std::string device_name_;
  size_t cache_limit_;
  std::string limit_setting_;

  mutable std::mutex mutex_;
  std::unordered_map<void*, size_t> live_;  // block -> size class, for blocks handed out
  std::map<Serial, CachedBlock> cached_;
  std::map<std::pair<size_t, StreamKey>, std::set<Serial>> cached_by_stream_;
  std::map<size_t, std::set<Serial>> cached_by_size_;
  Serial next_serial_ = 0;
  AllocatorStats stats_;
};

}  // namespace tessera
