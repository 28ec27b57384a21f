// The nccl backend (see nccl_comm.hpp). Device buffers move through NCCL on the rank's comm
// stream: native collectives where NCCL has one for the call's shape (all_reduce, broadcast,
// all_gather_v and reduce_scatter_v with equal counts), and otherwise one ncclGroupStart/End of
// sends, receives and local copies from the grouping plans of nccl_plan.hpp, so uneven counts
// move exactly their bytes. Host buffers go to the bootstrap Comm.
//
// Communicators are non-blocking (ncclConfig_t::blocking = 0): every NCCL call returns at once
// and the waits poll ncclCommGetAsyncError and an event on the comm stream until
// TESSERA_COMM_TIMEOUT; a timeout or an asynchronous error aborts the communicator
// (ncclCommAbort) and raises CommTimeout / CommError naming the op, the rank and the peers. A
// call returns once its transfers are done, and the compute stream is ordered after them.
#include "core/comm/nccl_comm.hpp"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include "core/backend/backend.hpp"
#include "core/comm/comm_device.hpp"
#include "core/comm/nccl_plan.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;
using comm_device::buffer_device;
using nccl_plan::Transfer;

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
  }
  return ncclUint8;
}

/// NCCL's op for `op` on `dtype`: avg is ncclAvg on floating dtypes and a sum (scaled after) on
/// integers.
ncclRedOp_t nccl_op(ReduceOp op, DType dtype) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::prod: return ncclProd;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::avg: return is_floating(dtype) ? ncclAvg : ncclSum;
  }
  return ncclSum;
}

/// Between polls: yield at first, then sleep a little (long transfers should not hold a core).
void pause(uint64_t spin) {
  if (spin < 1000)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(20));
}

/// True when `pointer` is host memory (null counts as device memory: a rank with nothing to move
/// still joins the device path of its peers).
bool on_host(const void* pointer) {
  return pointer != nullptr && buffer_device(pointer) < 0;
}

/// One NCCL communicator and what its waits need; shared by the Comm and its batches.
struct NcclHandle {
  ncclComm_t comm = nullptr;
  int device = 0;
  int rank = 0;
  int size = 1;
  bool aborted = false;
  std::optional<comm_device::SharedEvent> done;  // recorded on the comm stream after each call

  ~NcclHandle() {
    if (comm && !aborted) ncclCommDestroy(comm);
  }

  /// Aborts the communicator (every later call fails) and returns `error` to throw.
  template <typename Error>
  Error abort_with(Error error) {
    if (!aborted && comm) ncclCommAbort(comm);
    aborted = true;
    return error;
  }

  void check_alive(const char* name) const {
    if (aborted)
      throw CommError(current_comm_op(),
                      fmt::format("{}: the NCCL communicator of rank {} was aborted by an earlier "
                                  "error or timeout",
                                  name, rank));
  }

  /// Throws for a failed NCCL call; waits for one still in progress (non-blocking comm).
  void check(ncclResult_t result, const char* name, const std::string& peers) {
    if (result == ncclInProgress) result = wait_ready(name, peers);
    if (result != ncclSuccess)
      throw abort_with(
          CommError(current_comm_op(),
                    fmt::format("{}: NCCL error on rank {} of {} (peers: {}): {} ({})", name, rank,
                                size, peers, ncclGetErrorString(result), ncclGetLastError(comm))));
  }

  /// Polls the communicator's state until it is no longer in progress (or the deadline).
  ncclResult_t wait_ready(const char* name, const std::string& peers) {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(comm_timeout());
    uint64_t spin = 0;
    while (true) {
      ncclResult_t state = ncclSuccess;
      // A failed query (a null communicator among them) is the answer, never "ready".
      const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
      if (query != ncclSuccess) return query;
      if (state != ncclInProgress) return state;
      if (Clock::now() >= deadline)
        throw abort_with(CommTimeout(current_comm_op(), timeout_message(name, rank, size, peers)));
      pause(spin++);
    }
  }

  /// Waits until the work queued so far on `stream` is done, polling for asynchronous errors.
  void wait_stream(const Stream& stream, const char* name, const std::string& peers) {
    if (!done) done.emplace(device);
    done->record(stream);
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(comm_timeout());
    uint64_t spin = 0;
    while (true) {
      const bool finished = done->query();
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm, &state);
      if (state != ncclSuccess && state != ncclInProgress)
        throw abort_with(
            CommError(current_comm_op(),
                      fmt::format("{}: NCCL reported an asynchronous error on rank {} of {} "
                                  "(peers: {}): {} ({})",
                                  name, rank, size, peers, ncclGetErrorString(state),
                                  ncclGetLastError(comm))));
      if (finished) return;
      if (Clock::now() >= deadline)
        throw abort_with(CommTimeout(current_comm_op(), timeout_message(name, rank, size, peers)));
      pause(spin++);
    }
  }
};

