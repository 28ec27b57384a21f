// The simulated communicator of estimate mode (see sim_comm.hpp).
#include "core/estimate/sim_comm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <numeric>

#include "core/comm/launch_state.hpp"
#include "core/comm/local_comm.hpp"
#include "core/compute_threads.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"

namespace tessera::estimate {

namespace {

using Clock = std::chrono::steady_clock;
// Waiting ranks wake this often to look for a failed peer: rarely, since thousands of them
// polling one mutex would slow the ranks that still work.
constexpr auto poll_interval = std::chrono::seconds(1);
// Estimate mode runs rules, plans and bookkeeping, no kernels: 2 MiB of stack is plenty, and
// 4096 ranks then reserve 8 GiB of address space instead of 32.
constexpr size_t kStackBytes = size_t{2} << 20;

using detail::LaunchState;  // core/comm/launch_state.hpp

/// What a rank publishes for one collective: a copy of its real send bytes (none for a payload)
/// and the per-rank counts the readers need.
struct Slot {
  const char* name = "";
  bool real = false;
  std::vector<std::byte> bytes{};
  std::vector<size_t> counts{};
  std::vector<size_t> displs{};
  int color = 0;
  int key = 0;
};

/// A real point-to-point message (payload messages are never posted).
struct Message {
  int source;
  int tag;
  std::vector<std::byte> bytes;
};

class SimGroup {
 public:
  SimGroup(int size, std::shared_ptr<LaunchState> launch)
      : size_(size), launch_(std::move(launch)), inbox_(size) {
    for (auto& bank : banks_) bank.resize(size);
  }

  int size() const { return size_; }
  const std::shared_ptr<LaunchState>& launch() const { return launch_; }

  /// Publishes `mine` and waits until every rank of the group has published for the same
  /// collective; returns the slots of that collective (valid until this rank's next one).
  const std::vector<Slot>& rendezvous(int rank, Slot mine) {
    std::unique_lock lock(mu_);
    const uint64_t generation = generation_;
    std::vector<Slot>& bank = banks_[generation % 2];
    bank[rank] = std::move(mine);
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return bank;
    }
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(comm_timeout());
    while (generation_ == generation) {
      throw_if_aborted(rank);
      if (Clock::now() >= deadline)
        throw CommTimeout(current_comm_op(),
                          timeout_message(bank[rank].name, rank, size_, "the other ranks"));
      cv_.wait_for(lock, std::min<Clock::duration>(poll_interval, deadline - Clock::now()));
    }
    return bank;
  }

  /// The group formed by `color` in split number `sequence` (created by the first asker).
  std::shared_ptr<SimGroup> split_group(uint64_t sequence, int color, int members) {
    std::lock_guard lock(mu_);
    auto& group = split_groups_[{sequence, color}];
    if (!group) group = std::make_shared<SimGroup>(members, launch_);
    return group;
  }

  void post(int destination, Message message) {
    std::lock_guard lock(mu_);
    inbox_[destination].push_back(std::move(message));
    cv_.notify_all();
  }

  /// Waits for the oldest real message to `rank` from `source` with `tag`.
  Message take(int rank, int source, int tag) {
    std::unique_lock lock(mu_);
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(comm_timeout());
    while (true) {
      auto& queue = inbox_[rank];
      for (auto it = queue.begin(); it != queue.end(); ++it) {
        if (it->source == source && it->tag == tag) {
          Message found = std::move(*it);
          queue.erase(it);
          return found;
        }
      }
      throw_if_aborted(rank);
      if (Clock::now() >= deadline)
        throw CommTimeout(current_comm_op(),
                          timeout_message("send_recv", rank, size_,
                                          fmt::format("recv from rank {} (tag {})", source, tag)));
      cv_.wait_for(lock, std::min<Clock::duration>(poll_interval, deadline - Clock::now()));
    }
  }

  void throw_if_aborted(int rank) {
    if (launch_->aborted)
      throw PeerFailed(current_comm_op(), fmt::format("rank {} gave up: {}", rank, launch_->why()));
  }

