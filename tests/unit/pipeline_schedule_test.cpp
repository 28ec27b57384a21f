// Pipeline schedules and stage-to-stage transfer pieces (ops/nn/pipeline_schedule.hpp,
// ops/nn/stage_boxes.hpp), as pure functions: every schedule runs each unit's forward and
// backward once and never deadlocks (simulated with blocking receives and non-blocking sends),
// keeps at most the activations it promises, and with equal stage times has the bubble of its
// formula; the transfer pieces give every receiving rank exactly its box once.
#include "ops/nn/pipeline_schedule.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/errors.hpp"
#include "ops/nn/stage_boxes.hpp"

namespace tessera::nn {
namespace {

using Kind = PipelineAction::Kind;

struct Simulation {
  bool deadlocked = false;
  double makespan = 0;
};

/// Runs every rank's actions in order, each taking `unit_time` once its inputs exist: a forward
/// of stage s after the forward of stage s - 1 (same micro-batch) has finished, a backward after
/// the backward of stage s + 1 and its own forward. Sends never block, as in StageBoundary.
Simulation simulate(PipelineSchedule schedule, int p, int m, int v, double unit_time) {
  const int stages = schedule == PipelineSchedule::interleaved ? p * v : p;
  const int chunks = stages / p;
  std::vector<std::vector<PipelineAction>> actions(p);
  for (int r = 0; r < p; ++r) actions[r] = schedule_actions(schedule, p, r, m, chunks);
  std::vector<size_t> next(p, 0);
  std::vector<double> free_at(p, 0);
  std::map<std::tuple<int, int, int>, double> done;  // (kind, stage, micro-batch) -> end time
  Simulation result;
  while (true) {
    bool progressed = false, finished = true;
    for (int r = 0; r < p; ++r) {
      if (next[r] == actions[r].size()) continue;
      finished = false;
      const PipelineAction& action = actions[r][next[r]];
      const int stage = action.chunk * p + r;
      double ready = free_at[r];
      auto need = [&](Kind kind, int s) {
        auto it = done.find({static_cast<int>(kind), s, action.micro_batch});
        if (it == done.end()) return false;
        ready = std::max(ready, it->second);
        return true;
      };
      bool can = true;
      if (action.kind == Kind::forward) {
        if (stage > 0) can = need(Kind::forward, stage - 1);
      } else {
        can = need(Kind::forward, stage);
        if (can && stage + 1 < stages) can = need(Kind::backward, stage + 1);
      }
      if (!can) continue;
      free_at[r] = ready + unit_time;
      done[{static_cast<int>(action.kind), stage, action.micro_batch}] = free_at[r];
      ++next[r];
      progressed = true;
    }
    if (finished) break;
    if (!progressed) {
      result.deadlocked = true;
      return result;
    }
  }
  result.makespan = *std::max_element(free_at.begin(), free_at.end());
  return result;
}

struct Case {
  PipelineSchedule schedule;
  int p, m, v;
};

std::vector<Case> cases() {
  std::vector<Case> all;
  for (int p : {1, 2, 3, 4})
    for (int m : {1, 2, 3, 4, 5, 8}) {
      all.push_back({PipelineSchedule::gpipe, p, m, 1});
      all.push_back({PipelineSchedule::one_f_one_b, p, m, 1});
    }
  for (int p : {2, 3, 4})
    for (int v : {2, 3})
      for (int groups : {1, 2, 3}) all.push_back({PipelineSchedule::interleaved, p, groups * p, v});
  return all;
}

std::string name(const Case& c) {
  return fmt::format("{} p={} m={} v={}", schedule_name(c.schedule), c.p, c.m, c.v);
}

TEST(PipelineSchedule, EveryUnitRunsForwardThenBackwardOnce) {
  for (const Case& c : cases())
    for (int r = 0; r < c.p; ++r) {
      const auto actions = schedule_actions(c.schedule, c.p, r, c.m, c.v);
      std::set<std::pair<int, int>> forwarded, backwarded;
      for (const PipelineAction& action : actions) {
        const std::pair<int, int> unit{action.chunk, action.micro_batch};
        ASSERT_GE(action.chunk, 0);
        ASSERT_LT(action.chunk, c.schedule == PipelineSchedule::interleaved ? c.v : 1);
        if (action.kind == Kind::forward) {
          EXPECT_TRUE(forwarded.insert(unit).second) << name(c) << " rank " << r;
        } else {
          EXPECT_TRUE(forwarded.count(unit)) << name(c) << " backward before forward";
          EXPECT_TRUE(backwarded.insert(unit).second) << name(c) << " rank " << r;
        }
      }
      const size_t units =
          static_cast<size_t>(c.m) * (c.schedule == PipelineSchedule::interleaved ? c.v : 1);
      EXPECT_EQ(forwarded.size(), units) << name(c);
      EXPECT_EQ(backwarded.size(), units) << name(c);
    }
}

// Each chunk sees its micro-batches in order, forwards and backwards alike: transfers over one
// boundary then match in order.
TEST(PipelineSchedule, EachChunkRunsItsMicroBatchesInOrder) {
  for (const Case& c : cases())
    for (int r = 0; r < c.p; ++r) {
      std::map<std::pair<int, int>, int> last;  // (kind, chunk) -> last micro-batch
      for (const PipelineAction& action : schedule_actions(c.schedule, c.p, r, c.m, c.v)) {
        auto [it, fresh] = last.try_emplace({static_cast<int>(action.kind), action.chunk}, -1);
        EXPECT_EQ(action.micro_batch, it->second + 1) << name(c) << " rank " << r;
        it->second = action.micro_batch;
      }
    }
}

TEST(PipelineSchedule, NoScheduleDeadlocksWithBlockingReceives) {
  for (const Case& c : cases())
    EXPECT_FALSE(simulate(c.schedule, c.p, c.m, c.v, 1).deadlocked) << name(c);
}

// GPipe keeps every micro-batch alive; 1F1B at most p - r on rank r (stage s = r); interleaved
// Megatron's warm-up plus one.
TEST(PipelineSchedule, ActivationsInFlightStayWithinTheSchedulesBound) {
  for (const Case& c : cases())
    for (int r = 0; r < c.p; ++r) {
      const int alive = max_in_flight(schedule_actions(c.schedule, c.p, r, c.m, c.v));
      switch (c.schedule) {
        case PipelineSchedule::gpipe: EXPECT_EQ(alive, c.m) << name(c); break;
        case PipelineSchedule::one_f_one_b:
          EXPECT_EQ(alive, std::min(c.p - r, c.m)) << name(c) << " rank " << r;
          break;
        case PipelineSchedule::interleaved:
          EXPECT_EQ(alive, std::min((c.p - r - 1) * 2 + (c.v - 1) * c.p + 1, c.m * c.v))
              << name(c) << " rank " << r;
          break;
      }
    }
}

// With every forward and backward of a stage taking the same time (1/v of a rank's work per
// chunk), the simulated bubble is (p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1).
TEST(PipelineSchedule, EqualStageTimesGiveTheFormulasBubble) {
  for (const Case& c : cases()) {
    const int v = c.schedule == PipelineSchedule::interleaved ? c.v : 1;
    const Simulation run = simulate(c.schedule, c.p, c.m, c.v, 1.0 / v);
    const double busy = 2.0 * c.m;  // m forwards and m backwards of the whole rank's layers
    EXPECT_NEAR(1 - busy / run.makespan, ideal_bubble_fraction(c.schedule, c.p, c.m, c.v), 1e-12)
        << name(c);
  }
}

TEST(PipelineSchedule, ProblemsNameTheStageAndMicroBatchCounts) {
  EXPECT_EQ(schedule_problem(PipelineSchedule::one_f_one_b, 2, 2, 3), std::nullopt);
  EXPECT_NE(schedule_problem(PipelineSchedule::one_f_one_b, 2, 3, 4), std::nullopt);
  EXPECT_NE(schedule_problem(PipelineSchedule::gpipe, 4, 8, 4), std::nullopt);
  EXPECT_EQ(schedule_problem(PipelineSchedule::interleaved, 2, 4, 4), std::nullopt);
  EXPECT_NE(schedule_problem(PipelineSchedule::interleaved, 2, 2, 4), std::nullopt);  // v = 1
  EXPECT_NE(schedule_problem(PipelineSchedule::interleaved, 2, 5, 4), std::nullopt);
  EXPECT_NE(schedule_problem(PipelineSchedule::interleaved, 2, 4, 3), std::nullopt);  // m % p
  EXPECT_NE(schedule_problem(PipelineSchedule::gpipe, 2, 2, 0), std::nullopt);
  EXPECT_EQ(parse_schedule("1f1b"), PipelineSchedule::one_f_one_b);
  EXPECT_THROW(parse_schedule("zero-bubble"), InvalidArgument);
}

/// Every receiving rank gets each index of its box exactly once, from a sender that owns it.
void expect_exact_cover(const ShardSpec& from, const ShardSpec& to) {
  const auto boxes = stage_boxes(from, to);
  const int ranks = mesh_size(to.mesh_shape);
  int64_t expected_volume = 0;
  for (int receiver = 0; receiver < ranks; ++receiver) {
    const Box needed = to.local_box_of_rank(receiver);
    expected_volume += needed.volume();
    int64_t covered = 0;
    for (const StageBox& piece : boxes) {
      if (piece.receiver != receiver) continue;
      EXPECT_EQ(intersect(piece.box, needed), piece.box);
      EXPECT_EQ(intersect(piece.box, from.local_box_of_rank(piece.sender)), piece.box);
      for (const StageBox& other : boxes) {
        if (other.receiver == receiver && &other != &piece) {
          EXPECT_TRUE(intersect(other.box, piece.box).empty());
        }
      }
      covered += piece.box.volume();
    }
    EXPECT_EQ(covered, needed.volume())
        << "receiver " << receiver << " " << from.str() << " -> " << to.str();
  }
  EXPECT_EQ(stage_boxes_volume(boxes), expected_volume);
}

// dp x tp x domain stage meshes: rows over domain to channels over domain, replicated over tp to
// sharded over tp, uneven extents, and identical layouts (each rank talks to its twin only).
TEST(StageBoxes, EveryReceiverGetsExactlyItsBoxOnce) {
  const std::vector<int> mesh{2, 2, 2};
  const Shape shape{4, 2, 11, 8};
  using P = Placement;
  const ShardSpec rows = ShardSpec::make(shape, mesh, {P::shard(0), P::replicate(), P::shard(2)});
  const ShardSpec channels =
      ShardSpec::make(shape, mesh, {P::shard(0), P::replicate(), P::shard(1)});
  const ShardSpec uneven =
      ShardSpec::make(shape, mesh, {P::shard(0), P::shard(3), P::shard(2)}, {{}, {1, 7}, {0, 11}});
  const ShardSpec replicated =
      ShardSpec::make(shape, mesh, {P::replicate(), P::replicate(), P::replicate()});
  for (const ShardSpec* from : {&rows, &channels, &uneven, &replicated})
    for (const ShardSpec* to : {&rows, &channels, &uneven, &replicated})
      expect_exact_cover(*from, *to);
  // The same layout on both stages: one piece per rank, to its twin.
  const auto same = stage_boxes(rows, rows);
  ASSERT_EQ(same.size(), 8u);
  for (const StageBox& piece : same) EXPECT_EQ(piece.sender, piece.receiver);
  // From a replicated layout each receiver reads its own coordinate's replica.
  for (const StageBox& piece : stage_boxes(replicated, channels))
    EXPECT_EQ(piece.sender, piece.receiver);
  EXPECT_THROW(
      stage_boxes(ShardSpec::make(shape, mesh, {P::partial(), P::replicate(), P::replicate()}),
                  rows),
      InvalidArgument);
}

}  // namespace
}  // namespace tessera::nn
