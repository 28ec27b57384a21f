// The local backend (see local_comm.hpp). Invariant of every collective: phase 1 publishes
// this rank's buffers and waits for all ranks; each rank then reads what it needs from its
// peers' buffers; phase 2 waits again so that no rank returns (and reuses a buffer) while
// another still reads it. With device buffers the publisher also records an event on its compute
// stream (its buffers are ready once the work queued before the call is done); a reader's comm
// stream waits on the events of the ranks it reads, copies, and records an event after its
// copies, published at phase 2; after phase 2 every rank's compute and comm streams wait on
// every reader's event, so nothing it queues later touches a buffer still being read, and no
// thread waits for the device. Copies into or out of host memory are waited for before phase 2:
// host code reads and writes that memory. Point-to-point batches between device buffers block no
// thread on the device either: the receiver queues its copy after the sender's event and hands
// back an event of its own, which the sender's compute stream waits on before anything reuses
// the send buffer.
#include "core/comm/local_comm.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "core/backend/backend.hpp"
#include "core/backend/transfer.hpp"
#include "core/comm/comm_device.hpp"
#include "core/comm/launch.hpp"
#include "core/comm/launch_state.hpp"
#include "core/compute_threads.hpp"
#include "core/tensor.hpp"

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;
using comm_device::SharedEvent;
constexpr auto poll_interval = std::chrono::milliseconds(50);
constexpr int kSpinsBeforeSleep = 2000;

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}

Device device_of_index(int device) {
  return device < 0 ? Device::cpu() : Device::cuda(device);
}

/// Counts a copy that crosses between host and device or between two devices.
void count_if_crossing(int dst_device, int src_device, size_t bytes) {
  if (dst_device != src_device && bytes)
    count_transfer(device_of_index(dst_device), device_of_index(src_device), bytes);
}

using detail::LaunchState;  // core/comm/launch_state.hpp

/// What a rank brings to a collective.
struct Contribution {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  std::span<const size_t> counts{};
  std::span<const size_t> displs{};
  int root = 0;
  int color = 0;
  int key = 0;
  const char* name = "";
  std::span<const StridedBlock> blocks{};
  int device = -1;  // device of this rank's buffers, -1 for host memory
  std::shared_ptr<SharedEvent>
      ready{};  // device buffers: recorded on the publisher's compute stream
};

/// One rank's reads in a collective. Copies between host buffers are memcpy, inline; a copy that
/// touches device memory is queued on one stream (the comm stream of this rank's device, or of
/// the peer's device when this rank's buffers are on the host) after the publisher's event.
/// finish() waits for the queued copies; it must run before the closing rendezvous.
class Reader {
 public:
  /// `own` is this rank's contribution (its device and ready event).
  explicit Reader(const Contribution& own) : own_(own) {}

  /// Copies `bytes` from `src`, a buffer of the rank that published `from`, to this rank's `dst`.
  void copy(void* dst, const void* src, size_t bytes, const Contribution& from) {
    if (bytes == 0) return;
    if (own_.device < 0 && from.device < 0) {
      std::memcpy(dst, src, bytes);
      return;
    }
    touched_host_ = touched_host_ || own_.device < 0 || from.device < 0;
    const Stream& stream = device_stream(from);
    gpu::copy_bytes_async(dst, src, bytes, stream.handle, stream.device.index);
    count_if_crossing(own_.device, from.device, bytes);
  }

  /// Copies a strided block of `from` into one of this rank's (both host or both device).
  void copy_strided(void* dst, const int64_t* dst_strides, const void* src,
                    const int64_t* src_strides, const std::vector<int64_t>& shape, size_t element,
                    const Contribution& from, int peer) {
    if (own_.device < 0 && from.device < 0) {
      copy_strided_host(dst, dst_strides, src, src_strides, shape.data(),
                        static_cast<int>(shape.size()), element);
      return;
    }
    if (own_.device < 0 || from.device < 0)
      throw InvalidArgument(current_comm_op(),
                            fmt::format("all_to_all_w: rank {}'s blocks are in {} memory, this "
                                        "rank's in {}; strided exchanges need one memory space",
                                        peer, from.device < 0 ? "host" : "device",
                                        own_.device < 0 ? "host" : "device"));
    const Stream& stream = device_stream(from);
    gpu::copy_strided_async(dst, dst_strides, src, src_strides, shape.data(),
                            static_cast<int>(shape.size()), element, stream.handle,
                            stream.device.index);
    count_if_crossing(own_.device, from.device, element * shape_numel(shape));
  }

