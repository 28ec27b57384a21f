// Host caching allocator (see host_allocator.hpp). Size classes: blocks below 64 KiB go straight
// to aligned_alloc; larger requests round up to a multiple of 1/8 of their power of two (at
// most 12.5% slack) and are cached per class. The cache holds at most TESSERA_HOST_CACHE_MB
// (default 4096) MiB; past that, released blocks are freed. Blocks of 2 MiB and more are backed
// by transparent huge pages where the kernel offers them (TESSERA_HOST_HUGE_PAGES=0: never).
#include "core/host_allocator.hpp"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <bit>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/errors.hpp"

namespace tessera {

namespace {

constexpr size_t kCachedFrom = size_t{64} << 10;
/// Blocks of at least this size start on a 2 MiB boundary and ask the kernel for transparent huge
/// pages (madvise), unless TESSERA_HOST_HUGE_PAGES=0.
constexpr size_t kHugePage = size_t{2} << 20;

size_t size_class(size_t bytes) {
  if (bytes < kCachedFrom) return (bytes + 63) / 64 * 64;
  const size_t step = std::bit_ceil(bytes) / 8;
  return (bytes + step - 1) / step * step;
}

size_t cache_limit() {
  static const size_t limit = [] {
    if (const char* text = std::getenv("TESSERA_HOST_CACHE_MB"))
      return size_t(std::strtoull(text, nullptr, 10)) << 20;
    return size_t{4096} << 20;
  }();
  return limit;
}

struct Cache {
  std::mutex mu;
  std::map<size_t, std::vector<void*>> free_blocks;
  size_t held = 0;
  size_t in_use = 0;
  size_t peak_in_use = 0;
  uint64_t raw_allocations = 0;
};

Cache& cache() {
  static Cache* instance = new Cache;  // never destroyed: releases may run during exit
  return *instance;
}

[[noreturn]] void out_of_memory(const std::string& op, size_t bytes, const std::string& why) {
  throw OutOfMemory(op, fmt::format("out of memory: asked {} bytes ({:.3g} GiB), {}", bytes,
                                    double(bytes) / double(size_t{1} << 30), why));
}

bool huge_pages_wanted() {
  static const bool wanted = [] {
    const char* text = std::getenv("TESSERA_HOST_HUGE_PAGES");
    return text == nullptr || std::string(text) != "0";
  }();
  return wanted;
}

/// `bytes` (a size class) of fresh memory, 64-byte aligned; a large block on a huge-page boundary
/// with its whole huge pages marked for transparent huge pages. A memory-bound loop over a large
/// tensor then walks 2 MiB pages: fewer TLB misses, and prefetchers that stop at 4 KiB page
/// boundaries stop less often (`bench ops`, one Zen 4 thread, 12 alternated rounds: mean all
/// forward+backward 0.98 -> 0.74 ms, softmax dim 1 7.8 -> 6.9, concat dim 1 2.6 -> 1.9). Cached
/// blocks keep their pages, so the first touch's cost is paid once.
void* fresh_block(size_t bytes) {
  if (bytes < kHugePage || !huge_pages_wanted()) return std::aligned_alloc(64, bytes);
  void* block = nullptr;
  if (::posix_memalign(&block, kHugePage, bytes) != 0) return nullptr;
  // Advice only: a kernel without transparent huge pages (or with them off) refuses or ignores it.
  ::madvise(block, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);
  return block;
}

}  // namespace

size_t host_memory_limit() {
  static const size_t limit = [] {
    if (const char* text = std::getenv("TESSERA_HOST_MEMORY_LIMIT_MB"))
      return size_t(std::strtoull(text, nullptr, 10)) << 20;
    const long pages = ::sysconf(_SC_PHYS_PAGES), page_size = ::sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page_size <= 0) return size_t{1} << 62;
    return size_t(pages) * size_t(page_size);
  }();
  return limit;
}

namespace {

void count_handed_out(Cache& c, size_t rounded) {
  c.in_use += rounded;
  c.peak_in_use = std::max(c.peak_in_use, c.in_use);
}

}  // namespace

void* host_allocate(size_t bytes, const std::string& op) {
  if (bytes > host_memory_limit())
    out_of_memory(op, bytes,
                  fmt::format("more than the host memory limit of {} bytes (physical memory, or "
                              "TESSERA_HOST_MEMORY_LIMIT_MB)",
                              host_memory_limit()));
  const size_t rounded = size_class(std::max<size_t>(bytes, 1));
  Cache& c = cache();
  if (rounded >= kCachedFrom) {
    std::lock_guard lock(c.mu);
    auto it = c.free_blocks.find(rounded);
    if (it != c.free_blocks.end() && !it->second.empty()) {
      void* block = it->second.back();
      it->second.pop_back();
      c.held -= rounded;
      count_handed_out(c, rounded);
      return block;
    }
  }
  void* block = fresh_block(rounded);
  if (!block) {
    host_cache_clear();  // give cached memory back and try once more
    block = fresh_block(rounded);
    if (!block) {
      std::lock_guard lock(c.mu);
      out_of_memory(op, bytes,
                    fmt::format("the system has no memory left for it ({} bytes in use by "
                                "tensors, {} cached, TESSERA_HOST_CACHE_MB)",
                                c.in_use, c.held));
    }
  }
  std::lock_guard lock(c.mu);
  ++c.raw_allocations;
  count_handed_out(c, rounded);
  return block;
}

void host_release(void* pointer, size_t bytes) noexcept {
  if (!pointer) return;
  const size_t rounded = size_class(std::max<size_t>(bytes, 1));
  {
    Cache& c = cache();
    std::lock_guard lock(c.mu);
    c.in_use -= std::min(c.in_use, rounded);
  }
  if (rounded >= kCachedFrom) {
    Cache& c = cache();
    std::lock_guard lock(c.mu);
    if (c.held + rounded <= cache_limit()) {
      c.free_blocks[rounded].push_back(pointer);
      c.held += rounded;
      return;
    }
  }
  std::free(pointer);
}

size_t host_cache_bytes() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  return c.held;
}

void host_allocator_reset_peak() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  c.peak_in_use = c.in_use;
}

AllocatorStats host_allocator_stats() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  AllocatorStats stats;
  stats.in_use = c.in_use;
  stats.peak_in_use = c.peak_in_use;
  stats.cached = c.held;
  stats.limit = cache_limit();
  stats.raw_allocations = c.raw_allocations;
  return stats;
}

void host_cache_clear() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  for (auto& [size, blocks] : c.free_blocks)
    for (void* block : blocks) std::free(block);
  c.free_blocks.clear();
  c.held = 0;
}

}  // namespace tessera
