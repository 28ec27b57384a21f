// Pool of page-locked staging slabs (see pinned_pool.hpp).
#include "core/backend/pinned_pool.hpp"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <vector>

#include "core/backend/caching_allocator.hpp"
#include "core/errors.hpp"
#include "core/gpu_runtime.hpp"

namespace tessera {

namespace {
constexpr size_t kSmallestSlab = size_t{64} << 10;
}  // namespace

size_t pinned_size_class(size_t bytes) {
  return std::bit_ceil(std::max(bytes, kSmallestSlab));
}

PinnedSlab& PinnedSlab::operator=(PinnedSlab&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void PinnedSlab::reset() noexcept {
  if (pool_ && data_) pool_->give_back(data_, size_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

PinnedPool::PinnedPool(PinnedSource source, size_t cache_limit)
    : source_(std::move(source)), cache_limit_(cache_limit) {}

PinnedPool::~PinnedPool() {
  clear();
}

PinnedSlab PinnedPool::acquire(size_t bytes, const std::string& op) {
  const size_t size = pinned_size_class(bytes);
  {
    std::lock_guard lock(mutex_);
    // Newest idle slab of the class first.
    for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
      if (it->second != size) continue;
      void* data = it->first;
      idle_.erase(std::next(it).base());
      stats_.cached -= size;
      stats_.in_use += size;
      return PinnedSlab(this, data, size);
    }
  }
  void* data = source_.allocate(size);
  if (!data) {
    free_idle_beyond(0);
    data = source_.allocate(size);
    if (!data) {
      const PinnedPoolStats now = stats();
      throw Error(op, fmt::format("out of pinned host memory: asked {} ({} bytes), {} in use "
                                  "(idle slabs freed and retried)",
                                  human_bytes(size), size, human_bytes(now.in_use)));
    }
  }
  std::lock_guard lock(mutex_);
  ++stats_.raw_allocations;
  stats_.in_use += size;
  return PinnedSlab(this, data, size);
}

void PinnedPool::give_back(void* data, size_t size) noexcept {
  {
    std::lock_guard lock(mutex_);
    stats_.in_use -= size;
    if (size <= cache_limit_) {
      idle_.emplace_back(data, size);
      stats_.cached += size;
      data = nullptr;
    }
  }
  if (data) source_.release(data);
  free_idle_beyond(cache_limit_);
}

void PinnedPool::free_idle_beyond(size_t keep_bytes) noexcept {
  std::vector<void*> freed;
  {
    std::lock_guard lock(mutex_);
    while (stats_.cached > keep_bytes) {
      freed.push_back(idle_.front().first);
      stats_.cached -= idle_.front().second;
      idle_.pop_front();
    }
  }
  for (void* data : freed) source_.release(data);
}

PinnedPoolStats PinnedPool::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void PinnedPool::clear() {
  free_idle_beyond(0);
}

PinnedPool& pinned_staging_pool() {
  static PinnedPool* pool = [] {
    size_t limit = size_t{1024} << 20;
    if (const char* text = std::getenv("TESSERA_PINNED_CACHE_MB"); text && *text) {
      char* end = nullptr;
      const unsigned long long mib = std::strtoull(text, &end, 10);
      check_arg(*end == '\0' && text[0] != '-', "pinned",
                "TESSERA_PINNED_CACHE_MB={} is not a number of MiB", text);
      limit = static_cast<size_t>(mib) << 20;
    }
    PinnedSource source;
    source.allocate = [](size_t bytes) -> void* {
      try {
        return gpu::allocate_pinned(bytes);
      } catch (const NotAvailable&) {
        throw;  // a build without CUDA: not an out-of-memory condition
      } catch (const Error&) {
        return nullptr;  // the page-locking failed: the pool frees its idle slabs and retries
      }
    };
    source.release = [](void* data) { gpu::release_pinned(data); };
    return new PinnedPool(std::move(source), limit);  // never destroyed: slabs may outlive exit
  }();
  return *pool;
}

}  // namespace tessera
