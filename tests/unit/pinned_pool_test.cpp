// Unit tests of the pinned staging pool over a fake page-locked source (plain host memory with a
// capacity).
#include "core/backend/pinned_pool.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/errors.hpp"

namespace tessera {
namespace {

class FakePinnedMemory {
 public:
  explicit FakePinnedMemory(size_t capacity = SIZE_MAX) : capacity_(capacity) {}
  PinnedSource source() {
    return {[this](size_t bytes) -> void* {
              std::lock_guard lock(mu_);
              if (bytes > capacity_ - used_) return nullptr;
              used_ += bytes;
              void* data = std::malloc(bytes);
              blocks_[data] = bytes;
              return data;
            },
            [this](void* data) {
              std::lock_guard lock(mu_);
              used_ -= blocks_.at(data);
              blocks_.erase(data);
              std::free(data);
            }};
  }
  size_t used() {
    std::lock_guard lock(mu_);
    return used_;
  }

 private:
  std::mutex mu_;
  size_t capacity_;
  size_t used_ = 0;
  std::map<void*, size_t> blocks_;
};

TEST(PinnedSizeClass, PowersOfTwoFrom64KiB) {
  EXPECT_EQ(pinned_size_class(0), size_t{64} << 10);
  EXPECT_EQ(pinned_size_class(1000), size_t{64} << 10);
  EXPECT_EQ(pinned_size_class((size_t{64} << 10) + 1), size_t{128} << 10);
  EXPECT_EQ(pinned_size_class(size_t{3} << 20), size_t{4} << 20);
}

TEST(PinnedPool, ReusesAReturnedSlab) {
  FakePinnedMemory memory;
  PinnedPool pool(memory.source(), size_t{64} << 20);
  void* first = nullptr;
  {
    PinnedSlab slab = pool.acquire(100000, "test");
    ASSERT_NE(slab.data(), nullptr);
    EXPECT_GE(slab.size(), 100000u);
    std::memset(slab.data(), 1, slab.size());  // the whole slab is usable
    first = slab.data();
    EXPECT_EQ(pool.stats().in_use, slab.size());
  }
  EXPECT_EQ(pool.stats().in_use, 0u);
  EXPECT_EQ(pool.stats().cached, size_t{128} << 10);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(pool.acquire(70000, "test").data(), first);
  EXPECT_EQ(pool.stats().raw_allocations, 1u);
}

TEST(PinnedPool, SlabsLentOutAreDistinct) {
  FakePinnedMemory memory;
  PinnedPool pool(memory.source(), size_t{64} << 20);
  PinnedSlab a = pool.acquire(1000, "test");
  PinnedSlab b = pool.acquire(1000, "test");
  EXPECT_NE(a.data(), b.data());
  PinnedSlab moved = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(pool.stats().in_use, size_t{128} << 10);
}

TEST(PinnedPool, KeepsAtMostTheLimitIdle) {
  FakePinnedMemory memory;
  PinnedPool pool(memory.source(), size_t{128} << 10);
  {
    PinnedSlab a = pool.acquire(1, "test"), b = pool.acquire(1, "test"),
               c = pool.acquire(1, "test");
  }
  EXPECT_EQ(pool.stats().cached, size_t{128} << 10);
  EXPECT_EQ(memory.used(), size_t{128} << 10);
  pool.clear();
  EXPECT_EQ(memory.used(), 0u);
}

TEST(PinnedPool, FailedAllocationFreesIdleSlabsAndRetries) {
  FakePinnedMemory memory(size_t{256} << 10);
  PinnedPool pool(memory.source(), size_t{1} << 30);
  { PinnedSlab idle = pool.acquire(size_t{128} << 10, "test"); }
  PinnedSlab big = pool.acquire(size_t{256} << 10, "test");  // needs the idle slab's memory
  EXPECT_EQ(big.size(), size_t{256} << 10);
  EXPECT_EQ(pool.stats().cached, 0u);
  try {
    pool.acquire(1, "write_h5");
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(),
                ::testing::HasSubstr("[write_h5] out of pinned host memory: asked 64.00 KiB"));
  }
}

TEST(PinnedPool, ManyThreadsShareThePool) {
  FakePinnedMemory memory;
  PinnedPool pool(memory.source(), size_t{64} << 20);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&pool, t] {
      for (int i = 0; i < 500; ++i) {
        PinnedSlab slab = pool.acquire(1000 * (1 + (i + t) % 100), "test");
        static_cast<char*>(slab.data())[0] = static_cast<char>(t);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(pool.stats().in_use, 0u);
  EXPECT_LE(pool.stats().raw_allocations,
            8u * 2u);  // two classes, at most one slab per thread each
}

}  // namespace
}  // namespace tessera