/// "send to rank 1, recv from rank 2" of a plan (for timeout messages).
std::string peers_of(const std::vector<Transfer>& plan) {
  std::vector<std::string> peers;
  for (const Transfer& transfer : plan) {
    if (transfer.kind == Transfer::Kind::copy) continue;
    std::string peer =
        fmt::format("{} rank {}", transfer.kind == Transfer::Kind::send ? "send to" : "recv from",
                    transfer.peer);
    if (std::find(peers.begin(), peers.end(), peer) == peers.end()) peers.push_back(peer);
  }
  return peers.empty() ? "none" : fmt::format("{}", fmt::join(peers, ", "));
}

/// Queues `plan` as one NCCL group on `stream`: sends read `send` (+ offset elements), receives
/// and copies write `recv`; `buffers` gives per-op pointers instead for batches.
void enqueue_plan(NcclHandle& handle, const std::vector<Transfer>& plan, const void* send,
                  void* recv, size_t element, ncclDataType_t type, const Stream& stream,
                  const char* name, std::span<const P2POp> ops = {}) {
  const std::string peers = peers_of(plan);
  auto source = [&](const Transfer& t) {
    const void* base = ops.empty() ? send : ops[t.op].buffer;
    return static_cast<const char*>(base) + t.offset * element;
  };
  auto target = [&](const Transfer& t, size_t offset) {
    void* base = ops.empty() ? recv : ops[t.kind == Transfer::Kind::copy ? t.dst_op : t.op].buffer;
    return static_cast<char*>(base) + offset * element;
  };
  handle.check(ncclGroupStart(), name, peers);
  for (const Transfer& t : plan) {
    switch (t.kind) {
      case Transfer::Kind::send:
        handle.check(ncclSend(source(t), t.count, type, t.peer, handle.comm,
                              static_cast<cudaStream_t>(stream.handle)),
                     name, peers);
        break;
      case Transfer::Kind::recv:
        handle.check(ncclRecv(target(t, t.offset), t.count, type, t.peer, handle.comm,
                              static_cast<cudaStream_t>(stream.handle)),
                     name, peers);
        break;
      case Transfer::Kind::copy:
        gpu::copy_bytes_async(target(t, t.dst_offset), source(t), t.count * element, stream.handle,
                              stream.device.index);
        break;
    }
  }
  handle.check(ncclGroupEnd(), name, peers);
}

/// The streams of one device call: the comm stream waits for the compute stream first.
struct DeviceCall {
  Stream compute;
  Stream comm;
  explicit DeviceCall(int device)
      : compute(comm_device::compute_stream_of(device)),
        comm(comm_device::comm_stream_for(device)) {
    gpu::set_device(device);
    order_after(comm, compute);
  }
  /// Waits for the call's transfers and orders the compute stream after them.
  void finish(NcclHandle& handle, const char* name, const std::string& peers) {
    handle.wait_stream(comm, name, peers);
    order_after(compute, comm);
  }
};

class NcclBatch final : public P2PBatch {
 public:
  NcclBatch(std::shared_ptr<NcclHandle> handle, std::unique_ptr<P2PBatch> host_batch,
            std::optional<DeviceCall> call, std::string peers)
      : handle_(std::move(handle)),
        host_batch_(std::move(host_batch)),
        call_(std::move(call)),
        peers_(std::move(peers)) {}

  void wait() override {
    if (host_batch_) host_batch_->wait();
    if (call_) call_->finish(*handle_, "send_recv", peers_);
  }

 private:
  std::shared_ptr<NcclHandle> handle_;
  std::unique_ptr<P2PBatch> host_batch_;
  std::optional<DeviceCall> call_;
  std::string peers_;
};

class NcclComm final : public Comm {
 public:
  NcclComm(std::shared_ptr<Comm> bootstrap, std::shared_ptr<NcclHandle> handle)
      : bootstrap_(std::move(bootstrap)), handle_(std::move(handle)) {}

  int rank() const override { return handle_->rank; }
  int size() const override { return handle_->size; }
  std::string backend() const override { return "nccl"; }