 private:
  const int size_;
  std::shared_ptr<LaunchState> launch_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  int arrived_ = 0;
  std::array<std::vector<Slot>, 2> banks_;
  std::map<std::pair<uint64_t, int>, std::shared_ptr<SimGroup>> split_groups_;
  std::vector<std::deque<Message>> inbox_;
};

std::vector<std::byte> copy_of(const void* data, size_t bytes) {
  std::vector<std::byte> copy(bytes);
  if (bytes) std::memcpy(copy.data(), data, bytes);
  return copy;
}

/// The real point-to-point receives of a batch, completed in wait().
class SimBatch final : public P2PBatch {
 public:
  SimBatch(std::shared_ptr<SimGroup> group, int rank, std::vector<P2POp> recvs)
      : group_(std::move(group)), rank_(rank), recvs_(std::move(recvs)) {}

  void wait() override {
    for (const P2POp& recv : recvs_) {
      Message message = group_->take(rank_, recv.peer, recv.tag);
      if (message.bytes.size() != recv.bytes)
        throw CommError(
            current_comm_op(),
            fmt::format("rank {} expected {} bytes from rank {} (tag {}), rank {} "
                        "sent {}",
                        rank_, recv.bytes, recv.peer, recv.tag, recv.peer, message.bytes.size()));
      std::memcpy(recv.buffer, message.bytes.data(), recv.bytes);
    }
    recvs_.clear();
  }

 private:
  std::shared_ptr<SimGroup> group_;
  int rank_;
  std::vector<P2POp> recvs_;
};

class SimComm final : public Comm {
 public:
  SimComm(std::shared_ptr<SimGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string backend() const override { return "simulated"; }

  std::unique_ptr<P2PBatch> start_send_recv(std::span<const P2POp> ops) override {
    std::vector<P2POp> recvs;
    for (const P2POp& op : ops) {
      check_arg(op.peer >= 0 && op.peer < size(), current_comm_op(),
                "send/recv peer {} outside a communicator of size {}", op.peer, size());
      if (op.buffer == nullptr || op.bytes == 0) continue;  // a payload: recorded, not moved
      if (op.kind == P2POp::Kind::send)
        group_->post(op.peer, Message{rank_, op.tag, copy_of(op.buffer, op.bytes)});
      else
        recvs.push_back(op);
    }
    return std::make_unique<SimBatch>(group_, rank_, std::move(recvs));
  }

  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    const size_t bytes = count * dtype_size(dtype);
    const auto& slots = collective("all_reduce", published(send, bytes));
    if (recv == nullptr || bytes == 0) return;
    for (int r = 0; r < size(); ++r) require_real(slots, r, "all_reduce");
    std::vector<std::byte> result = slots[0].bytes;
    for (int r = 1; r < size(); ++r)
      reduce_into(result.data(), slots[r].bytes.data(), count, dtype, op);
    if (op == ReduceOp::avg) divide_by(result.data(), count, dtype, size());
    std::memcpy(recv, result.data(), bytes);
  }

  void all_gather_v(const void* send, size_t send_count, void* recv,
                    std::span<const size_t> recv_counts, DType dtype) override {
    check_counts("all_gather_v", recv_counts.size());
    const size_t element = dtype_size(dtype);
    const auto& slots = collective("all_gather_v", published(send, send_count * element));
    if (recv == nullptr) return;
    size_t offset = 0;
    for (int r = 0; r < size(); ++r) {
      const size_t bytes = recv_counts[r] * element;
      if (bytes) {
        require_real(slots, r, "all_gather_v");
        check_size("all_gather_v", r, slots[r].bytes.size(), bytes);
        std::memcpy(static_cast<char*>(recv) + offset, slots[r].bytes.data(), bytes);
      }
      offset += bytes;
    }
  }

  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                        DType dtype, ReduceOp op) override {
    check_counts("reduce_scatter_v", recv_counts.size());
    const size_t element = dtype_size(dtype);
    const size_t total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
    const auto& slots = collective("reduce_scatter_v", published(send, total * element));
    const size_t count = recv_counts[rank_];
    if (recv == nullptr || count == 0) return;
    size_t offset = 0;
    for (int r = 0; r < rank_; ++r) offset += recv_counts[r] * element;
    for (int r = 0; r < size(); ++r) require_real(slots, r, "reduce_scatter_v");
    std::vector<std::byte> result(slots[0].bytes.begin() + offset,
                                  slots[0].bytes.begin() + offset + count * element);
    for (int r = 1; r < size(); ++r)
      reduce_into(result.data(), slots[r].bytes.data() + offset, count, dtype, op);
    if (op == ReduceOp::avg) divide_by(result.data(), count, dtype, size());
    std::memcpy(recv, result.data(), count * element);
  }

