// Distributed tests of the group operations of Comm: barrier (nobody leaves before the last rank
// enters) and split (colors, negative colors, key order, ties, nested splits).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

TEST(CommBarrier, NoRankLeavesBeforeTheLastRankEnters) {
  // Timestamps, not durations: steady_clock is one monotonic clock for every thread and every
  // process of this machine, so "left after the late rank entered" holds exactly, under any load.
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    auto now_ns = [] {
      return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                      std::chrono::steady_clock::now().time_since_epoch())
                                      .count());
    };
    const int last = comm->size() - 1;
    comm->barrier();  // line everybody up
    if (comm->rank() == last) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    int64_t last_entered = now_ns();
    comm->barrier();
    const int64_t left = now_ns();
    comm->broadcast(&last_entered, 1, DType::i64, last);
    EXPECT_GE(left, last_entered) << "rank " << comm->rank() << " of " << comm->size()
                                  << " left the barrier before rank " << last << " entered it";
  });
}

// Local backend only (the ranks share the counter); the suite name puts it under the
// -LocalBackend* filter of the mpi runs.
TEST(LocalBackendBarrier, RepeatedBarriersSeparatePhases) {
  if (testing::mpi_backend()) GTEST_SKIP() << "needs shared memory between ranks";
  for (int size = 1; size <= testing::max_world_size; ++size) {
    std::atomic<int> arrivals{0};
    testing::run_world(size, [&](std::shared_ptr<Comm> comm) {
      for (int phase = 1; phase <= 5; ++phase) {
        arrivals.fetch_add(1);
        comm->barrier();
        EXPECT_EQ(arrivals.load(), phase * comm->size());
        comm->barrier();  // nobody starts the next phase while another rank still checks
      }
    });
  }
}

/// Collective over `parent`: checks that `child` (from split(color, key) on every rank) holds
/// exactly the ranks of the same color ordered by (key, parent rank).
void expect_split_members(Comm& parent, const std::shared_ptr<Comm>& child, int color, int key) {
  const std::vector<std::string> colors =
      testing::all_gather_strings(parent, std::to_string(color));
  const std::vector<std::string> keys = testing::all_gather_strings(parent, std::to_string(key));
  if (color < 0) {
    EXPECT_EQ(child, nullptr) << "rank " << parent.rank() << " with a negative color";
    return;
  }
  ASSERT_NE(child, nullptr);
  std::vector<std::pair<int, int>> expected;  // (key, parent rank) of my color
  for (int r = 0; r < parent.size(); ++r)
    if (std::stoi(colors[r]) == color) expected.emplace_back(std::stoi(keys[r]), r);
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(child->size(), static_cast<int>(expected.size()));
  const auto me = std::find(expected.begin(), expected.end(), std::make_pair(key, parent.rank()));
  EXPECT_EQ(child->rank(), static_cast<int>(me - expected.begin()));
  // The child communicates among exactly those ranks, in that order.
  const auto members = testing::all_gather_strings(*child, std::to_string(parent.rank()));
  ASSERT_EQ(members.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(std::stoi(members[i]), expected[i].second);
  EXPECT_EQ(child->backend(), parent.backend());
}

TEST(CommSplit, ColorsGroupRanksOrderedByKeyAndNegativeColorsGetNull) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank();
    // Reverse order inside each color; every third rank opts out.
    const int color = rank % 3 == 2 ? -1 : rank % 2;
    auto child = comm->split(color, -rank);
    expect_split_members(*comm, child, color, -rank);
  });
}

TEST(CommSplit, EqualKeysKeepTheParentOrder) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int color = comm->rank() < comm->size() / 2 ? 0 : 1;
    auto child = comm->split(color, 0);
    expect_split_members(*comm, child, color, 0);
  });
}

TEST(CommSplit, AllNegativeColorsGiveNullEverywhere) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    EXPECT_EQ(comm->split(-1, comm->rank()), nullptr);
    comm->barrier();  // the parent still works afterwards
  });
}

TEST(CommSplit, SplitsOfSplitsAreIndependentCommunicators) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank();
    auto halves = comm->split(rank % 2, rank);
    ASSERT_NE(halves, nullptr);
    auto quarters = halves->split(halves->rank() % 2, halves->rank());
    ASSERT_NE(quarters, nullptr);
    expect_split_members(*halves, quarters, halves->rank() % 2, halves->rank());
    // Collectives on the three levels interleave without mixing up their members.
    int64_t sums[3] = {rank, rank, rank};
    quarters->all_reduce(&sums[0], &sums[0], 1, DType::i64, ReduceOp::sum);
    comm->all_reduce(&sums[1], &sums[1], 1, DType::i64, ReduceOp::sum);
    halves->all_reduce(&sums[2], &sums[2], 1, DType::i64, ReduceOp::sum);
    int64_t expected[3] = {0, 0, 0};
    for (int r = 0; r < comm->size(); ++r) {
      const int half_rank = r / 2;  // rank order inside a parity class
      if (r % 2 == rank % 2 && half_rank % 2 == halves->rank() % 2) expected[0] += r;
      expected[1] += r;
      if (r % 2 == rank % 2) expected[2] += r;
    }
    EXPECT_EQ(sums[0], expected[0]);
    EXPECT_EQ(sums[1], expected[1]);
    EXPECT_EQ(sums[2], expected[2]);
  });
}

}  // namespace
}  // namespace tessera
