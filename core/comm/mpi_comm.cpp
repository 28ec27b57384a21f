// The mpi backend: every operation is posted non-blocking (MPI-3 collectives) and completed
// by a polling wait that enforces TESSERA_COMM_TIMEOUT. f16/bf16 move as 16-bit words and
// reduce through user-defined MPI_Ops that compute in float. all_to_all_w keeps Comm's pack +
// all_to_all_v + unpack (dense blocks move in place): with MPICH 4.0, MPI_Ialltoallw over
// derived (hvector) datatypes measured 1.1-1.6x slower than that on the `bench comm` S(0)->S(1)
// boxes.
//
// Device buffers: with a CUDA-aware MPI (mpi_cuda_aware()) MPI gets the device pointers once
// the compute stream's work is done; otherwise every device buffer is staged through pinned host
// blocks of a per-communicator pool (copies on the comm stream, counted with count_transfer) and
// reductions of staged data run on the host as for host buffers. f16/bf16 reductions, whose
// MPI_Ops run on the host, are always staged.
#include "core/comm/mpi_comm.hpp"

#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "core/backend/backend.hpp"
#include "core/backend/transfer.hpp"
#include "core/comm/comm_device.hpp"
#include "core/comm/mpi_staging.hpp"

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;
using comm_device::buffer_device;

/// The device of a call's buffers (-1: host): the first of `pointers` that is device memory.
int device_of(std::initializer_list<const void*> pointers) {
  for (const void* pointer : pointers)
    if (const int device = buffer_device(pointer); device >= 0) return device;
  return -1;
}

/// What MPI reads and writes for one call's buffers on cuda:`device` (or on the host, device -1:
/// then the buffers themselves). Direct (CUDA-aware MPI): the device pointers, once the compute
/// stream's work is done. Staged: pinned host blocks of `pool`, filled from the device before MPI
/// runs (input) and copied back after (output), on the comm stream.
class Staging {
 public:
  Staging(const std::shared_ptr<StagingPool>& pool, int device, bool direct)
      : pool_(pool), device_(device), direct_(direct || device < 0) {
    if (device_ < 0) return;
    compute_ = comm_device::compute_stream_of(device_);
    comm_ = comm_device::comm_stream_for(device_);
    if (direct_) {
      // MPI reads and writes device memory outside stream order.
      synchronize(compute_);
    } else {
      order_after(comm_, compute_);
    }
  }

  /// The pointer MPI reads `bytes` of input from.
  const void* input(const void* data, size_t bytes) {
    if (direct_ || bytes == 0) return data;
    StagingPool::Lease lease = pool_->acquire(bytes);
    gpu::copy_bytes_async(lease.data(), data, bytes, comm_.handle, device_);
    count_transfer(Device::cpu(), Device::cuda(device_), bytes);
    staged_.push_back({const_cast<void*>(data), bytes, false, std::move(lease), {}});
    pending_input_ = true;
    return staged_.back().lease.data();
  }

  /// The pointer MPI writes `bytes` of output to (in place: the host copy of the same input).
  /// `written`, when given, are the only bytes MPI writes (the blocks of a v collective): just
  /// these go back to the device, and the gaps between them keep what the device held.
  void* output(void* data, size_t bytes, std::vector<ByteRange> written = {}) {
    if (direct_ || bytes == 0) return data;
    for (Staged& staged : staged_) {
      if (staged.data == data && staged.bytes >= bytes) {
        staged.is_output = true;  // the host copy holds the whole input: copied back whole
        return staged.lease.data();
      }
    }
    staged_.push_back({data, bytes, true, pool_->acquire(bytes), std::move(written)});
    return staged_.back().lease.data();
  }

  /// Call after input()/output() and before MPI: the host copies of the inputs are complete.
  void before_mpi() {
    if (pending_input_) synchronize(comm_);
    pending_input_ = false;
  }

