// Where the rows of a sharded sequence live for ring attention, as pure functions of the
// extents and the rank (no communication): the caller's contiguous shards, the zigzag
// assignment that balances causal work (the sequence cut into 2P chunks, rank r holding chunks r
// and 2P-1-r), the row moves between two such assignments, and the count of unmasked
// query-key products per rank and per ring step.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::ops {

/// A run of consecutive global sequence indices [offset, offset + extent).
struct SequenceSegment {
  int64_t offset = 0;
  int64_t extent = 0;
  bool operator==(const SequenceSegment&) const = default;
};

/// Every rank's segments; a rank's local rows are its segments' rows in order.
using SequenceAssignment = std::vector<std::vector<SequenceSegment>>;

/// Contiguous shards of the given extents (one segment per rank, offsets the prefix sums).
SequenceAssignment contiguous_assignment(const std::vector<int64_t>& extents);

/// The zigzag assignment of `length` over `ranks`: the default split of length into 2 * ranks
/// chunks; rank r holds chunk r, then chunk 2 * ranks - 1 - r (empty chunks are kept, so every
/// rank has exactly two segments).
SequenceAssignment zigzag_assignment(int64_t length, int ranks);

/// Whether attention balances its ring with the zigzag assignment: causal with a ring of more
/// than one rank (non-causal work is even under any split, and one rank has nothing to balance).
bool use_zigzag(bool causal, int ring_size);

/// Rows held by a rank: the sum of its segments' extents.
int64_t rows_of(const std::vector<SequenceSegment>& segments);

/// A run of rows moving from one rank to another: `count` rows starting at local row
/// `from_row` of the sender land at local row `to_row` of the receiver.
struct RowMove {
  int64_t from_row = 0;
  int64_t to_row = 0;
  int64_t count = 0;
  bool operator==(const RowMove&) const = default;
};

/// The rows rank `from` sends to rank `to` when the sequence goes from assignment `source` to
/// assignment `target` (both cover the same sequence), in increasing global order.
std::vector<RowMove> row_moves(const SequenceAssignment& source, const SequenceAssignment& target,
                               int from, int to);

/// How many keys of `keys` the query at global index `query` sees: all of them without a causal
/// mask; with one, those at global indices <= query (a prefix of the segment: 0 when the segment
/// lies above the diagonal, its extent when below, in between on the diagonal).
int64_t visible_keys(bool causal, int64_t query, const SequenceSegment& keys);

/// Unmasked query-key products of queries `queries` against keys `keys` (per batch and head).
int64_t unmasked_products(bool causal, const std::vector<SequenceSegment>& queries,
                          const std::vector<SequenceSegment>& keys);

/// The work of a ring of `queries.size()` ranks: products[step][rank] is the number of unmasked
/// products rank `rank` computes at step `step`, when it holds the keys of rank - step.
std::vector<std::vector<int64_t>> ring_step_products(bool causal, const SequenceAssignment& queries,
                                                     const SequenceAssignment& keys);

/// The ring's critical path in products: the sum over steps of the busiest rank's products
/// (every step waits for the slowest rank before the blocks move on).
int64_t ring_critical_path(const std::vector<std::vector<int64_t>>& step_products);

}  // namespace tessera::ops