  /// The stream this rank's device work runs on after waiting for `from`'s event (and, the first
  /// time, for this rank's own compute work, which may still use the buffers it writes).
  const Stream& device_stream(const Contribution& from) {
    if (!stream_) {
      stream_ = comm_device::comm_stream_for(own_.device >= 0 ? own_.device : from.device);
      if (own_.ready) own_.ready->wait_on(*stream_);
    }
    if (from.ready && from.ready != own_.ready &&
        std::find(waited_.begin(), waited_.end(), from.ready.get()) == waited_.end()) {
      from.ready->wait_on(*stream_);
      waited_.push_back(from.ready.get());
    }
    return *stream_;
  }

  /// Waits for every queued copy (no-op when everything ran inline).
  void finish() {
    if (stream_) synchronize(*stream_);
  }

  /// Done reading: copies between device buffers are left in flight and the event recorded after
  /// them returned (the ranks whose buffers they read wait on it on their streams); copies that
  /// touch host memory (threads read or write it) are waited for. Null when nothing is in flight.
  std::shared_ptr<SharedEvent> finish_in_flight() {
    if (!stream_) return nullptr;
    if (touched_host_) {
      synchronize(*stream_);
      return nullptr;
    }
    auto done = std::make_shared<SharedEvent>(stream_->device.index);
    done->record(*stream_);
    return done;
  }

  /// The stream the copies were queued on, if any.
  const std::optional<Stream>& stream() const { return stream_; }

 private:
  const Contribution& own_;
  std::optional<Stream> stream_;
  std::vector<const SharedEvent*> waited_;
  bool touched_host_ = false;  // a queued copy reads or writes host memory
};

struct PendingSend {
  const void* buffer;
  size_t bytes;
  int source;
  int tag;
  int device = -1;                       // device of `buffer`, -1 for host memory
  std::shared_ptr<SharedEvent> ready{};  // device buffers: recorded on the sender's compute stream
  // Device to device: recorded by the receiver after its copy was queued; the sender's compute
  // stream waits on it, so the buffer is reused only after the copy. Guarded by the group mutex.
  std::shared_ptr<SharedEvent> copied{};
  bool done = false;  // guarded by the group mutex
};

class LocalGroup {
 public:
  LocalGroup(int size, std::shared_ptr<LaunchState> launch)
      : size_(size),
        launch_(std::move(launch)),
        arrived_at_(size, 0),
        slots_(size),
        read_done_(size),
        inbox_(size) {}

  int size() const { return size_; }
  const std::shared_ptr<LaunchState>& launch() const { return launch_; }

  /// Publishes `mine` (when given) and waits until every rank of the group has arrived. With
  /// `read_done` (a collective's closing rendezvous) it also publishes the event after this
  /// rank's reads, or null when none is in flight.
  void arrive_and_wait(int rank, const char* name, const Contribution* mine,
                       const std::shared_ptr<SharedEvent>* read_done = nullptr) {
    std::unique_lock lock(mu_);
    if (mine) slots_[rank] = *mine;
    if (read_done) read_done_[rank] = *read_done;
    const uint64_t my_generation = generation_.load(std::memory_order_relaxed);
    arrived_at_[rank] = my_generation + 1;
    if (++arrived_ == size_) {
      arrived_ = 0;
      generation_.store(my_generation + 1, std::memory_order_release);
      cv_.notify_all();
      return;
    }
    // Peers usually arrive within microseconds: poll (yielding the core) before sleeping on
    // the condition variable, whose wake-up costs tens of microseconds.
    lock.unlock();
    for (int spin = 0; spin < kSpinsBeforeSleep; ++spin) {
      if (generation_.load(std::memory_order_acquire) != my_generation) return;
      std::this_thread::yield();
    }
    lock.lock();
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(comm_timeout());
    while (generation_ == my_generation) {
      throw_if_aborted(rank);
      if (Clock::now() >= deadline) {
        std::vector<int> missing;
        for (int r = 0; r < size_; ++r)
          if (arrived_at_[r] != my_generation + 1) missing.push_back(r);
        lock.unlock();
        throw CommTimeout(current_comm_op(),
                          timeout_message(name, rank, size_,
                                          fmt::format("rank(s) {} that never joined", missing)));
      }
      cv_.wait_for(lock, std::min<Clock::duration>(poll_interval, deadline - Clock::now()));
    }
  }