  void all_to_all_v(const void* send, std::span<const size_t> send_counts,
                    std::span<const size_t> send_displs, void* recv,
                    std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                    DType dtype) override {
    check_counts("all_to_all_v", send_counts.size());
    check_counts("all_to_all_v", recv_counts.size());
    const size_t element = dtype_size(dtype);
    Slot mine{.name = "all_to_all_v"};
    if (send != nullptr) {
      // Only the blocks, packed back to back: a rank's slot is O(what it sends).
      mine.real = true;
      mine.displs.resize(size());
      for (int p = 0; p < size(); ++p) {
        mine.displs[p] = mine.bytes.size();
        const auto* from = static_cast<const std::byte*>(send) + send_displs[p] * element;
        mine.bytes.insert(mine.bytes.end(), from, from + send_counts[p] * element);
      }
      mine.counts.assign(send_counts.begin(), send_counts.end());
    }
    const auto& slots = collective("all_to_all_v", std::move(mine));
    if (recv == nullptr) return;
    for (int r = 0; r < size(); ++r) {
      const size_t bytes = recv_counts[r] * element;
      if (bytes == 0) continue;
      require_real(slots, r, "all_to_all_v");
      check_size("all_to_all_v", r, slots[r].counts[rank_] * element, bytes);
      std::memcpy(static_cast<char*>(recv) + recv_displs[r] * element,
                  slots[r].bytes.data() + slots[r].displs[rank_], bytes);
    }
  }

