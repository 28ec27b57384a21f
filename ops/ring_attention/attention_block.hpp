// One step of ring attention on the device: a block of local queries against the K/V block a
// rank holds, as plain C++17 data and constexpr index math (included by attention_cuda.cu too)
// plus the launch geometry (pure, tested on the cpu). Rows are laid out [batch, rows, heads, D];
// the global sequence positions of a block's rows are at most two runs (a contiguous shard is
// one, the zigzag assignment's two chunks are two), and the causal mask compares them.
#pragma once

#include <cstdint>

namespace tessera::ops::kernels {

/// The global positions of a block's local rows: `count` runs, local row 0 first.
struct PositionRuns {
  int count = 0;
  int64_t offset[2] = {0, 0};
  int64_t extent[2] = {0, 0};
};

/// A query block against a key block: sizes, positions, the scores' factor and the mask.
struct AttentionBlock {
  int64_t batch = 0, heads = 0, d = 0, dv = 0;
  int64_t queries = 0;  ///< local query rows
  int64_t keys = 0;     ///< rows of the held key block
  PositionRuns query_runs, key_runs;
  double scale = 1;
  bool causal = false;
};

/// The global position of local row `row` (row < the runs' total).
constexpr int64_t global_position(const PositionRuns& runs, int64_t row) {
  return runs.count > 1 && row >= runs.extent[0] ? runs.offset[1] + (row - runs.extent[0])
                                                 : runs.offset[0] + row;
}

/// Whether the query at global position `query` sees local key `key` of the block.
constexpr bool key_visible(const AttentionBlock& block, int64_t query, int64_t key) {
  return !block.causal || global_position(block.key_runs, key) <= query;
}

/// Threads per block of the attention kernels: one warp per query row, `warps` rows per block.
inline constexpr int kAttentionWarps = 4;

/// How a kernel over `rows` query rows is launched: `blocks` blocks of `threads` threads, each
/// warp striding over the rows (blocks capped so the grid stays within cuda's limit).
struct AttentionLaunch {
  unsigned blocks = 0;
  unsigned threads = 32 * kAttentionWarps;
};

/// The launch for `rows` query rows: one warp per row up to `max_blocks` blocks (0 rows: none).
constexpr AttentionLaunch attention_launch(int64_t rows, int64_t max_blocks = 65535) {
  AttentionLaunch launch;
  const int64_t blocks = (rows + kAttentionWarps - 1) / kAttentionWarps;
  launch.blocks = static_cast<unsigned>(blocks < max_blocks ? blocks : max_blocks);
  return launch;
}

}  // namespace tessera::ops::kernels