  const Contribution& slot(int rank) const { return slots_[rank]; }
  /// Rank `rank`'s event after its reads in the collective whose closing rendezvous just passed
  /// (valid until this rank arrives at the next collective).
  const std::shared_ptr<SharedEvent>& read_done(int rank) const { return read_done_[rank]; }

  /// The group formed by `color` in split number `sequence` (created by the first asker).
  std::shared_ptr<LocalGroup> split_group(uint64_t sequence, int color, int members) {
    std::lock_guard lock(mu_);
    auto& group = split_groups_[{sequence, color}];
    if (!group) group = std::make_shared<LocalGroup>(members, launch_);
    return group;
  }

  void post_send(int destination, const std::shared_ptr<PendingSend>& send) {
    std::lock_guard lock(mu_);
    inbox_[destination].push_back(send);
    p2p_progress_.fetch_add(1, std::memory_order_release);
    cv_.notify_all();
  }

  /// Called with the mutex held after a receiver completed messages (their senders may return).
  void note_p2p_progress() {
    p2p_progress_.fetch_add(1, std::memory_order_release);
    cv_.notify_all();
  }

  /// Waits (mutex held by `lock`) until the next p2p progress or `until`: first polling the
  /// counter with the lock released, yielding the core (a peer usually posts or copies within
  /// microseconds, and a condition variable's wake-up costs tens of them), then on the
  /// condition variable.
  void wait_for_p2p_progress(std::unique_lock<std::mutex>& lock, Clock::time_point until) {
    const uint64_t seen = p2p_progress_.load(std::memory_order_relaxed);
    lock.unlock();
    for (int spin = 0; spin < kSpinsBeforeSleep; ++spin) {
      if (p2p_progress_.load(std::memory_order_acquire) != seen) break;
      std::this_thread::yield();
    }
    lock.lock();
    // Progress is counted with the mutex held, so a change after this check notifies a waiter.
    if (p2p_progress_.load(std::memory_order_relaxed) != seen) return;
    cv_.wait_for(lock, std::min<Clock::duration>(poll_interval, until - Clock::now()));
  }

  std::mutex& mutex() { return mu_; }
  std::condition_variable& cv() { return cv_; }

  /// Removes and returns the oldest send to `rank` from `source` with `tag` (mutex held).
  std::shared_ptr<PendingSend> take_send(int rank, int source, int tag) {
    auto& queue = inbox_[rank];
    for (auto it = queue.begin(); it != queue.end(); ++it) {
      if ((*it)->source == source && (*it)->tag == tag) {
        auto found = *it;
        queue.erase(it);
        return found;
      }
    }
    return nullptr;
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
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> p2p_progress_{0};  // posts and completed receives (changed under mu_)
  int arrived_ = 0;
  std::vector<uint64_t> arrived_at_;
  std::vector<Contribution> slots_;
  std::vector<std::shared_ptr<SharedEvent>> read_done_;
  std::map<std::pair<uint64_t, int>, std::shared_ptr<LocalGroup>> split_groups_;
  std::vector<std::deque<std::shared_ptr<PendingSend>>> inbox_;
};

class LocalBatch final : public P2PBatch {
 public:
  LocalBatch(std::shared_ptr<LocalGroup> group, int rank, std::span<const P2POp> ops)
      : group_(std::move(group)), rank_(rank) {
    for (const P2POp& op : ops) {
      check_arg(op.peer >= 0 && op.peer < group_->size(), current_comm_op(),
                "send/recv peer {} outside a communicator of size {}", op.peer, group_->size());
      if (op.kind == P2POp::Kind::send) {
        auto send = std::make_shared<PendingSend>(PendingSend{op.buffer, op.bytes, rank, op.tag});
        send->device = comm_device::buffer_device(op.buffer);
        if (send->device >= 0) send->ready = ready_event(send->device);
        sends_.push_back({send, op.peer});
        group_->post_send(op.peer, send);
      } else {
        recvs_.push_back({op, false});
      }
    }
  }