  std::unique_ptr<P2PBatch> start_send_recv(std::span<const P2POp> ops) override {
    std::vector<P2POp> host_ops, device_ops;
    for (const P2POp& op : ops) {
      check_arg(op.peer >= 0 && op.peer < size(), current_comm_op(),
                "send/recv peer {} outside a communicator of size {}", op.peer, size());
      (on_host(op.buffer) ? host_ops : device_ops).push_back(op);
    }
    std::unique_ptr<P2PBatch> host_batch;
    if (!host_ops.empty()) host_batch = bootstrap_->start_send_recv(host_ops);
    std::optional<DeviceCall> call;
    std::string peers;
    if (!device_ops.empty()) {
      handle_->check_alive("send_recv");
      const std::vector<Transfer> plan = nccl_plan::plan_p2p(device_ops, rank());
      peers = peers_of(plan);
      call.emplace(handle_->device);
      enqueue_plan(*handle_, plan, nullptr, nullptr, 1, ncclUint8, call->comm, "send_recv",
                   device_ops);
    }
    return std::make_unique<NcclBatch>(handle_, std::move(host_batch), std::move(call),
                                       std::move(peers));
  }

  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    if (on_host(send) || on_host(recv)) return bootstrap_->all_reduce(send, recv, count, dtype, op);
    run("all_reduce", [&](const Stream& stream) {
      handle_->check(ncclAllReduce(send, recv, count, nccl_type(dtype), nccl_op(op, dtype),
                                   handle_->comm, cuda_stream(stream)),
                     "all_reduce", "every rank");
      finish_average(recv, count, dtype, op, stream);
    });
  }

  void all_gather_v(const void* send, size_t send_count, void* recv,
                    std::span<const size_t> recv_counts, DType dtype) override {
    check_counts_size("all_gather_v", recv_counts.size());
    if (on_host(send) || on_host(recv))
      return bootstrap_->all_gather_v(send, send_count, recv, recv_counts, dtype);
    run("all_gather_v", [&](const Stream& stream) {
      const size_t element = dtype_size(dtype);
      size_t total = 0, offset = 0;
      for (size_t r = 0; r < recv_counts.size(); ++r) {
        if (static_cast<int>(r) == rank()) offset = total;
        total += recv_counts[r];
      }
      if (send_count == recv_counts[rank()] &&
          nccl_plan::gather_by_all_reduce(size(), static_cast<double>(total * element))) {
        // This rank's block in place, zeros around it, then a u8 sum over the ranks: the
        // gathered bytes exactly, at a tree's latency (nccl_plan::gather_by_all_reduce).
        char* base = static_cast<char*>(recv);
        char* mine = base + offset * element;
        if (mine != send && send_count > 0)
          gpu::copy_bytes_async(mine, send, send_count * element, stream.handle,
                                stream.device.index);
        gpu::zero_bytes_async(base, offset * element, stream.handle, stream.device.index);
        const size_t after = (offset + send_count) * element;
        gpu::zero_bytes_async(base + after, total * element - after, stream.handle,
                              stream.device.index);
        handle_->check(ncclAllReduce(recv, recv, total * element, ncclUint8, ncclSum, handle_->comm,
                                     cuda_stream(stream)),
                       "all_gather_v", "every rank");
        return;
      }
      if (nccl_plan::counts_equal(recv_counts) && recv_counts[rank()] == send_count) {
        handle_->check(ncclAllGather(send, recv, send_count, nccl_type(dtype), handle_->comm,
                                     cuda_stream(stream)),
                       "all_gather_v", "every rank");
        return;
      }
      enqueue_plan(*handle_, nccl_plan::plan_all_gather_v(rank(), send_count, recv_counts), send,
                   recv, dtype_size(dtype), nccl_type(dtype), stream, "all_gather_v");
    });
  }

  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                        DType dtype, ReduceOp op) override {
    check_counts_size("reduce_scatter_v", recv_counts.size());
    if (on_host(send) || on_host(recv))
      return bootstrap_->reduce_scatter_v(send, recv, recv_counts, dtype, op);
    const size_t count = recv_counts[rank()];
    run("reduce_scatter_v", [&](const Stream& stream) {
      if (nccl_plan::counts_equal(recv_counts)) {
        handle_->check(ncclReduceScatter(send, recv, count, nccl_type(dtype), nccl_op(op, dtype),
                                         handle_->comm, cuda_stream(stream)),
                       "reduce_scatter_v", "every rank");
        finish_average(recv, count, dtype, op, stream);
        return;
      }
      // Uneven blocks: every rank's copy of this rank's block lands in slot r of a scratch
      // buffer, then the slots are reduced in rank order (the same result on any arrival order).
      const size_t element = dtype_size(dtype);
      comm_device::DeviceScratch slots(count * element * size(), handle_->device, stream,
                                       "reduce_scatter_v");
      enqueue_plan(*handle_, nccl_plan::plan_reduce_scatter_v(rank(), recv_counts), send,
                   slots.data(), element, nccl_type(dtype), stream, "reduce_scatter_v");
      if (count == 0) return;
      gpu::copy_bytes_async(recv, slots.data(), count * element, stream.handle,
                            stream.device.index);
      const int64_t shape[1] = {static_cast<int64_t>(count)};
      const int64_t strides[1] = {1};
      DeviceBackend& backend = backend_for(Device::cuda(handle_->device));
      for (int r = 1; r < size(); ++r)
        backend.accumulate(
            {recv, shape, strides, 1},
            {static_cast<char*>(slots.data()) + r * count * element, shape, strides, 1}, dtype, op,
            stream);
      if (op == ReduceOp::avg)
        backend.scale({recv, shape, strides, 1}, dtype, 1.0 / size(), stream);
    });
  }

  void all_to_all_v(const void* send, std::span<const size_t> send_counts,
                    std::span<const size_t> send_displs, void* recv,
                    std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                    DType dtype) override {
    for (size_t given :
         {send_counts.size(), send_displs.size(), recv_counts.size(), recv_displs.size()})
      check_counts_size("all_to_all_v", given);
    if (on_host(send) || on_host(recv))
      return bootstrap_->all_to_all_v(send, send_counts, send_displs, recv, recv_counts,
                                      recv_displs, dtype);
    run("all_to_all_v", [&](const Stream& stream) {
      enqueue_plan(
          *handle_,
          nccl_plan::plan_all_to_all_v(rank(), send_counts, send_displs, recv_counts, recv_displs),
          send, recv, dtype_size(dtype), nccl_type(dtype), stream, "all_to_all_v");
    });
  }

  void all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                    void* recv_base, std::span<const StridedBlock> recv_blocks,
                    DType dtype) override {
    if (on_host(send_base) || on_host(recv_base))
      return bootstrap_->all_to_all_w(send_base, send_blocks, recv_base, recv_blocks, dtype);
    check_counts_size("all_to_all_w", send_blocks.size());
    check_counts_size("all_to_all_w", recv_blocks.size());
    comm_device::all_to_all_w_on_device(*this, handle_->device, send_base, send_blocks, recv_base,
                                        recv_blocks, dtype);
  }

  void broadcast(void* buffer, size_t count, DType dtype, int root) override {
    check_arg(root >= 0 && root < size(), current_comm_op(), "broadcast: root {} outside size {}",
              root, size());
    if (on_host(buffer)) return bootstrap_->broadcast(buffer, count, dtype, root);
    run("broadcast", [&](const Stream& stream) {
      handle_->check(ncclBroadcast(buffer, buffer, count, nccl_type(dtype), root, handle_->comm,
                                   cuda_stream(stream)),
                     "broadcast", fmt::format("root {}", root));
    });
  }

  void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                 size_t recv_count, DType dtype, int root) override {
    check_arg(root >= 0 && root < size(), current_comm_op(), "scatter_v: root {} outside size {}",
              root, size());
    if (on_host(recv) || (rank() == root && on_host(send)))
      return bootstrap_->scatter_v(send, send_counts, recv, recv_count, dtype, root);
    if (rank() == root) check_counts_size("scatter_v", send_counts.size());
    run("scatter_v", [&](const Stream& stream) {
      enqueue_plan(*handle_,
                   nccl_plan::plan_scatter_v(rank(), size(), send_counts, recv_count, root), send,
                   recv, dtype_size(dtype), nccl_type(dtype), stream, "scatter_v");
    });
  }

  void gather_v(const void* send, size_t send_count, void* recv,
                std::span<const size_t> recv_counts, DType dtype, int root) override {
    check_arg(root >= 0 && root < size(), current_comm_op(), "gather_v: root {} outside size {}",
              root, size());
    if (on_host(send) || (rank() == root && on_host(recv)))
      return bootstrap_->gather_v(send, send_count, recv, recv_counts, dtype, root);
    if (rank() == root) check_counts_size("gather_v", recv_counts.size());
    run("gather_v", [&](const Stream& stream) {
      enqueue_plan(*handle_,
                   nccl_plan::plan_gather_v(rank(), size(), send_count, recv_counts, root), send,
                   recv, dtype_size(dtype), nccl_type(dtype), stream, "gather_v");
    });
  }

  void barrier() override { bootstrap_->barrier(); }

  std::shared_ptr<Comm> split(int color, int key) override {
    handle_->check_alive("split");
    std::shared_ptr<Comm> child_bootstrap = bootstrap_->split(color, key);
    gpu::set_device(handle_->device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    auto child = std::make_shared<NcclHandle>();
    child->device = handle_->device;
    // Non-blocking: the split runs as a job of the parent, and NCCL writes the child's handle
    // only when that job is done (it stays null until then), so the wait polls the parent.
    const ncclResult_t result = ncclCommSplit(handle_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color,
                                              key, &child->comm, &config);
    handle_->check(result, "split", "every rank");
    if (color < 0) return nullptr;
    child->rank = child_bootstrap->rank();
    child->size = child_bootstrap->size();
    // NCCL's job stores the handle (atomically) as its last step.
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(comm_timeout());
    for (uint64_t spin = 0; !__atomic_load_n(&child->comm, __ATOMIC_ACQUIRE); ++spin) {
      if (Clock::now() >= deadline)
        throw handle_->abort_with(
            CommTimeout(current_comm_op(), timeout_message("split", handle_->rank, handle_->size,
                                                           "every rank of the new communicator")));
      pause(spin);
    }
    child->check(ncclInProgress, "split", "every rank of the new communicator");
    return std::make_shared<NcclComm>(std::move(child_bootstrap), std::move(child));
  }

 private:
  static cudaStream_t cuda_stream(const Stream& stream) {
    return static_cast<cudaStream_t>(stream.handle);
  }

  /// Runs `enqueue` on the comm stream (after the compute stream's work) and waits for it.
  template <typename Enqueue>
  void run(const char* name, Enqueue&& enqueue) {
    handle_->check_alive(name);
    DeviceCall call(handle_->device);
    enqueue(call.comm);
    call.finish(*handle_, name, "the other ranks of the communicator");
  }

  /// Integer avg: NCCL summed, divide here (floating avg is ncclAvg already).
  void finish_average(void* data, size_t count, DType dtype, ReduceOp op, const Stream& stream) {
    if (op != ReduceOp::avg || is_floating(dtype) || count == 0) return;
    const int64_t shape[1] = {static_cast<int64_t>(count)};
    const int64_t strides[1] = {1};
    backend_for(Device::cuda(handle_->device))
        .scale({data, shape, strides, 1}, dtype, 1.0 / size(), stream);
  }

  void check_counts_size(const char* name, size_t given) const {
    check_arg(given == static_cast<size_t>(size()), current_comm_op(),
              "{}: {} counts given for a communicator of size {}", name, given, size());
  }

  std::shared_ptr<Comm> bootstrap_;
  std::shared_ptr<NcclHandle> handle_;
};

}  // namespace

