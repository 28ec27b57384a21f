// Sequence assignments of ring attention (see zigzag_plan.hpp).
#include "ops/ring_attention/zigzag_plan.hpp"

#include <algorithm>

#include "core/layout.hpp"

namespace tessera::ops {

SequenceAssignment contiguous_assignment(const std::vector<int64_t>& extents) {
  SequenceAssignment assignment;
  int64_t offset = 0;
  for (const int64_t extent : extents) {
    assignment.push_back({{offset, extent}});
    offset += extent;
  }
  return assignment;
}

SequenceAssignment zigzag_assignment(int64_t length, int ranks) {
  const std::vector<int64_t> chunks = default_split(length, 2 * ranks);
  const std::vector<int64_t> offsets = offsets_of(chunks);
  SequenceAssignment assignment(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const size_t early = static_cast<size_t>(r), late = static_cast<size_t>(2 * ranks - 1 - r);
    assignment[early] = {{offsets[early], chunks[early]}, {offsets[late], chunks[late]}};
  }
  return assignment;
}

bool use_zigzag(bool causal, int ring_size) {
  return causal && ring_size > 1;
}

int64_t rows_of(const std::vector<SequenceSegment>& segments) {
  int64_t rows = 0;
  for (const SequenceSegment& segment : segments) rows += segment.extent;
  return rows;
}

std::vector<RowMove> row_moves(const SequenceAssignment& source, const SequenceAssignment& target,
                               int from, int to) {
  std::vector<RowMove> moves;
  int64_t from_row = 0;
  for (const SequenceSegment& sent : source[static_cast<size_t>(from)]) {
    int64_t to_row = 0;
    for (const SequenceSegment& held : target[static_cast<size_t>(to)]) {
      const int64_t lo = std::max(sent.offset, held.offset);
      const int64_t hi = std::min(sent.offset + sent.extent, held.offset + held.extent);
      if (lo < hi)
        moves.push_back({from_row + (lo - sent.offset), to_row + (lo - held.offset), hi - lo});
      to_row += held.extent;
    }
    from_row += sent.extent;
  }
  std::sort(moves.begin(), moves.end(),
            [](const RowMove& a, const RowMove& b) { return a.from_row < b.from_row; });
  return moves;
}

int64_t visible_keys(bool causal, int64_t query, const SequenceSegment& keys) {
  if (!causal) return keys.extent;
  return std::clamp<int64_t>(query - keys.offset + 1, 0, keys.extent);
}

int64_t unmasked_products(bool causal, const std::vector<SequenceSegment>& queries,
                          const std::vector<SequenceSegment>& keys) {
  int64_t products = 0;
  for (const SequenceSegment& q : queries)
    for (int64_t i = q.offset; i < q.offset + q.extent; ++i)
      for (const SequenceSegment& k : keys) products += visible_keys(causal, i, k);
  return products;
}

std::vector<std::vector<int64_t>> ring_step_products(bool causal, const SequenceAssignment& queries,
                                                     const SequenceAssignment& keys) {
  const int ranks = static_cast<int>(queries.size());
  std::vector<std::vector<int64_t>> products(static_cast<size_t>(ranks),
                                             std::vector<int64_t>(static_cast<size_t>(ranks)));
  for (int step = 0; step < ranks; ++step)
    for (int rank = 0; rank < ranks; ++rank) {
      const int holder = ((rank - step) % ranks + ranks) % ranks;
      products[static_cast<size_t>(step)][static_cast<size_t>(rank)] = unmasked_products(
          causal, queries[static_cast<size_t>(rank)], keys[static_cast<size_t>(holder)]);
    }
  return products;
}

int64_t ring_critical_path(const std::vector<std::vector<int64_t>>& step_products) {
  int64_t path = 0;
  for (const std::vector<int64_t>& step : step_products)
    path += step.empty() ? 0 : *std::max_element(step.begin(), step.end());
  return path;
}

}  // namespace tessera::ops
