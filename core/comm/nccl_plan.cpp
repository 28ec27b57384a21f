// The grouping plans of the nccl backend (see nccl_plan.hpp). No NCCL header here: the plans
// are tested on cpu in tessera_unit_tests.
#include "core/comm/nccl_plan.hpp"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <numeric>

#include "core/errors.hpp"

namespace tessera::nccl_plan {

namespace {

/// Appends `transfer`, split into calls of at most `max_count` elements (none when empty).
void append_chunked(std::vector<Transfer>& plan, Transfer transfer, size_t max_count) {
  check_arg(max_count > 0, "nccl", "a chunk limit of 0 elements");
  for (size_t done = 0; done < transfer.count; done += max_count) {
    Transfer chunk = transfer;
    chunk.count = std::min(max_count, transfer.count - done);
    chunk.offset += done;
    chunk.dst_offset += done;
    plan.push_back(chunk);
  }
}

Transfer send_to(int peer, size_t offset, size_t count) {
  return {.kind = Transfer::Kind::send, .peer = peer, .offset = offset, .count = count};
}
Transfer recv_from(int peer, size_t offset, size_t count) {
  return {.kind = Transfer::Kind::recv, .peer = peer, .offset = offset, .count = count};
}
Transfer copy_within(int rank, size_t offset, size_t dst_offset, size_t count) {
  return {.kind = Transfer::Kind::copy,
          .peer = rank,
          .offset = offset,
          .count = count,
          .dst_offset = dst_offset};
}

}  // namespace

std::vector<Transfer> plan_p2p(std::span<const P2POp> ops, int rank, size_t max_count) {
  // Issue order: per peer, then per tag, then as posted (a stable sort), so both ends of a pair
  // issue the messages of one tag in posting order whatever the interleaving of tags.
  std::vector<size_t> order(ops.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::pair(ops[a].peer, ops[a].tag) < std::pair(ops[b].peer, ops[b].tag);
  });
  std::vector<Transfer> plan;
  std::vector<size_t> self_sends, self_recvs;
  for (size_t index : order) {
    const P2POp& op = ops[index];
    if (op.peer == rank) {
      (op.kind == P2POp::Kind::send ? self_sends : self_recvs).push_back(index);
      continue;
    }
    Transfer transfer = op.kind == P2POp::Kind::send ? send_to(op.peer, 0, op.bytes)
                                                     : recv_from(op.peer, 0, op.bytes);
    transfer.op = index;
    append_chunked(plan, transfer, max_count);
  }
  // Messages to itself: the k-th send of a tag feeds the k-th receive of that tag (both lists
  // are in (tag, posting) order already).
  size_t s = 0, r = 0;
  while (s < self_sends.size() || r < self_recvs.size()) {
    const P2POp* send = s < self_sends.size() ? &ops[self_sends[s]] : nullptr;
    const P2POp* recv = r < self_recvs.size() ? &ops[self_recvs[r]] : nullptr;
    if (!send || !recv || send->tag != recv->tag) {
      const P2POp& lone = !recv || (send && send->tag < recv->tag) ? *send : *recv;
      throw CommError(current_comm_op(),
                      fmt::format("send_recv: rank {} posts a {} to itself (tag {}) with no "
                                  "matching {} in the same batch",
                                  rank, lone.kind == P2POp::Kind::send ? "send" : "receive",
                                  lone.tag, lone.kind == P2POp::Kind::send ? "receive" : "send"));
    }
    if (send->bytes != recv->bytes)
      throw CommError(current_comm_op(),
                      fmt::format("send_recv: rank {} sends {} bytes to itself (tag {}) into a "
                                  "receive of {} bytes",
                                  rank, send->bytes, send->tag, recv->bytes));
    Transfer copy = copy_within(rank, 0, 0, send->bytes);
    copy.op = self_sends[s];
    copy.dst_op = self_recvs[r];
    append_chunked(plan, copy, max_count);
    ++s;
    ++r;
  }
  return plan;
}

std::vector<Transfer> plan_all_to_all_v(int rank, std::span<const size_t> send_counts,
                                        std::span<const size_t> send_displs,
                                        std::span<const size_t> recv_counts,
                                        std::span<const size_t> recv_displs, size_t max_count) {
  std::vector<Transfer> plan;
  const int size = static_cast<int>(send_counts.size());
  for (int p = 0; p < size; ++p) {
    if (p == rank) {
      check_arg(send_counts[p] == recv_counts[p], current_comm_op(),
                "all_to_all_v: rank {} sends {} elements to itself but receives {}", rank,
                send_counts[p], recv_counts[p]);
      append_chunked(plan, copy_within(rank, send_displs[p], recv_displs[p], send_counts[p]),
                     max_count);
      continue;
    }
    append_chunked(plan, send_to(p, send_displs[p], send_counts[p]), max_count);
    append_chunked(plan, recv_from(p, recv_displs[p], recv_counts[p]), max_count);
  }
  return plan;
}

