// Ring attention's sequence assignments (ops/ring_attention/zigzag_plan.hpp): the zigzag chunks
// cover the sequence once; row moves between any two assignments deliver every global row to
// the rank and local row that hold it; visible_keys is the causal prefix; with zigzag every rank
// computes nearly the same number of unmasked products and the ring's critical path drops from
// about P blocks to about (P + 1) / 2.
#include "ops/ring_attention/zigzag_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "core/layout.hpp"
#include "ops/ring_attention/attention_block.hpp"

namespace tessera::ops {
namespace {

/// Every global index of `assignment` mapped to its (rank, local row).
std::map<int64_t, std::pair<int, int64_t>> owners(const SequenceAssignment& assignment) {
  std::map<int64_t, std::pair<int, int64_t>> owner;
  for (size_t rank = 0; rank < assignment.size(); ++rank) {
    int64_t row = 0;
    for (const SequenceSegment& segment : assignment[rank])
      for (int64_t g = segment.offset; g < segment.offset + segment.extent; ++g)
        EXPECT_TRUE(owner.emplace(g, std::pair{static_cast<int>(rank), row++}).second) << g;
  }
  return owner;
}

std::vector<int64_t> random_extents(int64_t length, int ranks, std::mt19937& rng) {
  std::vector<int64_t> cuts{0, length};
  for (int i = 0; i < ranks - 1; ++i)
    cuts.push_back(std::uniform_int_distribution<int64_t>(0, length)(rng));
  std::sort(cuts.begin(), cuts.end());
  std::vector<int64_t> extents;
  for (size_t i = 1; i < cuts.size(); ++i) extents.push_back(cuts[i] - cuts[i - 1]);
  return extents;
}

TEST(ZigzagPlan, ChunksCoverTheSequenceOnceRankRHoldingChunksRAndMirror) {
  for (int ranks = 1; ranks <= 6; ++ranks)
    for (int64_t length = 0; length <= 30; ++length) {
      const SequenceAssignment zigzag = zigzag_assignment(length, ranks);
      ASSERT_EQ(zigzag.size(), static_cast<size_t>(ranks));
      EXPECT_EQ(owners(zigzag).size(), static_cast<size_t>(length));
      const std::vector<int64_t> chunks = default_split(length, 2 * ranks);
      for (int r = 0; r < ranks; ++r) {
        ASSERT_EQ(zigzag[r].size(), 2u);
        EXPECT_EQ(zigzag[r][0].extent, chunks[r]);
        EXPECT_EQ(zigzag[r][1].extent, chunks[2 * ranks - 1 - r]);
        EXPECT_LE(zigzag[r][0].offset + zigzag[r][0].extent, zigzag[r][1].offset);
      }
    }
}

TEST(ZigzagPlan, RowMovesDeliverEveryRowToItsNewOwnerAndBack) {
  std::mt19937 rng(12);
  for (int trial = 0; trial < 300; ++trial) {
    const int ranks = 1 + trial % 6;
    const int64_t length = std::uniform_int_distribution<int64_t>(0, 25)(rng);
    const SequenceAssignment caller = contiguous_assignment(random_extents(length, ranks, rng));
    const SequenceAssignment zigzag = zigzag_assignment(length, ranks);
    for (const auto& [source, target] : {std::pair{caller, zigzag}, std::pair{zigzag, caller}}) {
      const auto from_owner = owners(source), to_owner = owners(target);
      std::map<int64_t, int> delivered;  // global index -> times delivered
      for (int from = 0; from < ranks; ++from)
        for (int to = 0; to < ranks; ++to)
          for (const RowMove& move : row_moves(source, target, from, to))
            for (int64_t i = 0; i < move.count; ++i) {
              // The global index of the sender's row must be the receiver's row's index.
              int64_t global = -1;
              for (const auto& [g, where] : from_owner)
                if (where == std::pair{from, move.from_row + i}) global = g;
              ASSERT_GE(global, 0);
              EXPECT_EQ(to_owner.at(global), (std::pair{to, move.to_row + i}));
              ++delivered[global];
            }
      EXPECT_EQ(delivered.size(), static_cast<size_t>(length));
      for (const auto& [g, times] : delivered) EXPECT_EQ(times, 1) << g;
    }
  }
}

TEST(ZigzagPlan, VisibleKeysIsTheCausalPrefix) {
  const SequenceSegment keys{10, 5};
  EXPECT_EQ(visible_keys(false, 0, keys), 5);
  EXPECT_EQ(visible_keys(true, 9, keys), 0);   // above the diagonal: skipped
  EXPECT_EQ(visible_keys(true, 10, keys), 1);  // on the diagonal
  EXPECT_EQ(visible_keys(true, 12, keys), 3);
  EXPECT_EQ(visible_keys(true, 14, keys), 5);  // below: full
  EXPECT_EQ(visible_keys(true, 40, keys), 5);
  EXPECT_EQ(visible_keys(true, 3, {0, 0}), 0);
}

TEST(ZigzagPlan, ProductsOfAnyAssignmentSumToTheDenseCount) {
  for (int ranks = 1; ranks <= 6; ++ranks)
    for (const int64_t length : {0, 1, 7, 24, 61}) {
      const int64_t causal_total = length * (length + 1) / 2;
      for (const SequenceAssignment& a : {zigzag_assignment(length, ranks),
                                          contiguous_assignment(default_split(length, ranks))}) {
        int64_t causal = 0, full = 0;
        for (const auto& step : ring_step_products(true, a, a))
          for (const int64_t p : step) causal += p;
        for (const auto& step : ring_step_products(false, a, a))
          for (const int64_t p : step) full += p;
        EXPECT_EQ(causal, causal_total);
        EXPECT_EQ(full, length * length);
      }
    }
}

TEST(ZigzagPlan, ZigzagBalancesCausalWorkAndShortensTheRing) {
  for (int ranks = 2; ranks <= 8; ++ranks) {
    const int64_t chunk = 64, length = chunk * 2 * ranks;
    const int64_t block = (length / ranks) * (length / ranks);  // one full contiguous block
    const SequenceAssignment contiguous = contiguous_assignment(default_split(length, ranks));
    const SequenceAssignment zigzag = zigzag_assignment(length, ranks);
    std::vector<int64_t> per_rank_contiguous, per_rank_zigzag;
    for (int r = 0; r < ranks; ++r) {
      per_rank_contiguous.push_back(unmasked_products(true, contiguous[r], {{0, length}}));
      per_rank_zigzag.push_back(unmasked_products(true, zigzag[r], {{0, length}}));
    }
    const auto [zmin, zmax] = std::minmax_element(per_rank_zigzag.begin(), per_rank_zigzag.end());
    // Every zigzag rank: 2P - 1 full chunk pairs and 2 diagonal ones, whatever its rank.
    EXPECT_EQ(*zmin, *zmax) << ranks;
    EXPECT_EQ(*zmax, (2 * ranks - 1) * chunk * chunk + chunk * (chunk + 1));
    EXPECT_GT(per_rank_contiguous.back(), per_rank_contiguous.front() * (2 * ranks - 2));
    const int64_t before = ring_critical_path(ring_step_products(true, contiguous, contiguous));
    const int64_t after = ring_critical_path(ring_step_products(true, zigzag, zigzag));
    // Contiguous: a diagonal block, then P - 1 steps of which some rank computes a full block
    // (P - 1/2 blocks). Zigzag: every rank computes two full chunk pairs per step (half a block)
    // and at step 0 one full and two diagonal pairs: P/2 blocks and a chunk's rows.
    EXPECT_EQ(before, (2 * ranks - 1) * block / 2 + (length / ranks) / 2);
    EXPECT_EQ(after, ranks * block / 2 + chunk) << ranks;
    EXPECT_LT(after, before);
  }
}

// The device kernels' view of a block (attention_block.hpp): the global position of every local
// row of the zigzag and contiguous assignments, and key_visible equal to visible_keys' prefix.
TEST(AttentionBlock, PositionsAndMaskMatchTheAssignments) {
  for (int ranks = 1; ranks <= 5; ++ranks)
    for (const int64_t length : {0, 3, 10, 17}) {
      const SequenceAssignment zigzag = zigzag_assignment(length, ranks);
      for (int r = 0; r < ranks; ++r) {
        kernels::PositionRuns runs;
        for (const SequenceSegment& s : zigzag[r]) {
          runs.offset[runs.count] = s.offset;
          runs.extent[runs.count] = s.extent;
          ++runs.count;
        }
        int64_t row = 0;
        for (const SequenceSegment& s : zigzag[r])
          for (int64_t g = s.offset; g < s.offset + s.extent; ++g, ++row)
            EXPECT_EQ(kernels::global_position(runs, row), g);
        kernels::AttentionBlock block;
        block.keys = rows_of(zigzag[r]);
        block.key_runs = runs;
        block.causal = true;
        for (int64_t query = 0; query < length; ++query) {
          int64_t seen = 0;
          for (int64_t key = 0; key < block.keys; ++key)
            seen += kernels::key_visible(block, query, key);
          EXPECT_EQ(seen, visible_keys(true, query, zigzag[r][0]) +
                              visible_keys(true, query, zigzag[r][1]));
        }
      }
    }
}

TEST(AttentionBlock, LaunchGivesOneWarpPerRowWithinTheGridLimit) {
  EXPECT_EQ(kernels::attention_launch(0).blocks, 0u);
  EXPECT_EQ(kernels::attention_launch(1).blocks, 1u);
  EXPECT_EQ(kernels::attention_launch(kernels::kAttentionWarps).blocks, 1u);
  EXPECT_EQ(kernels::attention_launch(kernels::kAttentionWarps + 1).blocks, 2u);
  EXPECT_EQ(kernels::attention_launch(int64_t{1} << 40).blocks, 65535u);
  EXPECT_EQ(kernels::attention_launch(5).threads, 32u * kernels::kAttentionWarps);
}

}  // namespace
}  // namespace tessera::ops