  /// Call after MPI completed: outputs copied back to the device; the compute stream is ordered
  /// after them.
  void after_mpi() {
    if (direct_) return;
    bool copied = false;
    for (Staged& staged : staged_) {
      if (!staged.is_output) continue;
      const std::vector<ByteRange> whole{{0, staged.bytes}};
      for (const ByteRange& range : staged.written.empty() ? whole : staged.written) {
        gpu::copy_bytes_async(static_cast<std::byte*>(staged.data) + range.offset,
                              static_cast<const std::byte*>(staged.lease.data()) + range.offset,
                              range.bytes, comm_.handle, device_);
        count_transfer(Device::cuda(device_), Device::cpu(), range.bytes);
      }
      copied = true;
    }
    // The pinned blocks go back to the pool with this object: the copies must be done first.
    if (copied) synchronize(comm_);
    order_after(compute_, comm_);
  }

  bool staged() const { return !direct_; }
  int device() const { return device_; }

 private:
  struct Staged {
    void* data;
    size_t bytes;
    bool is_output;
    StagingPool::Lease lease;
    std::vector<ByteRange> written;  // the bytes copied back (empty: all of them)
  };
  std::shared_ptr<StagingPool> pool_;
  int device_;
  bool direct_;
  bool pending_input_ = false;
  Stream compute_, comm_;
  std::vector<Staged> staged_;
};

/// Largest end (displacement + count) of rank-blocked counts: the extent of a v buffer.
size_t extent_of(std::span<const size_t> counts, std::span<const size_t> displs) {
  size_t end = 0;
  for (size_t i = 0; i < counts.size() && i < displs.size(); ++i)
    if (counts[i]) end = std::max(end, displs[i] + counts[i]);
  return end;
}

MPI_Datatype half_type = MPI_DATATYPE_NULL;
MPI_Datatype bfloat16_type = MPI_DATATYPE_NULL;
MPI_Op half_ops[5] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};

template <ReduceOp op>
void reduce_half_types(void* in, void* inout, int* length, MPI_Datatype* type) {
  const DType dtype = *type == half_type ? DType::f16 : DType::bf16;
  reduce_into(inout, in, static_cast<size_t>(*length), dtype, op);
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (MPI_Op& op : half_ops)
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  if (half_type != MPI_DATATYPE_NULL) MPI_Type_free(&half_type);
  if (bfloat16_type != MPI_DATATYPE_NULL) MPI_Type_free(&bfloat16_type);
  MPI_Finalize();
}

