// A Comm wrapper for the benchmarks that times what a model's collectives cost: for every
// all_reduce, all_gather_v and reduce_scatter_v of floating data (not the integer agreement
// checks) it records the buffer's bytes and the seconds this rank spent in the call (for the
// started variants: in their wait()), and forwards it. Its splits are TimedComms too, each with
// its own record, so the record of one mesh dim's communicator (DeviceMesh::dim_comm) is what
// that dim moved.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "core/comm/comm.hpp"

namespace tessera::bench {

/// One kind of collective at one buffer size: how often, and the seconds spent in it.
struct TimedCalls {
  int64_t calls = 0;
  double seconds = 0;
};

/// (collective name, buffer bytes) -> calls.
using CollectiveRecord = std::map<std::pair<std::string, int64_t>, TimedCalls>;

class TimedComm final : public Comm {
 public:
  explicit TimedComm(std::shared_ptr<Comm> inner) : inner_(std::move(inner)) {}

  /// What this communicator (not its splits) recorded since construction or clear().
  const CollectiveRecord& record() const { return record_; }
  void clear() { record_.clear(); }
  /// The communicator underneath, for measurements that must not be recorded.
  Comm& inner() { return *inner_; }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  const Comm& underlying() const override { return inner_->underlying(); }
  std::unique_ptr<P2PBatch> start_send_recv(std::span<const P2POp> ops) override {
    return inner_->start_send_recv(ops);
  }
  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    timed("all_reduce", bytes(count, dtype), dtype,
          [&] { inner_->all_reduce(send, recv, count, dtype, op); });
  }
  std::unique_ptr<PendingCollective> start_all_reduce(const void* send, void* recv, size_t count,
                                                      DType dtype, ReduceOp op) override {
    std::unique_ptr<PendingCollective> pending;
    timed("all_reduce", bytes(count, dtype), dtype,
          [&] { pending = inner_->start_all_reduce(send, recv, count, dtype, op); });
    return wrap(std::move(pending), "all_reduce", bytes(count, dtype), dtype);
  }
  std::unique_ptr<PendingCollective> start_all_gather_v(const void* send, size_t send_count,
                                                        void* recv,
                                                        std::span<const size_t> recv_counts,
                                                        DType dtype) override {
    std::unique_ptr<PendingCollective> pending;
    timed("all_gather", total(recv_counts, dtype), dtype, [&] {
      pending = inner_->start_all_gather_v(send, send_count, recv, recv_counts, dtype);
    });
    return wrap(std::move(pending), "all_gather", total(recv_counts, dtype), dtype);
  }
  void all_gather_v(const void* send, size_t send_count, void* recv,
                    std::span<const size_t> recv_counts, DType dtype) override {
    timed("all_gather", total(recv_counts, dtype), dtype,
          [&] { inner_->all_gather_v(send, send_count, recv, recv_counts, dtype); });
  }
  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                        DType dtype, ReduceOp op) override {
    timed("reduce_scatter", total(recv_counts, dtype), dtype,
          [&] { inner_->reduce_scatter_v(send, recv, recv_counts, dtype, op); });
  }
  void all_to_all_v(const void* send, std::span<const size_t> send_counts,
                    std::span<const size_t> send_displs, void* recv,
                    std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                    DType dtype) override {
    inner_->all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  }
  void all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                    void* recv_base, std::span<const StridedBlock> recv_blocks,
                    DType dtype) override {
    inner_->all_to_all_w(send_base, send_blocks, recv_base, recv_blocks, dtype);
  }
  void broadcast(void* buffer, size_t count, DType dtype, int root) override {
    inner_->broadcast(buffer, count, dtype, root);
  }
  void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                 size_t recv_count, DType dtype, int root) override {
    inner_->scatter_v(send, send_counts, recv, recv_count, dtype, root);
  }
  void gather_v(const void* send, size_t send_count, void* recv,
                std::span<const size_t> recv_counts, DType dtype, int root) override {
    inner_->gather_v(send, send_count, recv, recv_counts, dtype, root);
  }
  void barrier() override { inner_->barrier(); }
  std::shared_ptr<Comm> split(int color, int key) override {
    std::shared_ptr<Comm> part = inner_->split(color, key);
    return part ? std::make_shared<TimedComm>(std::move(part)) : nullptr;
  }

 private:
  using Clock = std::chrono::steady_clock;

  static int64_t bytes(size_t count, DType dtype) {
    return static_cast<int64_t>(count * dtype_size(dtype));
  }
  static int64_t total(std::span<const size_t> counts, DType dtype) {
    int64_t sum = 0;
    for (size_t count : counts) sum += bytes(count, dtype);
    return sum;
  }
  static bool counted(DType dtype) { return is_floating(dtype); }

  template <typename Body>
  void timed(const std::string& name, int64_t size, DType dtype, Body&& body) {
    const auto start = Clock::now();
    body();
    if (!counted(dtype)) return;
    TimedCalls& calls = record_[{name, size}];
    ++calls.calls;
    calls.seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }

  /// The wait of a started collective adds its seconds to the call's record (counted once, at
  /// the start).
  class TimedPending final : public PendingCollective {
   public:
    TimedPending(std::unique_ptr<PendingCollective> inner, TimedCalls* calls)
        : inner_(std::move(inner)), calls_(calls) {}
    void wait() override {
      const auto start = Clock::now();
      inner_->wait();
      if (calls_) calls_->seconds += std::chrono::duration<double>(Clock::now() - start).count();
    }

   private:
    std::unique_ptr<PendingCollective> inner_;
    TimedCalls* calls_;
  };

  std::unique_ptr<PendingCollective> wrap(std::unique_ptr<PendingCollective> pending,
                                          const std::string& name, int64_t size, DType dtype) {
    // std::map nodes are stable: the pointer stays valid while the record is not cleared.
    TimedCalls* calls = counted(dtype) ? &record_[{name, size}] : nullptr;
    return std::make_unique<TimedPending>(std::move(pending), calls);
  }

  std::shared_ptr<Comm> inner_;
  CollectiveRecord record_;
};

}  // namespace tessera::bench
