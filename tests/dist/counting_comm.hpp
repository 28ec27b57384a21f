// A Comm wrapper for the distributed tests that counts what moves: the bytes of every
// collective of f64 data and every point-to-point send, into a ledger its splits share.
#pragma once

#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/comm.hpp"

namespace tessera::testing {

/// A Comm that counts the bytes of each collective of f64 data (the elements every rank ends up
/// with: all_reduce's count, all_gather_v's and reduce_scatter_v's per-rank counts summed) and
/// forwards it; its splits count into the same ledger. Collectives of integers (the agreement
/// checks every op makes before data moves, a few integers each) are not the model's volume.
class CountingComm final : public Comm {
 public:
  struct Ledger {
    std::mutex mutex;
    std::vector<std::pair<std::string, int64_t>> calls;
    /// Every point-to-point send of any dtype: (tag, bytes).
    std::vector<std::pair<int, int64_t>> sends;
  };

  CountingComm(std::shared_ptr<Comm> inner, std::shared_ptr<Ledger> ledger)
      : inner_(std::move(inner)), ledger_(std::move(ledger)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  const Comm& underlying() const override { return inner_->underlying(); }
  std::unique_ptr<P2PBatch> start_send_recv(std::span<const P2POp> ops) override {
    int64_t sent = 0;
    for (const P2POp& op : ops)
      if (op.kind == P2POp::Kind::send) sent += static_cast<int64_t>(op.bytes);
    note("send_recv", sent, DType::f64);
    std::lock_guard lock(ledger_->mutex);
    for (const P2POp& op : ops)
      if (op.kind == P2POp::Kind::send)
        ledger_->sends.emplace_back(op.tag, static_cast<int64_t>(op.bytes));
    return inner_->start_send_recv(ops);
  }
  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    note("all_reduce", static_cast<int64_t>(count * dtype_size(dtype)), dtype);
    inner_->all_reduce(send, recv, count, dtype, op);
  }
  std::unique_ptr<PendingCollective> start_all_reduce(const void* send, void* recv, size_t count,
                                                      DType dtype, ReduceOp op) override {
    note("all_reduce", static_cast<int64_t>(count * dtype_size(dtype)), dtype);
    return inner_->start_all_reduce(send, recv, count, dtype, op);
  }
  std::unique_ptr<PendingCollective> start_all_gather_v(const void* send, size_t send_count,
                                                        void* recv,
                                                        std::span<const size_t> recv_counts,
                                                        DType dtype) override {
    note("all_gather", total(recv_counts, dtype), dtype);
    return inner_->start_all_gather_v(send, send_count, recv, recv_counts, dtype);
  }
  void all_gather_v(const void* send, size_t send_count, void* recv,
                    std::span<const size_t> recv_counts, DType dtype) override {
    note("all_gather", total(recv_counts, dtype), dtype);
    inner_->all_gather_v(send, send_count, recv, recv_counts, dtype);
  }
  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                        DType dtype, ReduceOp op) override {
    note("reduce_scatter", total(recv_counts, dtype), dtype);
    inner_->reduce_scatter_v(send, recv, recv_counts, dtype, op);
  }
  void all_to_all_v(const void* send, std::span<const size_t> send_counts,
                    std::span<const size_t> send_displs, void* recv,
                    std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                    DType dtype) override {
    note("all_to_all", total(send_counts, dtype), dtype);
    inner_->all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  }
  void all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                    void* recv_base, std::span<const StridedBlock> recv_blocks,
                    DType dtype) override {
    int64_t sent = 0;
    for (const StridedBlock& block : send_blocks)
      sent += static_cast<int64_t>(block.count() * dtype_size(dtype));
    note("all_to_all", sent, dtype);
    inner_->all_to_all_w(send_base, send_blocks, recv_base, recv_blocks, dtype);
  }
  void broadcast(void* buffer, size_t count, DType dtype, int root) override {
    note("broadcast", static_cast<int64_t>(count * dtype_size(dtype)), dtype);
    inner_->broadcast(buffer, count, dtype, root);
  }
  void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                 size_t recv_count, DType dtype, int root) override {
    note("scatter", static_cast<int64_t>(recv_count * dtype_size(dtype)), dtype);
    inner_->scatter_v(send, send_counts, recv, recv_count, dtype, root);
  }
  void gather_v(const void* send, size_t send_count, void* recv,
                std::span<const size_t> recv_counts, DType dtype, int root) override {
    note("gather", static_cast<int64_t>(send_count * dtype_size(dtype)), dtype);
    inner_->gather_v(send, send_count, recv, recv_counts, dtype, root);
  }
  void barrier() override { inner_->barrier(); }
  std::shared_ptr<Comm> split(int color, int key) override {
    std::shared_ptr<Comm> part = inner_->split(color, key);
    return part ? std::make_shared<CountingComm>(std::move(part), ledger_) : nullptr;
  }

 private:
  static int64_t total(std::span<const size_t> counts, DType dtype) {
    int64_t sum = 0;
    for (size_t count : counts) sum += static_cast<int64_t>(count * dtype_size(dtype));
    return sum;
  }
  void note(const std::string& name, int64_t bytes, DType dtype) {
    if (dtype != DType::f64) return;
    std::lock_guard lock(ledger_->mutex);
    ledger_->calls.emplace_back(name, bytes);
  }

  std::shared_ptr<Comm> inner_;
  std::shared_ptr<Ledger> ledger_;
};

}  // namespace tessera::testing
