// Unit tests of the stream-ordered caching device allocator over a fake device: fake addresses
// from a capacity-limited counter, fake streams and events completed by the test.
#include "core/backend/caching_allocator.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "core/errors.hpp"

namespace tessera {
namespace {

using ::testing::HasSubstr;

/// A device with `capacity` bytes whose events complete only when the test says so (or at
/// once with `events_complete_at_once`).
class FakeDevice {
 public:
  explicit FakeDevice(size_t capacity = SIZE_MAX) : capacity_(capacity) {}

  RawDeviceSource source() {
    RawDeviceSource s;
    s.allocate = [this](size_t bytes) -> void* {
      std::lock_guard lock(mu_);
      if (bytes > capacity_ - used_) return nullptr;
      used_ += bytes;
      void* pointer = reinterpret_cast<void*>(next_address_);
      next_address_ += bytes + 4096;
      blocks_[pointer] = bytes;
      return pointer;
    };
    s.release = [this](void* pointer) {
      std::lock_guard lock(mu_);
      used_ -= blocks_.at(pointer);
      blocks_.erase(pointer);
      released_.push_back(pointer);
    };
    s.record = [this](void*) -> void* {
      std::lock_guard lock(mu_);
      const uintptr_t id = next_event_++;
      done_[id] = events_complete_at_once;
      return reinterpret_cast<void*>(id);
    };
    s.done = [this](void* event) {
      std::lock_guard lock(mu_);
      return done_.at(reinterpret_cast<uintptr_t>(event));
    };
    s.forget = [this](void* event) {
      std::lock_guard lock(mu_);
      done_.erase(reinterpret_cast<uintptr_t>(event));
    };
    return s;
  }

  /// Completes every event recorded so far.
  void complete_events() {
    std::lock_guard lock(mu_);
    for (auto& [id, done] : done_) done = true;
  }
  /// Raw blocks given back, in order.
  std::vector<void*> released() {
    std::lock_guard lock(mu_);
    return released_;
  }
  size_t used() {
    std::lock_guard lock(mu_);
    return used_;
  }
  size_t live_events() {
    std::lock_guard lock(mu_);
    return done_.size();
  }

  bool events_complete_at_once = false;

 private:
  std::mutex mu_;
  size_t capacity_;
  size_t used_ = 0;
  uintptr_t next_address_ = 1 << 20;
  uintptr_t next_event_ = 1;
  std::map<void*, size_t> blocks_;
  std::map<uintptr_t, bool> done_;
  std::vector<void*> released_;
};

void* stream_key(int id) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(0x1000 * id));
}

CachingAllocator make_allocator(FakeDevice& device, size_t limit = SIZE_MAX) {
  return CachingAllocator(device.source(), "cuda:0", limit, "TESSERA_DEVICE_CACHE_MB unset");
}

TEST(DeviceSizeClass, SmallRequestsRoundTo512Bytes) {
  EXPECT_EQ(device_size_class(0), 512u);
  EXPECT_EQ(device_size_class(1), 512u);
  EXPECT_EQ(device_size_class(512), 512u);
  EXPECT_EQ(device_size_class(513), 1024u);
  EXPECT_EQ(device_size_class(1000 * 1000), 1000448u);  // 1954 * 512
  EXPECT_EQ(device_size_class(size_t{1} << 20), size_t{1} << 20);
}

TEST(DeviceSizeClass, LargeRequestsHaveAtMostOneEighthSlack) {
  EXPECT_EQ(device_size_class((size_t{1} << 20) + 1), size_t{9} << 17);  // step 128 KiB
  EXPECT_EQ(device_size_class(size_t{100} << 20), size_t{104} << 20);    // step 8 MiB
  size_t previous_class = 0;
  for (size_t bytes = (size_t{1} << 20) + 1; bytes < (size_t{1} << 34); bytes += bytes / 7 + 13) {
    const size_t size_class = device_size_class(bytes);
    EXPECT_GE(size_class, bytes);
    EXPECT_LE(size_class - bytes, bytes / 8) << bytes;
    EXPECT_GE(size_class, previous_class);  // monotonic
    previous_class = size_class;
  }
}

TEST(DeviceSizeClass, RequestsOfOneClassShareACachedBlock) {
  FakeDevice device;
  CachingAllocator allocator = make_allocator(device);
  void* first = allocator.allocate(1000, stream_key(1), "test");
  allocator.release(first, stream_key(1));
  EXPECT_EQ(allocator.allocate(700, stream_key(1), "test"), first);  // both round to 1024
  EXPECT_EQ(allocator.stats().raw_allocations, 1u);
}

TEST(CachingAllocator, ReusesABlockOnTheSameStreamAtOnce) {
  FakeDevice device;  // events never complete
  CachingAllocator allocator = make_allocator(device);
  void* block = allocator.allocate(4096, stream_key(1), "test");
  allocator.release(block, stream_key(1));
  EXPECT_EQ(allocator.allocate(4096, stream_key(1), "test"), block);
  EXPECT_EQ(allocator.stats().raw_allocations, 1u);
}