  void wait() override {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(comm_timeout());
    std::optional<Stream> device_stream;  // the comm stream once a device copy was queued
    std::unique_lock lock(group_->mutex());
    while (true) {
      // Match every receive whose send has been posted; copy outside the lock.
      std::vector<std::pair<RecvState*, std::shared_ptr<PendingSend>>> matched;
      for (RecvState& recv : recvs_) {
        if (recv.done) continue;
        if (auto send = group_->take_send(rank_, recv.op.peer, recv.op.tag))
          matched.emplace_back(&recv, std::move(send));
      }
      if (!matched.empty()) {
        lock.unlock();
        bool touches_host = false;  // a device copy into or out of host memory was queued
        std::vector<bool> between_devices(matched.size(), false);
        for (size_t m = 0; m < matched.size(); ++m) {
          auto& [recv, send] = matched[m];
          if (send->bytes != recv->op.bytes) {
            group_->launch()->abort("message size mismatch");
            throw CommError(current_comm_op(),
                            fmt::format("rank {} expected {} bytes from rank {} (tag {}), rank {} "
                                        "sent {}",
                                        rank_, recv->op.bytes, recv->op.peer, recv->op.tag,
                                        send->source, send->bytes));
          }
          const Copy copy = copy_message(recv->op.buffer, *send, device_stream);
          touches_host |= copy == Copy::through_host;
          between_devices[m] = copy == Copy::between_devices;
        }
        // A send is done once its bytes are in place or, between device buffers, once the copy
        // is queued: the sender's compute stream then waits on `copied` (stream order, as
        // NCCL's), and no thread blocks on the device. Host memory is read or written by
        // threads, so a copy touching it completes first.
        std::shared_ptr<SharedEvent> copied;
        if (device_stream) {
          if (touches_host) {
            synchronize(*device_stream);
          } else {
            copied = std::make_shared<SharedEvent>(device_stream->device.index);
            copied->record(*device_stream);
          }
        }
        lock.lock();
        for (size_t m = 0; m < matched.size(); ++m) {
          auto& [recv, send] = matched[m];
          if (between_devices[m]) send->copied = copied;
          send->done = true;
          recv->done = true;
        }
        group_->note_p2p_progress();
        continue;
      }
      std::vector<std::string> waiting;
      for (const RecvState& recv : recvs_)
        if (!recv.done) waiting.push_back(fmt::format("recv from rank {}", recv.op.peer));
      for (const auto& [send, peer] : sends_)
        if (!send->done) waiting.push_back(fmt::format("send to rank {}", peer));
      if (waiting.empty()) {
        if (device_stream) order_after(compute_stream_for(device_stream->device), *device_stream);
        order_sends_before_reuse();
        return;
      }
      group_->throw_if_aborted(rank_);
      if (Clock::now() >= deadline)
        throw CommTimeout(current_comm_op(),
                          timeout_message("send_recv", rank_, group_->size(),
                                          fmt::format("{}", fmt::join(waiting, ", "))));
      group_->wait_for_p2p_progress(lock, deadline);
    }
  }

 private:
  struct RecvState {
    P2POp op;
    bool done;
  };

  /// The event of this batch's sends from `device`, recorded on the compute stream once.
  std::shared_ptr<SharedEvent> ready_event(int device) {
    for (const auto& [event_device, event] : ready_events_)
      if (event_device == device) return event;
    auto event = std::make_shared<SharedEvent>(device);
    event->record(comm_device::compute_stream_of(device));
    ready_events_.emplace_back(device, event);
    return event;
  }

  /// Orders the compute stream of every device this batch sent from after the receivers' queued
  /// copies out of its buffers (called with every send done; `copied` is then final).
  void order_sends_before_reuse() {
    std::vector<const SharedEvent*> waited;
    for (const auto& [send, peer] : sends_) {
      const SharedEvent* copied = send->copied.get();
      if (!copied || std::find(waited.begin(), waited.end(), copied) != waited.end()) continue;
      copied->wait_on(comm_device::compute_stream_of(send->device));
      waited.push_back(copied);
    }
  }

  /// What copy_message did: nothing left in flight (no bytes, or a memcpy between host buffers),
  /// or a device copy queued between two device buffers or touching host memory.
  enum class Copy : uint8_t { done, between_devices, through_host };

  /// Copies a matched message into `buffer`: memcpy between host buffers, else on the comm stream
  /// of the receiving device (or the sender's when receiving into host memory), after the
  /// sender's event and this rank's own compute work.
  Copy copy_message(void* buffer, const PendingSend& send, std::optional<Stream>& stream) {
    if (send.bytes == 0) return Copy::done;
    const int device = comm_device::buffer_device(buffer);
    if (device < 0 && send.device < 0) {
      copy_bytes(buffer, send.buffer, send.bytes);
      return Copy::done;
    }
    if (!stream) {
      stream = comm_device::comm_stream_for(device >= 0 ? device : send.device);
      order_after(*stream, compute_stream_for(stream->device));
    }
    if (send.ready) send.ready->wait_on(*stream);
    gpu::copy_bytes_async(buffer, send.buffer, send.bytes, stream->handle, stream->device.index);
    count_if_crossing(device, send.device, send.bytes);
    return device >= 0 && send.device >= 0 ? Copy::between_devices : Copy::through_host;
  }