  void all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                    void* recv_base, std::span<const StridedBlock> recv_blocks,
                    DType dtype) override {
    check_counts("all_to_all_w", send_blocks.size());
    check_counts("all_to_all_w", recv_blocks.size());
    const size_t element = dtype_size(dtype);
    Slot mine{.name = "all_to_all_w"};
    if (send_base != nullptr) {
      mine.real = true;
      mine.displs.resize(size());
      for (int p = 0; p < size(); ++p) {
        const StridedBlock& block = send_blocks[p];
        mine.displs[p] = mine.bytes.size();
        mine.bytes.resize(mine.bytes.size() + block.count() * element);
        if (block.count() == 0) continue;
        const std::vector<int64_t> packed = contiguous_strides(block.shape);
        copy_strided_host(mine.bytes.data() + mine.displs[p], packed.data(),
                          static_cast<const std::byte*>(send_base) + block.offset * element,
                          block.strides.data(), block.shape.data(),
                          static_cast<int>(block.shape.size()), element);
      }
    }
    const auto& slots = collective("all_to_all_w", std::move(mine));
    if (recv_base == nullptr) return;
    for (int r = 0; r < size(); ++r) {
      const StridedBlock& block = recv_blocks[r];
      if (block.count() == 0) continue;
      require_real(slots, r, "all_to_all_w");
      const std::vector<int64_t> packed = contiguous_strides(block.shape);
      copy_strided_host(static_cast<std::byte*>(recv_base) + block.offset * element,
                        block.strides.data(), slots[r].bytes.data() + slots[r].displs[rank_],
                        packed.data(), block.shape.data(), static_cast<int>(block.shape.size()),
                        element);
    }
  }

  void broadcast(void* buffer, size_t count, DType dtype, int root) override {
    check_root("broadcast", root);
    const size_t bytes = count * dtype_size(dtype);
    const auto& slots = collective("broadcast", rank_ == root ? published(buffer, bytes) : Slot{});
    if (rank_ == root || buffer == nullptr || bytes == 0) return;
    require_real(slots, root, "broadcast");
    check_size("broadcast", root, slots[root].bytes.size(), bytes);
    std::memcpy(buffer, slots[root].bytes.data(), bytes);
  }

  void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                 size_t recv_count, DType dtype, int root) override {
    check_root("scatter_v", root);
    const size_t element = dtype_size(dtype);
    Slot mine;
    if (rank_ == root) {
      check_counts("scatter_v", send_counts.size());
      const size_t total = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
      mine = published(send, total * element);
      mine.counts.assign(send_counts.begin(), send_counts.end());
    }
    const auto& slots = collective("scatter_v", std::move(mine));
    const size_t bytes = recv_count * element;
    if (recv == nullptr || bytes == 0) return;
    require_real(slots, root, "scatter_v");
    const Slot& source = slots[root];
    check_size("scatter_v", root, source.counts[rank_] * element, bytes);
    size_t offset = 0;
    for (int r = 0; r < rank_; ++r) offset += source.counts[r] * element;
    std::memcpy(recv, source.bytes.data() + offset, bytes);
  }

  void gather_v(const void* send, size_t send_count, void* recv,
                std::span<const size_t> recv_counts, DType dtype, int root) override {
    check_root("gather_v", root);
    const size_t element = dtype_size(dtype);
    const auto& slots = collective("gather_v", published(send, send_count * element));
    if (rank_ != root || recv == nullptr) return;
    check_counts("gather_v", recv_counts.size());
    size_t offset = 0;
    for (int r = 0; r < size(); ++r) {
      const size_t bytes = recv_counts[r] * element;
      if (bytes) {
        require_real(slots, r, "gather_v");
        check_size("gather_v", r, slots[r].bytes.size(), bytes);
        std::memcpy(static_cast<char*>(recv) + offset, slots[r].bytes.data(), bytes);
      }
      offset += bytes;
    }
  }

  void barrier() override { collective("barrier", Slot{}); }

  std::shared_ptr<Comm> split(int color, int key) override {
    const uint64_t sequence = split_count_++;
    const auto& slots = collective("split", Slot{.color = color, .key = key});
    if (color < 0) return nullptr;
    std::vector<std::pair<int, int>> members;  // (key, parent rank)
    for (int r = 0; r < size(); ++r)
      if (slots[r].color == color) members.emplace_back(slots[r].key, r);
    std::sort(members.begin(), members.end());
    const int new_rank = static_cast<int>(
        std::find(members.begin(), members.end(), std::make_pair(key, rank_)) - members.begin());
    return std::make_shared<SimComm>(
        group_->split_group(sequence, color, static_cast<int>(members.size())), new_rank);
  }

 private:
  /// A slot with a copy of `bytes` at `data` when it is real memory.
  static Slot published(const void* data, size_t bytes) {
    Slot slot;
    if (data != nullptr) {
      slot.real = true;
      slot.bytes = copy_of(data, bytes);
    }
    return slot;
  }

  /// The rendezvous of every collective; checks that every rank called the same one.
  const std::vector<Slot>& collective(const char* name, Slot mine) {
    mine.name = name;
    const std::vector<Slot>& slots = group_->rendezvous(rank_, std::move(mine));
    for (int r = 0; r < size(); ++r) {
      if (std::strcmp(slots[r].name, name) != 0) {
        // Ranks called different collectives: a program error that would deadlock a real run.
        const std::string message =
            fmt::format("rank {} called {} while rank {} called {}", rank_, name, r, slots[r].name);
        group_->launch()->abort(message);
        throw CommError(current_comm_op(), message);
      }
    }
    return slots;
  }

  /// A real buffer of this rank reads rank `r`'s contribution, which must be real too.
  void require_real(const std::vector<Slot>& slots, int r, const char* name) const {
    if (!slots[r].real)
      throw NotAvailable(
          "estimate",
          fmt::format("{}{}: rank {} reads a real buffer from rank {}, whose "
                      "buffer is a shape-only tensor's (no data in estimate mode)",
                      current_comm_op() == "comm" ? "" : current_comm_op() + ": ", name, rank_, r));
  }
  void check_size(const char* name, int peer, size_t theirs, size_t mine) const {
    if (theirs != mine)
      throw CommError(current_comm_op(),
                      fmt::format("{}: rank {} expects {} bytes from rank {}, which has {}", name,
                                  rank_, mine, peer, theirs));
  }
  void check_counts(const char* name, size_t given) const {
    check_arg(given == static_cast<size_t>(size()), current_comm_op(),
              "{}: {} counts given for a communicator of size {}", name, given, size());
  }
  void check_root(const char* name, int root) const {
    check_arg(root >= 0 && root < size(), current_comm_op(), "{}: root {} outside size {}", name,
              root, size());
  }

  std::shared_ptr<SimGroup> group_;
  int rank_;
  uint64_t split_count_ = 0;
};

