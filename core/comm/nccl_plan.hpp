// The grouping plans of the nccl backend: how a batch of point-to-point ops or a v-collective
// becomes the list of ncclSend/ncclRecv calls (and local copies) of one ncclGroupStart/End.
// Pure host logic without NCCL (tested on cpu):
//  - zero counts make no call; a rank's transfer to itself is a local copy;
//  - counts beyond `max_count` are split into chunks, identically on both sides;
//  - NCCL matches a pair's messages by issue order only, so a batch's ops are issued per peer
//    in (tag, batch order): two ranks that post the same messages in any order of tags agree.
#pragma once

#include <climits>
#include <cstddef>
#include <span>
#include <vector>

#include "core/comm/comm.hpp"

namespace tessera::nccl_plan {

/// Largest element count of one NCCL call.
inline constexpr size_t default_max_count = static_cast<size_t>(INT_MAX);

/// One call of a group: send `count` elements from `offset` of the source buffer to `peer`,
/// receive `count` elements from `peer` at `offset` of the destination buffer, or copy `count`
/// elements from `offset` of the source to `dst_offset` of the destination on this rank.
struct Transfer {
  enum class Kind : uint8_t { send, recv, copy };
  Kind kind = Kind::send;
  int peer = 0;
  size_t offset = 0;
  size_t count = 0;
  size_t dst_offset = 0;  ///< copy only
  size_t op = 0;          ///< batches: index of the P2POp (copy: of the send); collectives: 0
  size_t dst_op = 0;      ///< batches, copy only: index of the receiving P2POp
  bool operator==(const Transfer&) const = default;
};

/// A batch of P2POps of rank `rank` (counts in bytes, moved as u8 elements). Throws CommError
/// when a send to itself has no receive of the same tag and size in the batch (or the reverse).
std::vector<Transfer> plan_p2p(std::span<const P2POp> ops, int rank,
                               size_t max_count = default_max_count);

/// all_to_all_v: block p of the send buffer to rank p, block r of the receive buffer from rank r.
std::vector<Transfer> plan_all_to_all_v(int rank, std::span<const size_t> send_counts,
                                        std::span<const size_t> send_displs,
                                        std::span<const size_t> recv_counts,
                                        std::span<const size_t> recv_displs,
                                        size_t max_count = default_max_count);

/// all_gather_v: the whole send buffer to every rank; rank r's block into the receive buffer at
/// the prefix sum of recv_counts.
std::vector<Transfer> plan_all_gather_v(int rank, size_t send_count,
                                        std::span<const size_t> recv_counts,
                                        size_t max_count = default_max_count);

/// gather_v: every rank's send buffer to `root`, stored rank-blocked (recv_counts used on root).
std::vector<Transfer> plan_gather_v(int rank, int size, size_t send_count,
                                    std::span<const size_t> recv_counts, int root,
                                    size_t max_count = default_max_count);

/// scatter_v: `root`'s block r (send_counts used on root) to rank r's receive buffer.
std::vector<Transfer> plan_scatter_v(int rank, int size, std::span<const size_t> send_counts,
                                     size_t recv_count, int root,
                                     size_t max_count = default_max_count);

/// reduce_scatter_v with uneven counts: block p of the send buffer to rank p; rank r's copy of
/// this rank's block into slot r (offset r * recv_counts[rank]) of a scratch buffer of
/// size * recv_counts[rank] elements, which is then reduced in rank order.
std::vector<Transfer> plan_reduce_scatter_v(int rank, std::span<const size_t> recv_counts,
                                            size_t max_count = default_max_count);

/// True when every count is the same (then the native NCCL collective applies).
bool counts_equal(std::span<const size_t> counts);

/// Small all-gathers over many ranks run as an all-reduce (u8 sum) of the gathered buffer, zero
/// but for each rank's own block: a ring all-gather pays one latency per rank, while NCCL runs a
/// small all-reduce as a tree (or NVLS) whose latency grows with log2 of the nodes. Zeros add
/// nothing and each byte has one non-zero contributor, so the result is the gathered bytes
/// exactly. The buffer is at most kGatherByReduceMaxBytes and moves about twice a ring
/// all-gather's bytes, a few microseconds at these sizes.
inline constexpr int kGatherByReduceMinRanks = 16;
inline constexpr size_t kGatherByReduceMaxBytes = size_t{64} << 10;

/// The fewest ranks that gather by all-reduce: TESSERA_NCCL_GATHER_BY_REDUCE_RANKS when set (a
/// positive integer; 1 lets a one-GPU machine test the path), else kGatherByReduceMinRanks.
int gather_by_all_reduce_min_ranks();

/// Whether an all-gather of `gathered_bytes` in all over `ranks` ranks runs as that all-reduce
/// (NcclComm, and the cost model's price of an NCCL all-gather).
bool gather_by_all_reduce(int ranks, double gathered_bytes);

}  // namespace tessera::nccl_plan
