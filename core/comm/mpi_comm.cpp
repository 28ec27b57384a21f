// The mpi backend: every operation is posted non-blocking (MPI-3 collectives) and completed
// by a polling wait that enforces TESSERA_COMM_TIMEOUT. f16/bf16 move as 16-bit words and
// reduce through user-defined MPI_Ops that compute in float. all_to_all_w keeps Comm's pack +
// all_to_all_v + unpack: with MPICH 4.0, MPI_Ialltoallw over derived (hvector) datatypes
// measured 1.1-1.6x slower than that on the `bench comm` S(0)->S(1) boxes.
#include "core/comm/mpi_comm.hpp"

#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;

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
  MpiBatch(MPI_Comm comm, int rank, int size, std::span<const P2POp> ops)
      : rank_(rank), size_(size) {
    for (const P2POp& op : ops) {
      check_arg(op.peer >= 0 && op.peer < size, current_comm_op(),
                "send/recv peer {} outside a communicator of size {}", op.peer, size);
      MPI_Request request;
      const int bytes = to_int(op.bytes, "send_recv");
      if (op.kind == P2POp::Kind::send)
        MPI_Isend(op.buffer, bytes, MPI_BYTE, op.peer, op.tag, comm, &request);
      else
        MPI_Irecv(op.buffer, bytes, MPI_BYTE, op.peer, op.tag, comm, &request);
      requests_.push_back(request);
      ops_.push_back(op);
    }
  }

  void wait() override {
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

 private:
  int rank_, size_;
  std::vector<MPI_Request> requests_;
  std::vector<P2POp> ops_;
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
    return std::make_unique<MpiBatch>(comm_, rank_, size_, ops);
  }

  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    MPI_Request request;
    MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, to_int(count, "all_reduce"),
                   mpi_type(dtype), mpi_op(op, dtype), comm_, &request);
    wait_one(request, "all_reduce");
    if (op == ReduceOp::avg) divide_by(recv, count, dtype, size_);
  }

  void all_gather_v(const void* send, size_t send_count, void* recv,
                    std::span<const size_t> recv_counts, DType dtype) override {
    check_counts_size("all_gather_v", recv_counts);
    const std::vector<int> counts = to_ints(recv_counts, "all_gather_v");
    const std::vector<int> displs = int_displacements(recv_counts, "all_gather_v");
    MPI_Request request;
    MPI_Iallgatherv(send, to_int(send_count, "all_gather_v"), mpi_type(dtype), recv, counts.data(),
                    displs.data(), mpi_type(dtype), comm_, &request);
    wait_one(request, "all_gather_v");
  }

  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                        DType dtype, ReduceOp op) override {
    check_counts_size("reduce_scatter_v", recv_counts);
    const std::vector<int> counts = to_ints(recv_counts, "reduce_scatter_v");
    MPI_Request request;
    MPI_Ireduce_scatter(send, recv, counts.data(), mpi_type(dtype), mpi_op(op, dtype), comm_,
                        &request);
    wait_one(request, "reduce_scatter_v");
    if (op == ReduceOp::avg) divide_by(recv, recv_counts[rank_], dtype, size_);
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
    MPI_Request request;
    MPI_Ialltoallv(send, scounts.data(), sdispls.data(), mpi_type(dtype), recv, rcounts.data(),
                   rdispls.data(), mpi_type(dtype), comm_, &request);
    wait_one(request, "all_to_all_v");
  }

  void broadcast(void* buffer, size_t count, DType dtype, int root) override {
    MPI_Request request;
    MPI_Ibcast(buffer, to_int(count, "broadcast"), mpi_type(dtype), root, comm_, &request);
    wait_one(request, "broadcast");
  }

  void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                 size_t recv_count, DType dtype, int root) override {
    std::vector<int> counts, displs;
    if (rank_ == root) {
      check_counts_size("scatter_v", send_counts);
      counts = to_ints(send_counts, "scatter_v");
      displs = int_displacements(send_counts, "scatter_v");
    }
    MPI_Request request;
    MPI_Iscatterv(send, counts.data(), displs.data(), mpi_type(dtype), recv,
                  to_int(recv_count, "scatter_v"), mpi_type(dtype), root, comm_, &request);
    wait_one(request, "scatter_v");
  }

  void gather_v(const void* send, size_t send_count, void* recv,
                std::span<const size_t> recv_counts, DType dtype, int root) override {
    std::vector<int> counts, displs;
    if (rank_ == root) {
      check_counts_size("gather_v", recv_counts);
      counts = to_ints(recv_counts, "gather_v");
      displs = int_displacements(recv_counts, "gather_v");
    }
    MPI_Request request;
    MPI_Igatherv(send, to_int(send_count, "gather_v"), mpi_type(dtype), recv, counts.data(),
                 displs.data(), mpi_type(dtype), root, comm_, &request);
    wait_one(request, "gather_v");
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
  void wait_one(MPI_Request& request, const char* name) {
    std::vector<MPI_Request> requests{request};
    wait_requests(requests, name, rank_, size_, [] {
      return std::string(
          "the other ranks of the communicator (MPI does not say which has not "
          "joined)");
    });
  }
  void check_counts_size(const char* name, std::span<const size_t> counts) const {
    check_arg(counts.size() == static_cast<size_t>(size_), current_comm_op(),
              "{}: {} counts given for a communicator of size {}", name, counts.size(), size_);
  }
  static std::vector<int> int_displacements(std::span<const size_t> counts, const char* name) {
    std::vector<size_t> displs = displacements_of(counts);
    return to_ints(displs, name);
  }

  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
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
  const auto* mpi = dynamic_cast<const MpiComm*>(&comm);
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

}  // namespace tessera