/// What a rank thread runs (pthread's argument).
struct RankThread {
  std::function<void()> run;
};

void* run_rank_thread(void* argument) {
  static_cast<RankThread*>(argument)->run();
  return nullptr;
}

}  // namespace

void run_simulated_ranks(int ranks, const std::function<void(int, std::shared_ptr<Comm>)>& body) {
  check_arg(ranks > 0 && ranks <= kMaxSimulatedRanks, "estimate",
            "cannot simulate {} ranks (expected 1 to {})", ranks, kMaxSimulatedRanks);
  auto launch = std::make_shared<LaunchState>();
  auto world = std::make_shared<SimGroup>(ranks, launch);
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<char> peer_failed(ranks, 0);  // one byte per rank: each thread writes its own
  auto run_rank = [&](int rank) {
    set_compute_threads(1);  // no kernels run; the ranks share this process's cores
    try {
      RankContextScope context(std::make_shared<RankContext>(Device::cpu()));
      body(rank, std::make_shared<SimComm>(world, rank));
    } catch (const PeerFailed&) {
      errors[rank] = std::current_exception();
      peer_failed[rank] = 1;
    } catch (const std::exception& error) {
      errors[rank] = std::current_exception();
      launch->abort(fmt::format("rank {} failed: {}", rank, error.what()));
    } catch (...) {
      errors[rank] = std::current_exception();
      launch->abort(fmt::format("rank {} failed", rank));
    }
  };
  std::vector<RankThread> work(ranks);
  std::vector<pthread_t> threads;
  threads.reserve(ranks);
  pthread_attr_t attributes;
  pthread_attr_init(&attributes);
  pthread_attr_setstacksize(&attributes, kStackBytes);
  for (int rank = 1; rank < ranks; ++rank) {
    work[rank].run = [&run_rank, rank] { run_rank(rank); };
    pthread_t thread;
    if (pthread_create(&thread, &attributes, run_rank_thread, &work[rank]) != 0) {
      launch->abort(fmt::format("could not start the thread of simulated rank {}", rank));
      errors[rank] = std::make_exception_ptr(
          NotAvailable("estimate", fmt::format("could not start the thread of simulated rank {} "
                                               "(of {})",
                                               rank, ranks)));
      break;
    }
    threads.push_back(thread);
  }
  pthread_attr_destroy(&attributes);
  if (static_cast<int>(threads.size()) == ranks - 1) run_rank(0);  // on the calling thread
  for (pthread_t thread : threads) pthread_join(thread, nullptr);
  for (int rank = 0; rank < ranks; ++rank)
    if (errors[rank] && !peer_failed[rank]) std::rethrow_exception(errors[rank]);
  for (int rank = 0; rank < ranks; ++rank)
    if (errors[rank]) std::rethrow_exception(errors[rank]);
}

}  // namespace tessera::estimate
