// Stream-ordered caching device allocator (see caching_allocator.hpp for the rules).
#include "core/backend/caching_allocator.hpp"

#include <bit>
#include <cstdlib>

#include "core/errors.hpp"

namespace tessera {

namespace {

constexpr size_t kSmallGranule = 512;
constexpr size_t kSmallLimit = size_t{1} << 20;

}  // namespace

size_t device_size_class(size_t bytes) {
  if (bytes <= kSmallLimit)
    return std::max<size_t>((bytes + kSmallGranule - 1) / kSmallGranule, 1) * kSmallGranule;
  const size_t step = std::bit_floor(bytes) / 8;  // < bytes / 8: at most 12.5% slack
  return (bytes + step - 1) / step * step;
}

std::string human_bytes(size_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  static constexpr const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", value, units[unit]);
}

size_t device_cache_limit(const char* setting, size_t device_total_bytes) {
  if (!setting || !*setting) return device_total_bytes;
  char* end = nullptr;
  const unsigned long long mib = std::strtoull(setting, &end, 10);
  check_arg(*end == '\0' && setting[0] != '-', "allocator",
            "TESSERA_DEVICE_CACHE_MB={} is not a number of MiB", setting);
  return static_cast<size_t>(mib) << 20;
}

CachingAllocator::CachingAllocator(RawDeviceSource source, std::string device_name,
                                   size_t cache_limit, std::string limit_setting)
    : source_(std::move(source)),
      device_name_(std::move(device_name)),
      cache_limit_(cache_limit),
      limit_setting_(std::move(limit_setting)) {
  stats_.limit = cache_limit_;
}

CachingAllocator::~CachingAllocator() {
  clear_cache();
}

void CachingAllocator::erase_cached_locked(Serial serial) {
  const auto it = cached_.find(serial);
  const CachedBlock& block = it->second;
  const auto by_stream = cached_by_stream_.find({block.size, block.stream});
  by_stream->second.erase(serial);
  if (by_stream->second.empty()) cached_by_stream_.erase(by_stream);
  const auto by_size = cached_by_size_.find(block.size);
  by_size->second.erase(serial);
  if (by_size->second.empty()) cached_by_size_.erase(by_size);
  stats_.cached -= block.size;
  cached_.erase(it);
}

void* CachingAllocator::take_cached_locked(size_t size, StreamKey stream,
                                           RawDeviceSource::EventToken* event) {
  // Same stream first, newest block first (most likely still in the device's caches).
  if (const auto same = cached_by_stream_.find({size, stream}); same != cached_by_stream_.end()) {
    const Serial serial = *same->second.rbegin();
    const CachedBlock block = cached_.at(serial);
    erase_cached_locked(serial);
    *event = block.event;
    return block.pointer;
  }
  // Another stream's block, oldest first (the most likely to have its event completed).
  const auto by_size = cached_by_size_.find(size);
  if (by_size == cached_by_size_.end()) return nullptr;
  for (const Serial serial : by_size->second) {
    const CachedBlock& block = cached_.at(serial);
    if (block.event && !source_.done(block.event)) continue;
    const CachedBlock taken = block;
    erase_cached_locked(serial);
    *event = taken.event;
    return taken.pointer;
  }
  return nullptr;
}

std::vector<CachingAllocator::CachedBlock> CachingAllocator::trim_locked(size_t keep_bytes) {
  std::vector<CachedBlock> freed;
  while (stats_.cached > keep_bytes) {
    const auto oldest = cached_.begin();
    freed.push_back(oldest->second);
    erase_cached_locked(oldest->first);
  }
  return freed;
}

void CachingAllocator::release_blocks(const std::vector<CachedBlock>& blocks) noexcept {
  for (const CachedBlock& block : blocks) {
    if (block.event && source_.forget) source_.forget(block.event);
    source_.release(block.pointer);
  }
}

void* CachingAllocator::allocate(size_t bytes, StreamKey stream, const std::string& op) {
  const size_t size = device_size_class(bytes);
  RawDeviceSource::EventToken stale_event = nullptr;
  void* cached_block = nullptr;
  {
    std::lock_guard lock(mutex_);
    cached_block = take_cached_locked(size, stream, &stale_event);
    if (cached_block) {
      live_.emplace(cached_block, size);
      stats_.in_use += size;
      stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
    }
  }
  if (cached_block) {
    if (stale_event && source_.forget) source_.forget(stale_event);
    return cached_block;
  }
  void* block = source_.allocate(size);
  if (!block) {
    // Out of memory: give every cached block back and try once more.
    std::vector<CachedBlock> freed;
    size_t cached_before = 0;
    {
      std::lock_guard lock(mutex_);
      cached_before = stats_.cached;
      freed = trim_locked(0);
    }
    release_blocks(freed);
    block = source_.allocate(size);
    if (!block) {
      const AllocatorStats now = stats();
      throw Error(op, fmt::format("out of memory on {}: asked {} ({} bytes), {} in use, {} cached "
                                  "(freed and retried) ({})",
                                  device_name_, human_bytes(bytes), bytes, human_bytes(now.in_use),
                                  human_bytes(cached_before), limit_setting_));
    }
  }
  std::lock_guard lock(mutex_);
  live_.emplace(block, size);
  ++stats_.raw_allocations;
  stats_.in_use += size;
  stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
  return block;
}

void CachingAllocator::release(void* pointer, StreamKey stream) noexcept {
  if (!pointer) return;
  // The event that later users on other streams wait for: recorded outside the lock (it queues
  // work on the device). Failing to record one means the block cannot be cached safely.
  RawDeviceSource::EventToken event = nullptr;
  bool cacheable = cache_limit_ > 0;
  if (cacheable && source_.record) {
    try {
      event = source_.record(stream);
    } catch (...) {
      cacheable = false;
    }
  }
  std::vector<CachedBlock> to_free;
  {
    std::lock_guard lock(mutex_);
    const auto live = live_.find(pointer);
    if (live == live_.end()) {
      // Not ours (or released twice): never hand it out again.
      if (event && source_.forget) source_.forget(event);
      return;
    }
    const size_t size = live->second;
    live_.erase(live);
    stats_.in_use -= size;
    const CachedBlock block{pointer, size, stream, event};
    if (!cacheable || size > cache_limit_) {
      to_free.push_back(block);
    } else {
      const Serial serial = next_serial_++;
      cached_.emplace(serial, block);
      cached_by_stream_[{size, stream}].insert(serial);
      cached_by_size_[size].insert(serial);
      stats_.cached += size;
      to_free = trim_locked(cache_limit_);
    }
  }
  release_blocks(to_free);
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CachingAllocator::clear_cache() {
  std::vector<CachedBlock> freed;
  {
    std::lock_guard lock(mutex_);
    freed = trim_locked(0);
  }
  release_blocks(freed);
}

}  // namespace tessera