TEST(CachingAllocator, NoReuseAcrossStreamsBeforeTheReleaseEventCompletes) {
  FakeDevice device;
  CachingAllocator allocator = make_allocator(device);
  void* on_first = allocator.allocate(4096, stream_key(1), "test");
  allocator.release(on_first, stream_key(1));
  void* on_second = allocator.allocate(4096, stream_key(2), "test");
  EXPECT_NE(on_second, on_first);  // the event of the release on stream 1 is pending
  EXPECT_EQ(allocator.stats().raw_allocations, 2u);

  device.complete_events();
  EXPECT_EQ(allocator.allocate(4096, stream_key(2), "test"), on_first);
  EXPECT_EQ(allocator.stats().raw_allocations, 2u);
  EXPECT_EQ(device.live_events(), 0u);  // the consumed event went back to the source
}

TEST(CachingAllocator, CacheLimitFreesTheOldestBlocks) {
  FakeDevice device;
  device.events_complete_at_once = true;
  CachingAllocator allocator = make_allocator(device, 4096);
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(allocator.allocate(2048, stream_key(1), "test"));
  for (void* block : blocks) allocator.release(block, stream_key(1));
  EXPECT_EQ(allocator.stats().cached, 4096u);
  EXPECT_EQ(allocator.stats().limit, 4096u);
  EXPECT_EQ(device.released(), (std::vector<void*>{blocks[0], blocks[1]}));
  EXPECT_EQ(device.used(), 4096u);

  // A block larger than the limit is never cached.
  void* big = allocator.allocate(8192, stream_key(1), "test");
  allocator.release(big, stream_key(1));
  EXPECT_EQ(device.released().back(), big);
  EXPECT_EQ(allocator.stats().cached, 4096u);
}

TEST(CachingAllocator, ZeroLimitCachesNothing) {
  FakeDevice device;
  CachingAllocator allocator = make_allocator(device, 0);
  void* block = allocator.allocate(4096, stream_key(1), "test");
  allocator.release(block, stream_key(1));
  EXPECT_EQ(allocator.stats().cached, 0u);
  EXPECT_EQ(device.used(), 0u);
  EXPECT_EQ(device.live_events(), 0u);
}

TEST(CachingAllocator, BlockWhoseEventCannotBeRecordedIsFreedNotCached) {
  FakeDevice device;
  RawDeviceSource source = device.source();
  source.record = [](void*) -> void* { throw Error("cuda", "record failed"); };
  CachingAllocator allocator(std::move(source), "cuda:0", SIZE_MAX, "unset");
  void* block = allocator.allocate(4096, stream_key(1), "test");
  allocator.release(block, stream_key(1));
  EXPECT_EQ(allocator.stats().cached, 0u);
  EXPECT_EQ(device.released(), std::vector<void*>{block});
}

TEST(CachingAllocator, UnknownPointersAreIgnoredOnRelease) {
  FakeDevice device;
  CachingAllocator allocator = make_allocator(device);
  void* block = allocator.allocate(4096, stream_key(1), "test");
  allocator.release(block, stream_key(1));
  allocator.release(block, stream_key(1));  // released twice: cached once
  int local = 0;
  allocator.release(&local, stream_key(1));
  EXPECT_EQ(allocator.stats().cached, 4096u);
  EXPECT_EQ(allocator.allocate(4096, stream_key(1), "test"), block);
  EXPECT_NE(allocator.allocate(4096, stream_key(1), "test"), block);
}

TEST(CachingAllocator, OutOfMemoryFreesTheCacheAndRetries) {
  FakeDevice device(8192);
  CachingAllocator allocator = make_allocator(device);
  void* small = allocator.allocate(4096, stream_key(1), "test");
  allocator.release(small, stream_key(1));  // cached: 4 KiB held on the device
  void* large = allocator.allocate(8192, stream_key(1), "test");  // needs the cached 4 KiB
  EXPECT_NE(large, nullptr);
  EXPECT_EQ(device.released(), std::vector<void*>{small});
  EXPECT_EQ(allocator.stats().cached, 0u);
  EXPECT_EQ(allocator.stats().in_use, 8192u);
}

TEST(CachingAllocator, OutOfMemoryAfterTheRetryNamesTheSizes) {
  FakeDevice device(12288);
  CachingAllocator allocator(device.source(), "cuda:3", SIZE_MAX, "TESSERA_DEVICE_CACHE_MB=64");
  void* held = allocator.allocate(8192, stream_key(1), "test");
  void* cached = allocator.allocate(2048, stream_key(1), "test");
  allocator.release(cached, stream_key(1));
  try {
    allocator.allocate(6000, stream_key(1), "conv");
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& error) {
    EXPECT_EQ(error.op(), "conv");
    EXPECT_THAT(error.what(), HasSubstr("[conv] out of memory on cuda:3: asked 5.86 KiB (6000 "
                                        "bytes), 8.00 KiB in use, 2.00 KiB cached"));
    EXPECT_THAT(error.what(), HasSubstr("(TESSERA_DEVICE_CACHE_MB=64)"));
  }
  EXPECT_EQ(allocator.stats().cached, 0u);  // the retry freed the cache
  allocator.release(held, stream_key(1));
}

