// Unit tests of the nccl backend's grouping plans (core/comm/nccl_plan.hpp): which sends,
// receives and local copies a batch or a v-collective becomes, in which order, and how counts
// beyond the chunk limit are split. No NCCL is linked.
#include "core/comm/nccl_plan.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <tuple>

#include "core/errors.hpp"

namespace tessera::nccl_plan {
namespace {

using Kind = Transfer::Kind;

/// Total elements moved per (kind, peer).
std::map<std::pair<Kind, int>, size_t> totals(const std::vector<Transfer>& plan) {
  std::map<std::pair<Kind, int>, size_t> sums;
  for (const Transfer& transfer : plan) sums[{transfer.kind, transfer.peer}] += transfer.count;
  return sums;
}

TEST(NcclPlan, AllToAllVMovesExactlyEachBlockAndCopiesItsOwn) {
  const std::vector<size_t> send_counts{2, 0, 3}, send_displs{0, 2, 2};
  const std::vector<size_t> recv_counts{1, 0, 4}, recv_displs{0, 1, 1};
  const auto plan = plan_all_to_all_v(1, send_counts, send_displs, recv_counts, recv_displs);
  // Rank 1 sends nothing to itself and receives nothing from itself: no copy; zero counts make
  // no call.
  const std::vector<Transfer> expected{{.kind = Kind::send, .peer = 0, .offset = 0, .count = 2},
                                       {.kind = Kind::recv, .peer = 0, .offset = 0, .count = 1},
                                       {.kind = Kind::send, .peer = 2, .offset = 2, .count = 3},
                                       {.kind = Kind::recv, .peer = 2, .offset = 1, .count = 4}};
  EXPECT_EQ(plan, expected);
}

TEST(NcclPlan, AllToAllVSelfBlockIsACopyBetweenTheDisplacements) {
  const std::vector<size_t> counts{1, 2}, send_displs{0, 1}, recv_displs{0, 1};
  const auto plan = plan_all_to_all_v(1, counts, send_displs, counts, recv_displs);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[2],
            (Transfer{.kind = Kind::copy, .peer = 1, .offset = 1, .count = 2, .dst_offset = 1}));
}

TEST(NcclPlan, AllGatherVUnevenCountsReceiveEachRanksBlockAtItsPrefixSum) {
  const std::vector<size_t> counts{3, 0, 5, 1};
  const auto plan = plan_all_gather_v(2, 5, counts);
  const auto sums = totals(plan);
  EXPECT_EQ(sums.at({Kind::send, 0}), 5u);
  EXPECT_EQ(sums.count({Kind::send, 1}), 1u);  // rank 1 gets this rank's block too
  EXPECT_EQ(sums.at({Kind::recv, 0}), 3u);
  EXPECT_EQ(sums.count({Kind::recv, 1}), 0u);  // rank 1 sends nothing: no call
  EXPECT_EQ(sums.at({Kind::recv, 3}), 1u);
  for (const Transfer& transfer : plan) {
    if (transfer.kind == Kind::recv && transfer.peer == 3) {
      EXPECT_EQ(transfer.offset, 8u);
    }
    if (transfer.kind == Kind::copy) {
      EXPECT_EQ(transfer.dst_offset, 3u);
      EXPECT_EQ(transfer.count, 5u);
    }
  }
}

TEST(NcclPlan, GatherVNonRootsOnlySendAndTheRootOnlyReceives) {
  const std::vector<size_t> counts{2, 4, 1};
  const auto leaf = plan_gather_v(1, 3, 4, counts, 2);
  EXPECT_EQ(leaf,
            (std::vector<Transfer>{{.kind = Kind::send, .peer = 2, .offset = 0, .count = 4}}));
  const auto root = plan_gather_v(2, 3, 1, counts, 2);
  EXPECT_EQ(root, (std::vector<Transfer>{
                      {.kind = Kind::recv, .peer = 0, .offset = 0, .count = 2},
                      {.kind = Kind::recv, .peer = 1, .offset = 2, .count = 4},
                      {.kind = Kind::copy, .peer = 2, .offset = 0, .count = 1, .dst_offset = 6}}));
}

TEST(NcclPlan, ScatterVRootSendsEachBlockFromItsDisplacement) {
  const std::vector<size_t> counts{2, 0, 3};
  const auto root = plan_scatter_v(0, 3, counts, 2, 0);
  EXPECT_EQ(root, (std::vector<Transfer>{
                      {.kind = Kind::copy, .peer = 0, .offset = 0, .count = 2, .dst_offset = 0},
                      {.kind = Kind::send, .peer = 2, .offset = 2, .count = 3}}));
  EXPECT_TRUE(plan_scatter_v(1, 3, {}, 0, 0).empty());
  EXPECT_EQ(plan_scatter_v(2, 3, {}, 3, 0),
            (std::vector<Transfer>{{.kind = Kind::recv, .peer = 0, .offset = 0, .count = 3}}));
}

TEST(NcclPlan, ReduceScatterVReceivesEveryRanksCopyOfThisBlockIntoItsSlot) {
  const std::vector<size_t> counts{1, 3, 2};
  const auto plan = plan_reduce_scatter_v(1, counts);
  EXPECT_EQ(plan, (std::vector<Transfer>{
                      {.kind = Kind::send, .peer = 0, .offset = 0, .count = 1},
                      {.kind = Kind::recv, .peer = 0, .offset = 0, .count = 3},
                      {.kind = Kind::copy, .peer = 1, .offset = 1, .count = 3, .dst_offset = 3},
                      {.kind = Kind::send, .peer = 2, .offset = 4, .count = 2},
                      {.kind = Kind::recv, .peer = 2, .offset = 6, .count = 3}}));
}

TEST(NcclPlan, CountsBeyondTheLimitAreChunkedIdenticallyOnBothSides) {
  const std::vector<size_t> counts{10, 10};
  const auto sender = plan_all_gather_v(0, 10, counts, 4);
  const auto receiver = plan_all_gather_v(1, 10, counts, 4);
  std::vector<std::pair<size_t, size_t>> sent, received;
  for (const Transfer& t : sender)
    if (t.kind == Kind::send) sent.emplace_back(t.offset, t.count);
  for (const Transfer& t : receiver)
    if (t.kind == Kind::recv && t.peer == 0) received.emplace_back(t.offset, t.count);
  EXPECT_EQ(sent, (std::vector<std::pair<size_t, size_t>>{{0, 4}, {4, 4}, {8, 2}}));
  EXPECT_EQ(received, sent);
  for (const Transfer& t : sender)
    if (t.kind == Kind::copy) {
      EXPECT_LE(t.count, 4u);
    }
}

TEST(NcclPlan, BatchesIssueEachPeersMessagesInTagOrderSoBothEndsAgree) {
  char buffer[64];
  // Rank 0 posts tag 7 then tag 3 to rank 1; rank 1 posts its receives the other way round.
  const P2POp sender_ops[] = {P2POp::send(buffer, 5, 1, 7), P2POp::send(buffer, 9, 1, 3)};
  const P2POp receiver_ops[] = {P2POp::recv(buffer, 9, 0, 3), P2POp::recv(buffer, 5, 0, 7)};
  const auto sends = plan_p2p(sender_ops, 0);
  const auto recvs = plan_p2p(receiver_ops, 1);
  ASSERT_EQ(sends.size(), 2u);
  ASSERT_EQ(recvs.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(sends[i].count, recvs[i].count) << "call " << i;
  EXPECT_EQ(sends[0].op, 1u);  // tag 3 first
  EXPECT_EQ(recvs[0].op, 0u);
}

TEST(NcclPlan, BatchMessagesToItselfBecomeCopiesMatchedByTag) {
  char a[8], b[8];
  const P2POp ops[] = {P2POp::recv(b, 4, 2, 1), P2POp::send(a, 4, 2, 1), P2POp::send(a, 3, 0, 0)};
  const auto plan = plan_p2p(ops, 2);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].kind, Kind::send);
  EXPECT_EQ(plan[1], (Transfer{.kind = Kind::copy,
                               .peer = 2,
                               .offset = 0,
                               .count = 4,
                               .dst_offset = 0,
                               .op = 1,
                               .dst_op = 0}));
}