  std::vector<std::pair<int, std::shared_ptr<SharedEvent>>> ready_events_;
  std::shared_ptr<LocalGroup> group_;
  int rank_;
  std::vector<std::pair<std::shared_ptr<PendingSend>, int>> sends_;
  std::vector<RecvState> recvs_;
};

class LocalComm final : public Comm {
 public:
  LocalComm(std::shared_ptr<LocalGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string backend() const override { return "local"; }

  std::unique_ptr<P2PBatch> start_send_recv(std::span<const P2POp> ops) override {
    return std::make_unique<LocalBatch>(group_, rank_, ops);
  }

  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    const size_t bytes = count * dtype_size(dtype);
    const Contribution mine = publish({.send = send, .recv = recv, .count = count});
    if (mine.device >= 0) {
      // Reduce into scratch on this rank's device; recv (maybe == send, which peers are reading)
      // is written only after the closing rendezvous.
      std::optional<comm_device::DeviceScratch> result;
      collective("all_reduce", mine, [&](Reader& reader) {
        for (int r = 0; r < size(); ++r) check_count("all_reduce", r, group_->slot(r).count, count);
        result.emplace(bytes, mine.device, reader.device_stream(mine), "all_reduce");
        reduce_on_device(reader, result->data(), 0, count, dtype, op, "all_reduce");
      });
      finish_on_device(recv, result->data(), bytes, mine.device);
      return;
    }
    std::vector<std::byte> result(bytes);
    collective("all_reduce", mine, [&](Reader& reader) {
      for (int r = 0; r < size(); ++r) check_count("all_reduce", r, group_->slot(r).count, count);
      // Every rank reduces in rank order, so every rank gets bit-identical results.
      reader.copy(result.data(), group_->slot(0).send, bytes, group_->slot(0));
      reader.finish();
      for (int r = 1; r < size(); ++r)
        reduce_into(result.data(), host_view(reader, r, 0, bytes), count, dtype, op);
    });
    if (op == ReduceOp::avg) divide_by(result.data(), count, dtype, size());
    copy_bytes(recv, result.data(), bytes);
  }

  void all_gather_v(const void* send, size_t send_count, void* recv,
                    std::span<const size_t> recv_counts, DType dtype) override {
    check_counts_size("all_gather_v", recv_counts);
    const size_t element = dtype_size(dtype);
    collective("all_gather_v", publish({.send = send, .recv = recv, .count = send_count}),
               [&](Reader& reader) {
                 size_t offset = 0;
                 for (int r = 0; r < size(); ++r) {
                   check_count("all_gather_v", r, group_->slot(r).count, recv_counts[r]);
                   reader.copy(static_cast<char*>(recv) + offset * element, group_->slot(r).send,
                               recv_counts[r] * element, group_->slot(r));
                   offset += recv_counts[r];
                 }
               });
  }

  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                        DType dtype, ReduceOp op) override {
    check_counts_size("reduce_scatter_v", recv_counts);
    const size_t element = dtype_size(dtype);
    const size_t count = recv_counts[rank_];
    size_t offset = 0;
    for (int r = 0; r < rank_; ++r) offset += recv_counts[r];
    const Contribution mine = publish({.send = send, .recv = recv, .counts = recv_counts});
    auto check_counts = [&] {
      for (int r = 0; r < size(); ++r)
        check_count("reduce_scatter_v", r, group_->slot(r).counts[rank_], count);
    };
    if (mine.device >= 0) {
      std::optional<comm_device::DeviceScratch> result;
      collective("reduce_scatter_v", mine, [&](Reader& reader) {
        check_counts();
        result.emplace(count * element, mine.device, reader.device_stream(mine),
                       "reduce_scatter_v");
        reduce_on_device(reader, result->data(), offset * element, count, dtype, op,
                         "reduce_scatter_v");
      });
      finish_on_device(recv, result->data(), count * element, mine.device);
      return;
    }
    std::vector<std::byte> result(count * element);
    collective("reduce_scatter_v", mine, [&](Reader& reader) {
      check_counts();
      reader.copy(result.data(), static_cast<const char*>(group_->slot(0).send) + offset * element,
                  count * element, group_->slot(0));
      reader.finish();
      for (int r = 1; r < size(); ++r)
        reduce_into(result.data(), host_view(reader, r, offset * element, count * element), count,
                    dtype, op);
    });
    if (op == ReduceOp::avg) divide_by(result.data(), count, dtype, size());
    copy_bytes(recv, result.data(), count * element);
  }