TEST(CachingAllocator, StatsFollowAllocationsAndReleases) {
  FakeDevice device;
  CachingAllocator allocator = make_allocator(device, size_t{1} << 30);
  void* a = allocator.allocate(1000, stream_key(1), "test");  // 1 KiB class
  void* b = allocator.allocate(3000, stream_key(1), "test");  // 3 KiB class
  AllocatorStats stats = allocator.stats();
  EXPECT_EQ(stats.in_use, 4096u);
  EXPECT_EQ(stats.peak_in_use, 4096u);
  EXPECT_EQ(stats.cached, 0u);
  EXPECT_EQ(stats.limit, size_t{1} << 30);
  EXPECT_EQ(stats.raw_allocations, 2u);
  allocator.release(a, stream_key(1));
  stats = allocator.stats();
  EXPECT_EQ(stats.in_use, 3072u);
  EXPECT_EQ(stats.peak_in_use, 4096u);
  EXPECT_EQ(stats.cached, 1024u);
  allocator.release(b, stream_key(1));
  allocator.clear_cache();
  stats = allocator.stats();
  EXPECT_EQ(stats.in_use, 0u);
  EXPECT_EQ(stats.cached, 0u);
  EXPECT_EQ(device.used(), 0u);
}

TEST(CachingAllocator, SteadyStateMakesNoRawAllocations) {
  FakeDevice device;
  CachingAllocator allocator = make_allocator(device);
  const size_t sizes[] = {100, 5000, size_t{3} << 20, 5000, 70000};
  uint64_t after_first = 0;
  for (int iteration = 0; iteration < 50; ++iteration) {
    for (int stream = 1; stream <= 2; ++stream) {
      std::vector<void*> blocks;
      for (size_t bytes : sizes)
        blocks.push_back(allocator.allocate(bytes, stream_key(stream), "test"));
      for (void* block : blocks) allocator.release(block, stream_key(stream));
    }
    device.complete_events();
    if (iteration == 0) after_first = allocator.stats().raw_allocations;
  }
  EXPECT_EQ(allocator.stats().raw_allocations, after_first);
  EXPECT_LE(after_first, 2 * std::size(sizes));
}

TEST(CachingAllocator, ManyThreadsNeverShareABlock) {
  FakeDevice device;
  device.events_complete_at_once = true;
  CachingAllocator allocator = make_allocator(device, size_t{64} << 20);
  std::mutex mu;
  std::set<void*> handed_out;
  bool shared = false;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(t);
      std::vector<void*> mine;
      for (int i = 0; i < 2000; ++i) {
        if (mine.size() < 4 && random() % 2) {
          void* block = allocator.allocate(512 * (1 + random() % 8), stream_key(t % 3 + 1), "test");
          std::lock_guard lock(mu);
          shared |= !handed_out.insert(block).second;
          mine.push_back(block);
        } else if (!mine.empty()) {
          void* block = mine.back();
          mine.pop_back();
          {
            std::lock_guard lock(mu);
            handed_out.erase(block);
          }
          allocator.release(block, stream_key(t % 3 + 1));
        }
      }
      for (void* block : mine) {
        {
          std::lock_guard lock(mu);
          handed_out.erase(block);
        }
        allocator.release(block, stream_key(t % 3 + 1));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_FALSE(shared);
  const AllocatorStats stats = allocator.stats();
  EXPECT_EQ(stats.in_use, 0u);
  EXPECT_LE(stats.raw_allocations,
            8u * 4u * 8u);  // at most what 8 threads x 4 blocks x 8 classes hold
}

TEST(DeviceCacheLimit, ParsesTheSetting) {
  EXPECT_EQ(device_cache_limit(nullptr, 1000), 1000u);
  EXPECT_EQ(device_cache_limit("", 1000), 1000u);
  EXPECT_EQ(device_cache_limit("0", 1000), 0u);
  EXPECT_EQ(device_cache_limit("512", 1000), size_t{512} << 20);
  EXPECT_THROW(device_cache_limit("lots", 1000), InvalidArgument);
  EXPECT_THROW(device_cache_limit("-1", 1000), InvalidArgument);
}

TEST(HumanBytes, PicksTheUnit) {
  EXPECT_EQ(human_bytes(0), "0 B");
  EXPECT_EQ(human_bytes(1023), "1023 B");
  EXPECT_EQ(human_bytes(1536), "1.50 KiB");
  EXPECT_EQ(human_bytes(size_t{3} << 30), "3.00 GiB");
}

}  // namespace
}  // namespace tessera
