// Distributed tests of launching (local backend only, hence the LocalBackend prefix that the
// mpiexec runs filter out): every rank runs with its own RankContext, a device that cannot exist
// is one error before any rank starts, and the nccl backend refuses cpu ranks (or a build
// without NCCL) with a clear error.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>

#include "core/comm/nccl_comm.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"
#include "tests/common/scoped_env.hpp"
#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

using testing::ScopedEnv;

TEST(LocalBackendLaunch, EveryRankRunsWithItsOwnCpuRankContextByDefault) {
  ScopedEnv device("TESSERA_DEVICE", nullptr);
  std::mutex mu;
  std::set<const RankContext*> contexts;
  run_local_ranks(4, [&](std::shared_ptr<Comm> comm) {
    const RankContext& context = current_rank_context();
    EXPECT_TRUE(context.device().is_cpu()) << "rank " << comm->rank();
    {
      std::lock_guard lock(mu);
      contexts.insert(&context);
    }
    comm->barrier();  // every context is alive until all are counted
  });
  EXPECT_EQ(contexts.size(), 4u);
}

TEST(LocalBackendLaunch, ADeviceBeyondTheVisibleOnesIsOneErrorBeforeAnyRankStarts) {
  const std::string beyond = "cuda:" + std::to_string(gpu::device_count() + 3);
  ScopedEnv device("TESSERA_DEVICE", beyond.c_str());
  std::atomic<int> started{0};
  try {
    run_local_ranks(3, [&](std::shared_ptr<Comm>) { ++started; });
    FAIL() << "expected InvalidArgument for TESSERA_DEVICE=" << beyond;
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("TESSERA_DEVICE=" + beyond), std::string::npos)
        << error.what();
  }
  EXPECT_EQ(started, 0);
}

TEST(LocalBackendLaunch, NcclRefusesCpuRanksOrABuildWithoutNccl) {
  ScopedEnv device("TESSERA_DEVICE", nullptr);
  run_local_ranks(2, [&](std::shared_ptr<Comm> comm) {
    try {
      make_nccl_comm(comm);
      ADD_FAILURE() << "expected an error on rank " << comm->rank();
    } catch (const NotAvailable& error) {
      EXPECT_FALSE(nccl_compiled());
      EXPECT_NE(std::string(error.what()).find("without NCCL"), std::string::npos) << error.what();
    } catch (const InvalidArgument& error) {
      EXPECT_TRUE(nccl_compiled());
      EXPECT_NE(std::string(error.what()).find("TESSERA_DEVICE=cuda"), std::string::npos)
          << error.what();
    }
  });
}

}  // namespace
}  // namespace tessera
