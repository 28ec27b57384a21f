// Comm: the one communication interface every layer above uses. Backends are chosen at run
// time: `local` (ranks are threads of one process), `mpi` (MPICH or Open MPI), `nccl` (device
// buffers over NCCL, bootstrapped over one of the others). Counts are in elements of the given
// dtype; every `_v` collective takes per-rank counts, and zero counts are legal everywhere.
//
// Buffers may be host memory or device memory (gpu::pointer_device tells which; all buffers of
// one call live in one memory space). Device buffers follow the ordering rules of
// core/runtime/rank_context.hpp: a call reads its send buffers after the work queued so far on
// the calling rank's compute stream, and when it returns (wait() for batches) the received data
// is ordered before any work queued afterwards on that stream. No call synchronizes the whole
// device. Collectives must be called by every rank of the communicator in the
// same order; a wait longer than TESSERA_COMM_TIMEOUT raises CommTimeout naming the op, this
// rank and the peer(s) it was waiting for.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/layout.hpp"

namespace tessera {

/// One point-to-point transfer of a batch: a send of `bytes` from `buffer` to `peer`, or a
/// receive of exactly `bytes` into `buffer` from `peer`.
struct P2POp {
  enum class Kind : uint8_t { send, recv };
  Kind kind;
  void* buffer;
  size_t bytes;
  int peer;
  int tag = 0;

  static P2POp send(const void* buffer, size_t bytes, int peer, int tag = 0) {
    return {Kind::send, const_cast<void*>(buffer), bytes, peer, tag};
  }
  static P2POp recv(void* buffer, size_t bytes, int peer, int tag = 0) {
    return {Kind::recv, buffer, bytes, peer, tag};
  }
};

/// A strided block of elements inside a buffer: `shape` with `strides` (in elements), starting
/// `offset` elements after the buffer's base pointer. Describes a box of a local tensor
/// without packing it.
struct StridedBlock {
  int64_t offset = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  /// Number of elements.
  size_t count() const;
};

/// An in-flight batch of sends and receives; wait() completes all of them.
class P2PBatch {
 public:
  virtual ~P2PBatch() = default;
  /// Blocks until every transfer of the batch is complete (or the timeout expires).
  virtual void wait() = 0;
};

/// A collective started by start_all_reduce; wait() completes it. Destroying one that was not
/// waited for waits (errors then are dropped: call wait()).
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  /// Blocks until the collective is complete on this rank (or the timeout expires).
  virtual void wait() = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;

  /// This process's (or thread's) rank in the communicator.
  virtual int rank() const = 0;
  /// Number of ranks.
  virtual int size() const = 0;
  /// "local", "mpi" or "nccl".
  virtual std::string backend() const = 0;
  /// The communicator this one forwards to (itself, unless it wraps another, as the trace's
  /// recording communicator does).
  virtual const Comm& underlying() const { return *this; }

  /// Posts every send and receive of `ops` and returns without waiting; buffers must stay
  /// valid until wait(). Messages between a pair of ranks with the same tag arrive in order.
  virtual std::unique_ptr<P2PBatch> start_send_recv(std::span<const P2POp> ops) = 0;
  /// start_send_recv followed by wait.
  void send_recv(std::span<const P2POp> ops) { start_send_recv(ops)->wait(); }

  /// recv[i] = reduce over ranks of send[i]; send == recv is allowed. avg divides the sum.
  virtual void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) = 0;
  /// Starts all_reduce and returns: the reduction proceeds while this rank computes (mpi:
  /// MPI_Iallreduce on host buffers); the other backends run it before returning. Buffers must
  /// stay valid until wait(); every rank starts the same collectives in the same order.
  virtual std::unique_ptr<PendingCollective> start_all_reduce(const void* send, void* recv,
                                                              size_t count, DType dtype,
                                                              ReduceOp op);
  /// Starts all_gather_v and returns: the gather proceeds while this rank computes (mpi:
  /// MPI_Iallgatherv on host buffers); the other backends run it before returning. Buffers must
  /// stay valid until wait() (recv_counts is copied); every rank starts the same collectives in
  /// the same order.
  virtual std::unique_ptr<PendingCollective> start_all_gather_v(const void* send, size_t send_count,
                                                                void* recv,
                                                                std::span<const size_t> recv_counts,
                                                                DType dtype);
  /// Concatenates every rank's `send` (recv_counts[r] elements from rank r) in rank order.
  virtual void all_gather_v(const void* send, size_t send_count, void* recv,
                            std::span<const size_t> recv_counts, DType dtype) = 0;
  /// Reduces the rank-blocked `send` (sum of recv_counts elements) and leaves block r on rank r.
  virtual void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                                DType dtype, ReduceOp op) = 0;
  /// Rank r sends send[send_displs[p], +send_counts[p]) to each p, which stores it at
  /// recv[recv_displs[r], +recv_counts[r]).
  virtual void all_to_all_v(const void* send, std::span<const size_t> send_counts,
                            std::span<const size_t> send_displs, void* recv,
                            std::span<const size_t> recv_counts,
                            std::span<const size_t> recv_displs, DType dtype) = 0;
  /// all_to_all_v over strided blocks: rank r sends send_blocks[p] (relative to send_base) to
  /// each p, which stores it into recv_blocks[r] of its recv_base; paired blocks have the same
  /// shape. The base class packs (dense blocks move in place), calls all_to_all_v and
  /// unpacks; backends override it to move the blocks without staging copies.
  virtual void all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                            void* recv_base, std::span<const StridedBlock> recv_blocks,
                            DType dtype);
  /// Copies root's buffer to every rank.
  virtual void broadcast(void* buffer, size_t count, DType dtype, int root) = 0;
  /// Root sends block r (send_counts[r] elements, rank-blocked) to rank r only.
  virtual void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                         size_t recv_count, DType dtype, int root) = 0;
  /// Root receives every rank's send, rank-blocked (recv_counts[r] from rank r).
  virtual void gather_v(const void* send, size_t send_count, void* recv,
                        std::span<const size_t> recv_counts, DType dtype, int root) = 0;
  /// Returns once every rank has entered it.
  virtual void barrier() = 0;
  /// Collective: ranks with the same `color` form a new communicator ordered by (key, rank);
  /// a negative color returns null for that rank.
  virtual std::shared_ptr<Comm> split(int color, int key) = 0;
};

/// The wait limit of blocking communication: TESSERA_COMM_TIMEOUT in seconds (default 600).
std::chrono::duration<double> comm_timeout();

/// Builds the message of a timeout error: op, rank, peers and the limit.
std::string timeout_message(const std::string& collective, int rank, int size,
                            const std::string& peers);

/// The op that communication errors are tagged with: the innermost CommOpScope on this thread
/// ("comm" when none).
std::string current_comm_op();

/// Tags communication errors raised on this thread while alive with `op` (e.g. "redistribute").
class CommOpScope {
 public:
  explicit CommOpScope(std::string op);
  ~CommOpScope();
  CommOpScope(const CommOpScope&) = delete;
  CommOpScope& operator=(const CommOpScope&) = delete;
};

/// Displacements (prefix sums) of rank-blocked counts: where block r starts.
std::vector<size_t> displacements_of(std::span<const size_t> counts);

/// Applies `op` elementwise: inout[i] = op(inout[i], in[i]) (avg accumulates like sum).
void reduce_into(void* inout, const void* in, size_t count, DType dtype, ReduceOp op);

/// Divides every element by `divisor` (finishes an avg reduction).
void divide_by(void* data, size_t count, DType dtype, int divisor);

}  // namespace tessera