  void all_to_all_v(const void* send, std::span<const size_t> send_counts,
                    std::span<const size_t> send_displs, void* recv,
                    std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                    DType dtype) override {
    check_counts_size("all_to_all_v", send_counts);
    check_counts_size("all_to_all_v", send_displs);
    check_counts_size("all_to_all_v", recv_counts);
    check_counts_size("all_to_all_v", recv_displs);
    const size_t element = dtype_size(dtype);
    collective("all_to_all_v",
               publish({.send = send, .recv = recv, .counts = send_counts, .displs = send_displs}),
               [&](Reader& reader) {
                 for (int r = 0; r < size(); ++r) {
                   const Contribution& peer = group_->slot(r);
                   check_count("all_to_all_v", r, peer.counts[rank_], recv_counts[r]);
                   reader.copy(static_cast<char*>(recv) + recv_displs[r] * element,
                               static_cast<const char*>(peer.send) + peer.displs[rank_] * element,
                               recv_counts[r] * element, peer);
                 }
               });
  }

  void all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                    void* recv_base, std::span<const StridedBlock> recv_blocks,
                    DType dtype) override {
    check_counts_size("all_to_all_w", send_blocks.size());
    check_counts_size("all_to_all_w", recv_blocks.size());
    const size_t element = dtype_size(dtype);
    // Each receiver copies straight from the sender's strided block into its own: one pass.
    collective(
        "all_to_all_w", publish({.send = send_base, .recv = recv_base, .blocks = send_blocks}),
        [&](Reader& reader) {
          for (int r = 0; r < size(); ++r) {
            const StridedBlock& source = group_->slot(r).blocks[rank_];
            const StridedBlock& target = recv_blocks[r];
            if (source.shape != target.shape)
              throw CommError(current_comm_op(),
                              fmt::format("all_to_all_w: rank {} expects a block of shape {} from "
                                          "rank {}, which sends {}",
                                          rank_, target.shape, r, source.shape));
            if (target.count() == 0) continue;
            reader.copy_strided(
                static_cast<char*>(recv_base) + target.offset * element, target.strides.data(),
                static_cast<const char*>(group_->slot(r).send) + source.offset * element,
                source.strides.data(), target.shape, element, group_->slot(r), r);
          }
        });
  }

  void broadcast(void* buffer, size_t count, DType dtype, int root) override {
    check_root("broadcast", root);
    collective("broadcast", publish({.send = buffer, .count = count, .root = root}),
               [&](Reader& reader) {
                 check_count("broadcast", root, group_->slot(root).count, count);
                 if (rank_ != root)
                   reader.copy(buffer, group_->slot(root).send, count * dtype_size(dtype),
                               group_->slot(root));
               });
  }

  void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                 size_t recv_count, DType dtype, int root) override {
    check_root("scatter_v", root);
    if (rank_ == root) check_counts_size("scatter_v", send_counts);
    const size_t element = dtype_size(dtype);
    collective("scatter_v",
               publish({.send = send, .recv = recv, .counts = send_counts, .root = root}),
               [&](Reader& reader) {
                 const Contribution& source = group_->slot(root);
                 check_count("scatter_v", root, source.counts[rank_], recv_count);
                 size_t offset = 0;
                 for (int r = 0; r < rank_; ++r) offset += source.counts[r];
                 reader.copy(recv, static_cast<const char*>(source.send) + offset * element,
                             recv_count * element, source);
               });
  }

  void gather_v(const void* send, size_t send_count, void* recv,
                std::span<const size_t> recv_counts, DType dtype, int root) override {
    check_root("gather_v", root);
    if (rank_ == root) check_counts_size("gather_v", recv_counts);
    const size_t element = dtype_size(dtype);
    collective("gather_v", publish({.send = send, .recv = recv, .count = send_count, .root = root}),
               [&](Reader& reader) {
                 if (rank_ != root) return;
                 size_t offset = 0;
                 for (int r = 0; r < size(); ++r) {
                   check_count("gather_v", r, group_->slot(r).count, recv_counts[r]);
                   reader.copy(static_cast<char*>(recv) + offset * element, group_->slot(r).send,
                               recv_counts[r] * element, group_->slot(r));
                   offset += recv_counts[r];
                 }
               });
  }

  void barrier() override { group_->arrive_and_wait(rank_, "barrier", nullptr); }

  std::shared_ptr<Comm> split(int color, int key) override {
    const uint64_t sequence = split_count_++;
    std::shared_ptr<Comm> result;
    collective("split", {.color = color, .key = key}, [&](Reader&) {
      if (color < 0) return;
      std::vector<std::pair<int, int>> members;  // (key, parent rank)
      for (int r = 0; r < size(); ++r)
        if (group_->slot(r).color == color) members.emplace_back(group_->slot(r).key, r);
      std::sort(members.begin(), members.end());
      const int new_rank = static_cast<int>(
          std::find(members.begin(), members.end(), std::make_pair(key, rank_)) - members.begin());
      result = std::make_shared<LocalComm>(
          group_->split_group(sequence, color, static_cast<int>(members.size())), new_rank);
    });
    return result;
  }

 private:
  /// `mine` with the device of its buffers and, for device buffers, the event that marks them
  /// ready (recorded now on this rank's compute stream).
  Contribution publish(Contribution mine) {
    mine.device = comm_device::buffer_device(mine.send);
    if (mine.device < 0) mine.device = comm_device::buffer_device(mine.recv);
    if (mine.device < 0) return mine;
    if (!ready_event_ || ready_device_ != mine.device) {
      ready_event_ = std::make_shared<SharedEvent>(mine.device);
      ready_device_ = mine.device;
    }
    ready_event_->record(comm_device::compute_stream_of(mine.device));
    mine.ready = ready_event_;
    return mine;
  }

  template <typename Work>
  void collective(const char* name, Contribution mine, Work&& work) {
    mine.name = name;
    group_->arrive_and_wait(rank_, name, &mine);
    for (int r = 0; r < size(); ++r) {
      if (std::strcmp(group_->slot(r).name, name) != 0) {
        // Ranks called different collectives: a program error that would deadlock MPI.
        const std::string message = fmt::format("rank {} called {} while rank {} called {}", rank_,
                                                name, r, group_->slot(r).name);
        group_->launch()->abort(message);
        throw CommError(current_comm_op(), message);
      }
    }
    std::exception_ptr failure;
    Reader reader(mine);
    std::shared_ptr<SharedEvent> read_done;
    try {
      work(reader);
      // No rank's later work may touch its buffers before every reader's copies are done: copies
      // touching host memory are waited for here, device-to-device ones leave an event.
      read_done = reader.finish_in_flight();
    } catch (...) {
      failure = std::current_exception();
      group_->launch()->abort("a collective's arguments disagree between ranks");
    }
    group_->arrive_and_wait(rank_, name, nullptr, &read_done);
    if (failure) std::rethrow_exception(failure);
    if (mine.device >= 0) {
      // Whatever this rank queues next on its compute stream (a kernel overwriting its send
      // buffer), or on its comm stream (finish_on_device writing recv, which may be send),
      // waits for every rank's reads; its own results are ordered before its compute stream.
      const Stream compute = comm_device::compute_stream_of(mine.device);
      const Stream comm = comm_device::comm_stream_for(mine.device);
      for (int r = 0; r < size(); ++r)
        if (const auto& done = group_->read_done(r)) {
          done->wait_on(compute);
          done->wait_on(comm);
        }
    }
    if (reader.stream()) order_after(compute_stream_for(reader.stream()->device), *reader.stream());
  }

  /// Rank `r`'s send bytes [offset, offset + bytes) readable on the host: its buffer itself, or
  /// a host copy when it lives on a device.
  const void* host_view(Reader& reader, int r, size_t offset, size_t bytes) {
    const Contribution& peer = group_->slot(r);
    const char* source = static_cast<const char*>(peer.send) + offset;
    if (peer.device < 0) return source;
    staging_.resize(bytes);
    reader.copy(staging_.data(), source, bytes, peer);
    reader.finish();
    return staging_.data();
  }

  /// result = reduction in rank order of every rank's send bytes from `offset` (count elements),
  /// on this rank's device and comm stream; avg is divided here.
  void reduce_on_device(Reader& reader, void* result, size_t offset, size_t count, DType dtype,
                        ReduceOp op, const char* name) {
    const size_t bytes = count * dtype_size(dtype);
    if (bytes == 0) return;
    const Device device = Device::cuda(group_->slot(rank_).device);
    const Contribution& first = group_->slot(0);
    const Stream& stream = reader.device_stream(first);
    reader.copy(result, static_cast<const char*>(first.send) + offset, bytes, first);
    const int64_t shape[1] = {static_cast<int64_t>(count)};
    const int64_t strides[1] = {1};
    DeviceBackend& backend = backend_for(device);
    std::optional<comm_device::DeviceScratch> staged;
    for (int r = 1; r < size(); ++r) {
      const Contribution& peer = group_->slot(r);
      const void* operand = static_cast<const char*>(peer.send) + offset;
      reader.device_stream(peer);  // orders the stream after the peer's event
      if (peer.device != device.index) {
        // Another device's (or the host's) data is first copied next to the result.
        if (!staged) staged.emplace(bytes, device.index, stream, name);
        reader.copy(staged->data(), operand, bytes, peer);
        operand = staged->data();
      }
      backend.accumulate({result, shape, strides, 1},
                         {const_cast<void*>(operand), shape, strides, 1}, dtype, op, stream);
    }
    if (op == ReduceOp::avg)
      backend.scale({result, shape, strides, 1}, dtype, 1.0 / size(), stream);
  }

  /// After the closing rendezvous (no peer reads this rank's buffers any more): recv = result on
  /// the comm stream, and the compute stream ordered after it.
  void finish_on_device(void* recv, const void* result, size_t bytes, int device) {
    const Stream stream = comm_device::comm_stream_for(device);
    if (bytes) gpu::copy_bytes_async(recv, result, bytes, stream.handle, device);
    order_after(comm_device::compute_stream_of(device), stream);
  }

  void check_count(const char* name, int peer, size_t theirs, size_t mine) const {
    if (theirs != mine)
      throw CommError(current_comm_op(),
                      fmt::format("{}: rank {} expects {} elements from/for rank {}, which has {}",
                                  name, rank_, mine, peer, theirs));
  }
  void check_counts_size(const char* name, std::span<const size_t> counts) const {
    check_counts_size(name, counts.size());
  }
  void check_counts_size(const char* name, size_t given) const {
    check_arg(given == static_cast<size_t>(size()), current_comm_op(),
              "{}: {} counts given for a communicator of size {}", name, given, size());
  }
  void check_root(const char* name, int root) const {
    check_arg(root >= 0 && root < size(), current_comm_op(), "{}: root {} outside size {}", name,
              root, size());
  }

  std::shared_ptr<LocalGroup> group_;
  int rank_;
  uint64_t split_count_ = 0;
  std::shared_ptr<SharedEvent> ready_event_;  // marks this rank's device buffers ready
  int ready_device_ = -1;
  std::vector<std::byte> staging_;  // host copies of device operands of host reductions
};

}  // namespace

