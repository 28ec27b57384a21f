// Tests of the distributed test harness itself: run_world gives every rank of the requested
// world exactly once, and under mpiexec the MPI world is the launcher's (not N singletons, which
// would make every other test pass vacuously).
#include "tests/dist/harness.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>

namespace tessera {
namespace {

TEST(Harness, RunWorldGivesEveryRankOfTheWorldExactlyOnce) {
  std::atomic<int> bodies_run{0};  // one per rank that ran a body
  for (int size = 1; size <= testing::max_world_size; ++size) {
    testing::run_world(size, [&](std::shared_ptr<Comm> comm) {
      EXPECT_EQ(comm->size(), size);
      int64_t one = 1, rank_sum = comm->rank();
      comm->all_reduce(&one, &one, 1, DType::i64, ReduceOp::sum);
      comm->all_reduce(&rank_sum, &rank_sum, 1, DType::i64, ReduceOp::sum);
      EXPECT_EQ(one, size);
      EXPECT_EQ(rank_sum, int64_t{size} * (size - 1) / 2);
      ++bodies_run;
    });
  }
  // Local: every rank of worlds 1..8 in this process; mpi: this process's rank of one world.
  const int local_bodies = testing::max_world_size * (testing::max_world_size + 1) / 2;
  EXPECT_EQ(bodies_run.load(), testing::mpi_backend() ? 1 : local_bodies);
}

TEST(Harness, MpiWorldIsTheLaunchersWorld) {
  if (!testing::mpi_backend()) GTEST_SKIP() << "runs under mpiexec only";
  const std::shared_ptr<Comm> world = mpi_world();
  EXPECT_EQ(world->backend(), "mpi");
  for (const char* variable : {"PMI_SIZE", "OMPI_COMM_WORLD_SIZE"})
    if (const char* size = std::getenv(variable)) {
      EXPECT_EQ(world->size(), std::atoi(size)) << variable;
    }
  EXPECT_LE(world->size(), testing::max_world_size) << "larger worlds would run no test body";
}

}  // namespace
}  // namespace tessera