TEST(NcclPlan, AnUnmatchedMessageToItselfIsAnError) {
  char a[8];
  const P2POp lone_send[] = {P2POp::send(a, 4, 0, 1)};
  EXPECT_THROW(plan_p2p(lone_send, 0), CommError);
  const P2POp wrong_size[] = {P2POp::send(a, 4, 0, 1), P2POp::recv(a, 2, 0, 1)};
  EXPECT_THROW(plan_p2p(wrong_size, 0), CommError);
}

TEST(NcclPlan, SmallAllGathersOverManyRanksRunAsAnAllReduce) {
  EXPECT_TRUE(gather_by_all_reduce(kGatherByReduceMinRanks, 8));
  EXPECT_TRUE(gather_by_all_reduce(1024, static_cast<double>(kGatherByReduceMaxBytes)));
  EXPECT_FALSE(gather_by_all_reduce(1024, static_cast<double>(kGatherByReduceMaxBytes) + 1));
  EXPECT_FALSE(gather_by_all_reduce(kGatherByReduceMinRanks - 1, 8));
  EXPECT_FALSE(gather_by_all_reduce(1024, 0));  // nothing to move
  // The environment moves the rank threshold (a one-GPU machine tests the path with 1).
  ::setenv("TESSERA_NCCL_GATHER_BY_REDUCE_RANKS", "1", 1);
  EXPECT_TRUE(gather_by_all_reduce(1, 8));
  ::setenv("TESSERA_NCCL_GATHER_BY_REDUCE_RANKS", "zero", 1);
  EXPECT_THROW(gather_by_all_reduce(1, 8), InvalidArgument);
  ::unsetenv("TESSERA_NCCL_GATHER_BY_REDUCE_RANKS");
  EXPECT_EQ(gather_by_all_reduce_min_ranks(), kGatherByReduceMinRanks);
}

TEST(NcclPlan, CountsEqualDecidesTheNativeCollective) {
  EXPECT_TRUE(counts_equal(std::vector<size_t>{3, 3, 3}));
  EXPECT_TRUE(counts_equal(std::vector<size_t>{}));
  EXPECT_FALSE(counts_equal(std::vector<size_t>{3, 2, 3}));
}

}  // namespace
}  // namespace tessera::nccl_plan