void ensure_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
      std::atexit(finalize_at_exit);
    }
    MPI_Type_contiguous(1, MPI_UINT16_T, &half_type);
    MPI_Type_commit(&half_type);
    MPI_Type_contiguous(1, MPI_UINT16_T, &bfloat16_type);
    MPI_Type_commit(&bfloat16_type);
    MPI_Op_create(reduce_half_types<ReduceOp::sum>, 1, &half_ops[int(ReduceOp::sum)]);
    MPI_Op_create(reduce_half_types<ReduceOp::avg>, 1, &half_ops[int(ReduceOp::avg)]);
    MPI_Op_create(reduce_half_types<ReduceOp::max>, 1, &half_ops[int(ReduceOp::max)]);
    MPI_Op_create(reduce_half_types<ReduceOp::min>, 1, &half_ops[int(ReduceOp::min)]);
    MPI_Op_create(reduce_half_types<ReduceOp::prod>, 1, &half_ops[int(ReduceOp::prod)]);
  });
}

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::f16: return half_type;
    case DType::bf16: return bfloat16_type;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op, DType dtype) {
  if (dtype == DType::f16 || dtype == DType::bf16) return half_ops[static_cast<int>(op)];
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::prod: return MPI_PROD;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

int to_int(size_t count, const char* name) {
  if (count > static_cast<size_t>(INT_MAX))
    throw InvalidArgument(current_comm_op(),
                          fmt::format("{}: a count of {} exceeds MPI's int limit; split the "
                                      "tensor over more ranks or use a wider dtype",
                                      name, count));
  return static_cast<int>(count);
}

std::vector<int> to_ints(std::span<const size_t> counts, const char* name) {
  std::vector<int> result(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) result[i] = to_int(counts[i], name);
  return result;
}

/// Polls `requests` until all complete; past the timeout raises CommTimeout naming `peers`.
void wait_requests(std::vector<MPI_Request>& requests, const char* name, int rank, int size,
                   const std::function<std::string()>& peers) {
  if (requests.empty()) return;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(comm_timeout());
  for (uint64_t spin = 0;; ++spin) {
    int done = 0;
    MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    if (done) return;
    if ((spin & 1023) == 1023) {
      if (Clock::now() >= deadline)
        throw CommTimeout(current_comm_op(), timeout_message(name, rank, size, peers()));
      std::this_thread::yield();
    }
  }
}

class MpiBatch final : public P2PBatch {
 public:
  MpiBatch(MPI_Comm comm, int rank, int size, std::span<const P2POp> ops,
           const std::shared_ptr<StagingPool>& pool, bool cuda_aware)
      : rank_(rank), size_(size) {
    // Device buffers of the batch (one device per batch, as for every call) are staged first,
    // so every send's host copy is complete before any message is posted.
    std::vector<void*> buffers;
    for (const P2POp& op : ops) {
      check_arg(op.peer >= 0 && op.peer < size, current_comm_op(),
                "send/recv peer {} outside a communicator of size {}", op.peer, size);
      const int device = op.bytes ? buffer_device(op.buffer) : -1;
      if (device >= 0 && !staging_) staging_.emplace(pool, device, cuda_aware);
      if (device < 0 || !staging_ || staging_->device() != device)
        buffers.push_back(op.buffer);
      else if (op.kind == P2POp::Kind::send)
        buffers.push_back(const_cast<void*>(staging_->input(op.buffer, op.bytes)));
      else
        buffers.push_back(staging_->output(op.buffer, op.bytes));
    }
    if (staging_) staging_->before_mpi();
    for (size_t i = 0; i < ops.size(); ++i) {
      const P2POp& op = ops[i];
      MPI_Request request;
      const int bytes = to_int(op.bytes, "send_recv");
      if (op.kind == P2POp::Kind::send)
        MPI_Isend(buffers[i], bytes, MPI_BYTE, op.peer, op.tag, comm, &request);
      else
        MPI_Irecv(buffers[i], bytes, MPI_BYTE, op.peer, op.tag, comm, &request);
      requests_.push_back(request);
      ops_.push_back(op);
    }
  }

  void wait() override {
    wait_for_requests();
    if (staging_) staging_->after_mpi();
    staging_.reset();
  }

 private:
  void wait_for_requests() {
    wait_requests(requests_, "send_recv", rank_, size_, [this] {
      std::vector<std::string> pending;
      for (size_t i = 0; i < ops_.size(); ++i) {
        if (requests_[i] == MPI_REQUEST_NULL) continue;
        pending.push_back(fmt::format("{} rank {}",
                                      ops_[i].kind == P2POp::Kind::send ? "send to" : "recv from",
                                      ops_[i].peer));
      }
      return fmt::format("{}", fmt::join(pending, ", "));
    });
  }

  int rank_, size_;
  std::vector<MPI_Request> requests_;
  std::vector<P2POp> ops_;
  std::optional<Staging> staging_;
};

/// An MPI_Iallreduce or MPI_Iallgatherv in flight; MPI progresses it whenever this rank is in
/// MPI (halo waits of the ops computed meanwhile included). Keeps the count arrays a vector
/// collective reads until it completes.
class MpiPendingCollective final : public PendingCollective {
 public:
  MpiPendingCollective(MPI_Request request, const char* name, int rank, int size)
      : request_(request), name_(name), rank_(rank), size_(size) {}
  MpiPendingCollective(const char* name, int rank, int size, std::vector<int> counts,
                       std::vector<int> displs)
      : request_(MPI_REQUEST_NULL),
        name_(name),
        rank_(rank),
        size_(size),
        counts_(std::move(counts)),
        displs_(std::move(displs)) {}
  /// The request of a collective started with counts() and displs() (owned by this object).
  MPI_Request* request() { return &request_; }
  const int* counts() const { return counts_.data(); }
  const int* displs() const { return displs_.data(); }
  ~MpiPendingCollective() override {
    if (request_ == MPI_REQUEST_NULL) return;
    try {
      wait();
    } catch (...) {  // MPI must not be left writing into freed buffers; the error is lost
    }
  }
  void wait() override {
    std::vector<MPI_Request> requests{request_};
    request_ = MPI_REQUEST_NULL;
    wait_requests(requests, name_, rank_, size_, [] {
      return std::string(
          "the other ranks of the communicator (MPI does not say which has not "
          "joined)");
    });
  }

 private:
  MPI_Request request_;
  const char* name_;
  int rank_, size_;
  std::vector<int> counts_, displs_;
};

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  MPI_Comm handle() const { return comm_; }

  std::unique_ptr<P2PBatch> start_send_recv(std::span<const P2POp> ops) override {
    return std::make_unique<MpiBatch>(comm_, rank_, size_, ops, pool(), mpi_cuda_aware());
  }

  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    const size_t bytes = count * dtype_size(dtype);
    Staging staging = stage(device_of({send, recv}), reduction_direct(dtype));
    const void* mpi_send = staging.input(send, bytes);
    void* mpi_recv = staging.output(recv, bytes);
    staging.before_mpi();
    MPI_Request request;
    MPI_Iallreduce(send == recv ? MPI_IN_PLACE : mpi_send, mpi_recv, to_int(count, "all_reduce"),
                   mpi_type(dtype), mpi_op(op, dtype), comm_, &request);
    wait_one(request, "all_reduce");
    if (op == ReduceOp::avg) average(staging, mpi_recv, count, dtype);
    staging.after_mpi();
  }

  std::unique_ptr<PendingCollective> start_all_reduce(const void* send, void* recv, size_t count,
                                                      DType dtype, ReduceOp op) override {
    // Staged device buffers and avg (a division after the sum) complete before returning.
    if (op == ReduceOp::avg || device_of({send, recv}) >= 0)
      return Comm::start_all_reduce(send, recv, count, dtype, op);
    MPI_Request request;
    MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, to_int(count, "all_reduce"),
                   mpi_type(dtype), mpi_op(op, dtype), comm_, &request);
    return std::make_unique<MpiPendingCollective>(request, "all_reduce", rank_, size_);
  }

  std::unique_ptr<PendingCollective> start_all_gather_v(const void* send, size_t send_count,
                                                        void* recv,
                                                        std::span<const size_t> recv_counts,
                                                        DType dtype) override {
    // Staged device buffers complete before returning.
    if (device_of({send, recv}) >= 0)
      return Comm::start_all_gather_v(send, send_count, recv, recv_counts, dtype);
    check_counts_size("all_gather_v", recv_counts);
    auto pending = std::make_unique<MpiPendingCollective>(
        "all_gather_v", rank_, size_, to_ints(recv_counts, "all_gather_v"),
        int_displacements(recv_counts, "all_gather_v"));
    MPI_Iallgatherv(send, to_int(send_count, "all_gather_v"), mpi_type(dtype), recv,
                    pending->counts(), pending->displs(), mpi_type(dtype), comm_,
                    pending->request());
    return pending;
  }

  void all_gather_v(const void* send, size_t send_count, void* recv,
                    std::span<const size_t> recv_counts, DType dtype) override {
    check_counts_size("all_gather_v", recv_counts);
    const std::vector<int> counts = to_ints(recv_counts, "all_gather_v");
    const std::vector<int> displs = int_displacements(recv_counts, "all_gather_v");
    const size_t element = dtype_size(dtype);
    Staging staging = stage(device_of({send, recv}));
    const void* mpi_send = staging.input(send, send_count * element);
    void* mpi_recv =
        staging.output(recv, (displacements_of(recv_counts).back() + recv_counts.back()) * element);
    staging.before_mpi();
    MPI_Request request;
    MPI_Iallgatherv(mpi_send, to_int(send_count, "all_gather_v"), mpi_type(dtype), mpi_recv,
                    counts.data(), displs.data(), mpi_type(dtype), comm_, &request);
    wait_one(request, "all_gather_v");
    staging.after_mpi();
  }

  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                        DType dtype, ReduceOp op) override {
    check_counts_size("reduce_scatter_v", recv_counts);
    const std::vector<int> counts = to_ints(recv_counts, "reduce_scatter_v");
    const size_t element = dtype_size(dtype);
    Staging staging = stage(device_of({send, recv}), reduction_direct(dtype));
    const void* mpi_send =
        staging.input(send, (displacements_of(recv_counts).back() + recv_counts.back()) * element);
    void* mpi_recv = staging.output(recv, recv_counts[rank_] * element);
    staging.before_mpi();
    MPI_Request request;
    MPI_Ireduce_scatter(mpi_send, mpi_recv, counts.data(), mpi_type(dtype), mpi_op(op, dtype),
                        comm_, &request);
    wait_one(request, "reduce_scatter_v");
    if (op == ReduceOp::avg) average(staging, mpi_recv, recv_counts[rank_], dtype);
    staging.after_mpi();
  }

  void all_to_all_v(const void* send, std::span<const size_t> send_counts,
                    std::span<const size_t> send_displs, void* recv,
                    std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                    DType dtype) override {
    for (auto counts : {send_counts, send_displs, recv_counts, recv_displs})
      check_counts_size("all_to_all_v", counts);
    const auto scounts = to_ints(send_counts, "all_to_all_v");
    const auto sdispls = to_ints(send_displs, "all_to_all_v");
    const auto rcounts = to_ints(recv_counts, "all_to_all_v");
    const auto rdispls = to_ints(recv_displs, "all_to_all_v");
    const size_t element = dtype_size(dtype);
    Staging staging = stage(device_of({send, recv}));
    const void* mpi_send = staging.input(send, extent_of(send_counts, send_displs) * element);
    void* mpi_recv = staging.output(recv, extent_of(recv_counts, recv_displs) * element,
                                    written_ranges(recv_counts, recv_displs, element));
    staging.before_mpi();
    MPI_Request request;
    MPI_Ialltoallv(mpi_send, scounts.data(), sdispls.data(), mpi_type(dtype), mpi_recv,
                   rcounts.data(), rdispls.data(), mpi_type(dtype), comm_, &request);
    wait_one(request, "all_to_all_v");
    staging.after_mpi();
  }

  void all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                    void* recv_base, std::span<const StridedBlock> recv_blocks,
                    DType dtype) override {
    const int device = device_of({send_base, recv_base});
    if (device < 0)
      return Comm::all_to_all_w(send_base, send_blocks, recv_base, recv_blocks, dtype);
    check_counts_size("all_to_all_w", send_blocks.size());
    check_counts_size("all_to_all_w", recv_blocks.size());
    comm_device::all_to_all_w_on_device(*this, device, send_base, send_blocks, recv_base,
                                        recv_blocks, dtype);
  }

  void broadcast(void* buffer, size_t count, DType dtype, int root) override {
    const size_t bytes = count * dtype_size(dtype);
    Staging staging = stage(device_of({buffer}));
    void* mpi_buffer = rank_ == root ? const_cast<void*>(staging.input(buffer, bytes))
                                     : staging.output(buffer, bytes);
    staging.before_mpi();
    MPI_Request request;
    MPI_Ibcast(mpi_buffer, to_int(count, "broadcast"), mpi_type(dtype), root, comm_, &request);
    wait_one(request, "broadcast");
    staging.after_mpi();
  }

  void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                 size_t recv_count, DType dtype, int root) override {
    std::vector<int> counts, displs;
    const size_t element = dtype_size(dtype);
    Staging staging = stage(device_of({recv, rank_ == root ? send : nullptr}));
    const void* mpi_send = send;
    if (rank_ == root) {
      check_counts_size("scatter_v", send_counts);
      counts = to_ints(send_counts, "scatter_v");
      displs = int_displacements(send_counts, "scatter_v");
      mpi_send = staging.input(
          send, (displacements_of(send_counts).back() + send_counts.back()) * element);
    }
    void* mpi_recv = staging.output(recv, recv_count * element);
    staging.before_mpi();
    MPI_Request request;
    MPI_Iscatterv(mpi_send, counts.data(), displs.data(), mpi_type(dtype), mpi_recv,
                  to_int(recv_count, "scatter_v"), mpi_type(dtype), root, comm_, &request);
    wait_one(request, "scatter_v");
    staging.after_mpi();
  }

  void gather_v(const void* send, size_t send_count, void* recv,
                std::span<const size_t> recv_counts, DType dtype, int root) override {
    std::vector<int> counts, displs;
    const size_t element = dtype_size(dtype);
    Staging staging = stage(device_of({send, rank_ == root ? recv : nullptr}));
    const void* mpi_send = staging.input(send, send_count * element);
    void* mpi_recv = recv;
    if (rank_ == root) {
      check_counts_size("gather_v", recv_counts);
      counts = to_ints(recv_counts, "gather_v");
      displs = int_displacements(recv_counts, "gather_v");
      mpi_recv = staging.output(
          recv, (displacements_of(recv_counts).back() + recv_counts.back()) * element);
    }
    staging.before_mpi();
    MPI_Request request;
    MPI_Igatherv(mpi_send, to_int(send_count, "gather_v"), mpi_type(dtype), mpi_recv, counts.data(),
                 displs.data(), mpi_type(dtype), root, comm_, &request);
    wait_one(request, "gather_v");
    staging.after_mpi();
  }

  void barrier() override {
    MPI_Request request;
    MPI_Ibarrier(comm_, &request);
    wait_one(request, "barrier");
  }

  std::shared_ptr<Comm> split(int color, int key) override {
    MPI_Comm child;
    MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child);
    if (child == MPI_COMM_NULL) return nullptr;
    return std::make_shared<MpiComm>(child, true);
  }

 private:
  /// The pinned staging pool of this communicator (created on first use).
  const std::shared_ptr<StagingPool>& pool() {
    if (!pool_) pool_ = std::make_shared<StagingPool>(gpu::allocate_pinned, gpu::release_pinned);
    return pool_;
  }

  /// The staging of one call's buffers on `device` (-1: host, nothing staged); `direct` is
  /// whether device pointers may go to MPI as they are.
  Staging stage(int device, bool direct = mpi_cuda_aware()) {
    return Staging(device < 0 ? nullptr : pool(), device, direct);
  }

  /// Device pointers of a reduction may go to MPI directly when it is CUDA-aware and the op is
  /// MPI's own (the f16/bf16 ops are host functions).
  static bool reduction_direct(DType dtype) {
    return mpi_cuda_aware() && dtype != DType::f16 && dtype != DType::bf16;
  }

  /// Finishes an avg: divides the sum on the host, or on the device when MPI wrote it there.
  void average(const Staging& staging, void* data, size_t count, DType dtype) {
    if (staging.device() < 0 || staging.staged()) {
      divide_by(data, count, dtype, size_);
      return;
    }
    if (count == 0) return;
    const int64_t shape[1] = {static_cast<int64_t>(count)};
    const int64_t strides[1] = {1};
    const Stream stream = comm_device::compute_stream_of(staging.device());
    backend_for(Device::cuda(staging.device()))
        .scale({data, shape, strides, 1}, dtype, 1.0 / size_, stream);
  }

  void wait_one(MPI_Request& request, const char* name) {
    std::vector<MPI_Request> requests{request};
    wait_requests(requests, name, rank_, size_, [] {
      return std::string(
          "the other ranks of the communicator (MPI does not say which has not "
          "joined)");
    });
  }
  void check_counts_size(const char* name, std::span<const size_t> counts) const {
    check_counts_size(name, counts.size());
  }
  void check_counts_size(const char* name, size_t given) const {
    check_arg(given == static_cast<size_t>(size_), current_comm_op(),
              "{}: {} counts given for a communicator of size {}", name, given, size_);
  }
  static std::vector<int> int_displacements(std::span<const size_t> counts, const char* name) {
    std::vector<size_t> displs = displacements_of(counts);
    return to_ints(displs, name);
  }

  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<StagingPool> pool_;
};

}  // namespace

bool mpi_compiled() {
  return true;
}

std::shared_ptr<Comm> mpi_world() {
  ensure_initialized();
  static std::shared_ptr<Comm> world = std::make_shared<MpiComm>(MPI_COMM_WORLD, false);
  return world;
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string version(text, static_cast<size_t>(length));
  if (auto newline = version.find('\n'); newline != std::string::npos) version.resize(newline);
  return version;
}

void mpi_abort(int code) {
  if (mpi_initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

bool mpi_handle_of(const Comm& comm, void* handle) {
  const auto* mpi = dynamic_cast<const MpiComm*>(&comm.underlying());
  if (mpi == nullptr) return false;
  const MPI_Comm native = mpi->handle();
  std::memcpy(handle, &native, sizeof(MPI_Comm));
  return true;
}

bool mpi_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0;
}

bool mpi_cuda_aware() {
  // Decided once, after MPI_Init (the library's answer is only valid then).
  static const bool aware = [] {
    ensure_initialized();
    return choose_mpi_cuda_aware(std::getenv("TESSERA_MPI_CUDA_AWARE"), mpi_library_cuda_support());
  }();
  return aware;
}

}  // namespace tessera