void run_local_ranks(int ranks, const std::function<void(std::shared_ptr<Comm>)>& body) {
  check_arg(ranks > 0 && ranks <= kMaxLocalRanks, "local",
            "cannot launch {} local ranks (expected 1 to {})", ranks, kMaxLocalRanks);
  // Devices are chosen (and checked) here, so a bad TESSERA_DEVICE is one error, not one per rank.
  std::vector<Device> devices;
  for (int rank = 0; rank < ranks; ++rank) devices.push_back(launch_device(rank));
  auto launch = std::make_shared<LaunchState>();
  auto world = std::make_shared<LocalGroup>(ranks, launch);
  std::vector<std::exception_ptr> errors(ranks);
  // One byte per rank (not vector<bool>, whose bits share words): each rank thread writes only
  // its own entry, read after the joins.
  std::vector<char> peer_failed(ranks, 0);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto run_rank = [&](int rank) {
    // The ranks share this process's cores: give each rank's kernels its share.
    set_compute_threads(std::max(1, cores / ranks));
    try {
      if (devices[rank].is_cuda()) gpu::set_device(devices[rank].index);
      RankContextScope context(std::make_shared<RankContext>(devices[rank]));
      body(std::make_shared<LocalComm>(world, rank));
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
  std::vector<std::thread> threads;
  threads.reserve(ranks - 1);
  for (int rank = 1; rank < ranks; ++rank) threads.emplace_back(run_rank, rank);
  run_rank(0);  // rank 0 runs on the calling thread, so a 1-rank launch spawns nothing
  for (auto& thread : threads) thread.join();
  for (int rank = 0; rank < ranks; ++rank)
    if (errors[rank] && !peer_failed[rank]) std::rethrow_exception(errors[rank]);
  for (int rank = 0; rank < ranks; ++rank)
    if (errors[rank]) std::rethrow_exception(errors[rank]);
}

}  // namespace tessera
