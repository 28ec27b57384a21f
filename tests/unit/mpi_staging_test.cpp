// Unit tests of the mpi backend's staging decisions and pinned-block pool
// (core/comm/mpi_staging.hpp), with malloc standing in for the pinned allocator.
#include "core/comm/mpi_staging.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "core/errors.hpp"

namespace tessera {
namespace {

int live_blocks = 0;
void* counting_allocate(size_t bytes) {
  ++live_blocks;
  return std::malloc(bytes);
}
void counting_release(void* pointer) noexcept {
  --live_blocks;
  std::free(pointer);
}

TEST(MpiStaging, TheEnvironmentOverridesTheLibrarysAnswer) {
  EXPECT_TRUE(choose_mpi_cuda_aware("1", 0));
  EXPECT_FALSE(choose_mpi_cuda_aware("0", 1));
  EXPECT_TRUE(choose_mpi_cuda_aware(nullptr, 1));
  EXPECT_FALSE(choose_mpi_cuda_aware("", 0));
  // A library that cannot tell is treated as not CUDA-aware: staging is always safe.
  EXPECT_FALSE(choose_mpi_cuda_aware(nullptr, -1));
  EXPECT_THROW(choose_mpi_cuda_aware("yes", 1), InvalidArgument);
}

TEST(MpiStaging, PoolReusesAFreedBlockThatFits) {
  StagingPool pool(counting_allocate, counting_release);
  void* first = nullptr;
  {
    StagingPool::Lease lease = pool.acquire(1000);
    first = lease.data();
    ASSERT_NE(first, nullptr);
  }
  StagingPool::Lease again = pool.acquire(3000);  // fits the 4 KiB block given back above
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(pool.blocks(), 1u);
  EXPECT_EQ(pool.bytes_reserved(), 4096u);
}

TEST(MpiStaging, ConcurrentLeasesGetDistinctBlocksAndTheSmallestFreeOneIsChosen) {
  StagingPool pool(counting_allocate, counting_release);
  StagingPool::Lease small = pool.acquire(100);
  StagingPool::Lease large = pool.acquire(100000);
  EXPECT_NE(small.data(), large.data());
  EXPECT_EQ(pool.bytes_reserved(), 4096u + 131072u);
  void* small_block = small.data();
  small = StagingPool::Lease();
  large = StagingPool::Lease();
  EXPECT_EQ(pool.acquire(10).data(), small_block);
  EXPECT_EQ(pool.acquire(0).data(), nullptr);
}

TEST(MpiStaging, BlocksAreReleasedWhenThePoolAndItsLeasesAreGone) {
  live_blocks = 0;
  {
    StagingPool::Lease outliving;
    {
      StagingPool pool(counting_allocate, counting_release);
      outliving = pool.acquire(64);
      StagingPool::Lease other = pool.acquire(64);
      EXPECT_EQ(live_blocks, 2);
    }
    EXPECT_EQ(live_blocks, 2);  // the lease keeps the pool's blocks alive
  }
  EXPECT_EQ(live_blocks, 0);
}

TEST(MpiStaging, WrittenRangesAreTheReceiveBlocksWithTheGapsBetweenThemLeftOut) {
  // all_to_all_v's receive side on 3 ranks, 4-byte elements: blocks of 2, 0 and 1 elements at
  // 0, 3 and 4, a one-element gap after the first; the zero-count block writes nothing.
  const std::vector<size_t> counts{2, 0, 1}, displs{0, 3, 4};
  EXPECT_EQ(written_ranges(counts, displs, 4), (std::vector<ByteRange>{{0, 8}, {16, 4}}));
  // Out of order and touching: merged into one range in order of offset.
  const std::vector<size_t> counts2{1, 2, 1}, displs2{3, 1, 7};
  EXPECT_EQ(written_ranges(counts2, displs2, 2), (std::vector<ByteRange>{{2, 6}, {14, 2}}));
  // Overlapping blocks (a receive buffer written twice) merge to their union.
  const std::vector<size_t> counts3{4, 2}, displs3{0, 1};
  EXPECT_EQ(written_ranges(counts3, displs3, 1), (std::vector<ByteRange>{{0, 4}}));
  // Nothing received: nothing to copy back.
  const std::vector<size_t> none{0, 0}, at{0, 5};
  EXPECT_TRUE(written_ranges(none, at, 8).empty());
}

}  // namespace
}  // namespace tessera