std::vector<Transfer> plan_all_gather_v(int rank, size_t send_count,
                                        std::span<const size_t> recv_counts, size_t max_count) {
  check_arg(recv_counts[rank] == send_count, current_comm_op(),
            "all_gather_v: rank {} sends {} elements but expects {} from itself", rank, send_count,
            recv_counts[rank]);
  const std::vector<size_t> displs = displacements_of(recv_counts);
  std::vector<Transfer> plan;
  for (int p = 0; p < static_cast<int>(recv_counts.size()); ++p) {
    if (p == rank) {
      append_chunked(plan, copy_within(rank, 0, displs[p], send_count), max_count);
      continue;
    }
    append_chunked(plan, send_to(p, 0, send_count), max_count);
    append_chunked(plan, recv_from(p, displs[p], recv_counts[p]), max_count);
  }
  return plan;
}

std::vector<Transfer> plan_gather_v(int rank, int size, size_t send_count,
                                    std::span<const size_t> recv_counts, int root,
                                    size_t max_count) {
  std::vector<Transfer> plan;
  if (rank != root) {
    append_chunked(plan, send_to(root, 0, send_count), max_count);
    return plan;
  }
  check_arg(recv_counts[rank] == send_count, current_comm_op(),
            "gather_v: root {} sends {} elements but expects {} from itself", rank, send_count,
            recv_counts[rank]);
  const std::vector<size_t> displs = displacements_of(recv_counts);
  for (int p = 0; p < size; ++p)
    append_chunked(plan,
                   p == rank ? copy_within(rank, 0, displs[p], send_count)
                             : recv_from(p, displs[p], recv_counts[p]),
                   max_count);
  return plan;
}

std::vector<Transfer> plan_scatter_v(int rank, int size, std::span<const size_t> send_counts,
                                     size_t recv_count, int root, size_t max_count) {
  std::vector<Transfer> plan;
  if (rank != root) {
    append_chunked(plan, recv_from(root, 0, recv_count), max_count);
    return plan;
  }
  check_arg(send_counts[rank] == recv_count, current_comm_op(),
            "scatter_v: root {} sends {} elements to itself but receives {}", rank,
            send_counts[rank], recv_count);
  const std::vector<size_t> displs = displacements_of(send_counts);
  for (int p = 0; p < size; ++p)
    append_chunked(plan,
                   p == rank ? copy_within(rank, displs[p], 0, recv_count)
                             : send_to(p, displs[p], send_counts[p]),
                   max_count);
  return plan;
}

std::vector<Transfer> plan_reduce_scatter_v(int rank, std::span<const size_t> recv_counts,
                                            size_t max_count) {
  const std::vector<size_t> displs = displacements_of(recv_counts);
  const size_t mine = recv_counts[rank];
  std::vector<Transfer> plan;
  for (int p = 0; p < static_cast<int>(recv_counts.size()); ++p) {
    if (p == rank) {
      append_chunked(plan, copy_within(rank, displs[p], static_cast<size_t>(p) * mine, mine),
                     max_count);
      continue;
    }
    append_chunked(plan, send_to(p, displs[p], recv_counts[p]), max_count);
    append_chunked(plan, recv_from(p, static_cast<size_t>(p) * mine, mine), max_count);
  }
  return plan;
}

int gather_by_all_reduce_min_ranks() {
  const char* text = std::getenv("TESSERA_NCCL_GATHER_BY_REDUCE_RANKS");
  if (text == nullptr || *text == '\0') return kGatherByReduceMinRanks;
  char* end = nullptr;
  const long ranks = std::strtol(text, &end, 10);
  check_arg(*end == '\0' && ranks >= 1 && ranks <= INT_MAX, "comm",
            "TESSERA_NCCL_GATHER_BY_REDUCE_RANKS='{}' is not a positive integer", text);
  return static_cast<int>(ranks);
}

bool gather_by_all_reduce(int ranks, double gathered_bytes) {
  return ranks >= gather_by_all_reduce_min_ranks() && gathered_bytes > 0 &&
         gathered_bytes <= static_cast<double>(kGatherByReduceMaxBytes);
}

bool counts_equal(std::span<const size_t> counts) {
  return std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end();
}

}  // namespace tessera::nccl_plan