bool nccl_compiled() {
  return true;
}

std::shared_ptr<Comm> make_nccl_comm(std::shared_ptr<Comm> bootstrap) {
  const Device device = current_rank_context().device();
  TESSERA_CHECK_ARG(device.is_cuda(), "nccl",
                    "the nccl backend needs a CUDA device per rank, but rank {} runs on {}: set "
                    "TESSERA_DEVICE=cuda",
                    bootstrap->rank(), device.str());
  ncclUniqueId id{};
  if (bootstrap->rank() == 0 && ncclGetUniqueId(&id) != ncclSuccess)
    throw CommError("nccl", "ncclGetUniqueId failed on rank 0");
  bootstrap->broadcast(&id, sizeof(id), DType::u8, 0);
  gpu::set_device(device.index);
  auto handle = std::make_shared<NcclHandle>();
  handle->device = device.index;
  handle->rank = bootstrap->rank();
  handle->size = bootstrap->size();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t result =
      ncclCommInitRankConfig(&handle->comm, handle->size, id, handle->rank, &config);
  try {
    handle->check(result, "init", "every rank");
  } catch (const CommError& error) {
    throw CommError("nccl",
                    fmt::format("{} (rank {} on {}; NCCL needs a distinct GPU for every rank of a "
                                "communicator: local ranks sharing a GPU work with the local "
                                "backend)",
                                error.what(), handle->rank, device.str()));
  }
  return std::make_shared<NcclComm>(std::move(bootstrap), std::move(handle));
}

}  // namespace tessera
