// Unit tests of the mpi backend's staging decisions and pinned-block pool
// (core/comm/mpi_staging.hpp), with malloc standing in for the pinned allocator.
#include "core/comm/mpi_staging.hpp"

#include <gtest/gtest.h>

#include <cstdlib>

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

}  // namespace
}  // namespace tessera
