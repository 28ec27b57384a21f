// Comm with device buffers on a GPU (skipped, with the reason printed, when none is visible):
// every collective of tests/dist/comm_*_test.cpp (all_reduce on every op and dtype, in place,
// all_gather_v, reduce_scatter_v, all_to_all_v, all_to_all_w, broadcast, scatter_v, gather_v,
// batched send/recv with tags and self messages, split) runs once on host buffers and once on
// device copies of the same inputs, and must leave the same bytes:
//  - on the local backend with 1, 2 and 4 ranks sharing one GPU;
//  - on the nccl backend with one rank per visible GPU (at most 4; 1 on a one-GPU machine);
//  - on the mpi backend under mpiexec (ctest tessera_gpu_comm_tests_mpi_2: 2 processes sharing
//    the GPUs; device buffers staged through pinned host memory, or handed to a CUDA-aware MPI);
// and neither the local nor the nccl backend may move a byte between host and device
// (transfer_stats). On the local backend a send buffer overwritten on the sender's compute
// stream right after wait() still reaches its receiver as sent, and an in-place all_reduce whose
// first reader is held back still sums the inputs, with no thread waiting for the device.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/backend/transfer.hpp"
#include "core/comm/launch.hpp"
#include "core/comm/nccl_comm.hpp"
#include "core/comm/nccl_plan.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"
#include "tests/common/scoped_env.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/typed_buffer.hpp"

namespace tessera {
namespace {

using testing::TypedBuffer;

#define SKIP_WITHOUT_GPU()                                                                   \
  if (gpu::device_count() == 0)                                                              \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the device-buffer " \
                  "Comm tests need a GPU"

using testing::ScopedEnv;

size_t byte_size(const TypedBuffer& buffer) {
  return std::max<size_t>(buffer.count() * dtype_size(buffer.dtype()), 1);
}

/// Device memory of the calling rank holding a copy of a host buffer. Its copies run on the
/// rank's compute stream and are not counted as transfers (only Comm's own moves are).
class DeviceCopy {
 public:
  explicit DeviceCopy(const TypedBuffer& host)
      : bytes_(byte_size(host)), device_(current_rank_context().device().index) {
    data_ = gpu::allocate(bytes_, device_);
    const Stream& stream = current_rank_context().compute();
    gpu::copy_bytes_async(data_, host.data(), bytes_, stream.handle, device_);
    synchronize(stream);
  }
  ~DeviceCopy() { gpu::release(data_, device_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;

  void* data() const { return data_; }

  /// The bytes as work queued on the compute stream sees them.
  std::vector<std::byte> read() const {
    std::vector<std::byte> bytes(bytes_);
    const Stream& stream = current_rank_context().compute();
    gpu::copy_bytes_async(bytes.data(), data_, bytes_, stream.handle, device_);
    synchronize(stream);
    return bytes;
  }

 private:
  size_t bytes_;
  int device_;
  void* data_ = nullptr;
};

/// Runs `call` on `buffers` (host) and on device copies of their initial contents, and expects
/// every buffer to end with the same bytes on both.
void expect_device_matches_host(Comm& comm, std::vector<TypedBuffer> buffers,
                                const std::function<void(const std::vector<void*>&)>& call,
                                const std::string& what) {
  std::vector<std::unique_ptr<DeviceCopy>> device;
  std::vector<void*> host_pointers, device_pointers;
  for (TypedBuffer& buffer : buffers) {
    device.push_back(std::make_unique<DeviceCopy>(buffer));
    host_pointers.push_back(buffer.data());
    device_pointers.push_back(device.back()->data());
  }
  call(host_pointers);
  call(device_pointers);
  for (size_t i = 0; i < buffers.size(); ++i) {
    const std::vector<std::byte> on_device = device[i]->read();
    EXPECT_EQ(std::memcmp(on_device.data(), buffers[i].data(), on_device.size()), 0)
        << what << ": buffer " << i << " differs on rank " << comm.rank() << " of " << comm.size()
        << " (" << comm.backend() << ")";
  }
}

/// `count` elements of `dtype` holding `value(i)`.
TypedBuffer filled(DType dtype, size_t count, const std::function<double(size_t)>& value) {
  TypedBuffer buffer(dtype, count);
  for (size_t i = 0; i < count; ++i) buffer.set(i, value(i));
  return buffer;
}

/// A value every dtype holds exactly that names (rank, index).
double tag_value(DType dtype, int rank, size_t i) {
  return static_cast<double>((rank * 37 + static_cast<int64_t>(i) * 11) %
                             std::min<int64_t>(testing::exact_modulus(dtype), 256));
}

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                DType::i32, DType::i64, DType::u8};
constexpr DType reduce_dtypes[] = {DType::f32, DType::f64, DType::i32,
                                   DType::i64, DType::f16, DType::bf16};
constexpr ReduceOp reduce_ops[] = {ReduceOp::sum, ReduceOp::max, ReduceOp::min, ReduceOp::prod,
                                   ReduceOp::avg};

/// Rank `rank`'s element i for `op` over `size` ranks: exact partial results in every dtype.
double contribution(ReduceOp op, int rank, int size, size_t i) {
  if (op == ReduceOp::prod) {
    constexpr double factors[4] = {-2, -1, 1, 2};
    return factors[(rank * 3 + i) % 4];
  }
  const double small = static_cast<double>((rank * 3 + static_cast<int64_t>(i) * 5) % 7 - 3);
  return op == ReduceOp::avg ? small * size : small;
}

/// Counts with zeros: rank r gets (r * 2 + salt) % 3 elements.
std::vector<size_t> uneven_counts(int size, int salt) {
  std::vector<size_t> counts(size);
  for (int r = 0; r < size; ++r) counts[r] = static_cast<size_t>((r * 2 + salt) % 3);
  return counts;
}

size_t total(const std::vector<size_t>& counts) {
  size_t sum = 0;
  for (size_t count : counts) sum += count;
  return sum;
}

/// Every collective of the cpu suites, on host and on device buffers.
void every_collective_on_device(std::shared_ptr<Comm> comm) {
  const int rank = comm->rank(), size = comm->size();
  ASSERT_TRUE(current_rank_context().device().is_cuda());

  for (DType dtype : reduce_dtypes) {
    for (ReduceOp op : reduce_ops) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{33}}) {
        const std::string what =
            fmt::format("all_reduce {} {} count {}", dtype_name(dtype), reduce_op_name(op), count);
        auto send = filled(dtype, count, [&](size_t i) { return contribution(op, rank, size, i); });
        expect_device_matches_host(
            *comm, {send, filled(dtype, count, [](size_t) { return -99; })},
            [&](const std::vector<void*>& p) { comm->all_reduce(p[0], p[1], count, dtype, op); },
            what);
        expect_device_matches_host(
            *comm, {send},
            [&](const std::vector<void*>& p) { comm->all_reduce(p[0], p[0], count, dtype, op); },
            what + " in place");
      }
    }
  }

  for (DType dtype : all_dtypes) {
    const std::string name(dtype_name(dtype));
    const std::vector<size_t> counts = uneven_counts(size, 1);
    expect_device_matches_host(
        *comm,
        {filled(dtype, counts[rank], [&](size_t i) { return tag_value(dtype, rank, i); }),
         TypedBuffer(dtype, total(counts))},
        [&](const std::vector<void*>& p) {
          comm->all_gather_v(p[0], counts[rank], p[1], counts, dtype);
        },
        "all_gather_v " + name);

    for (int root = 0; root < size; ++root) {
      expect_device_matches_host(
          *comm, {filled(dtype, 7, [&](size_t i) { return tag_value(dtype, rank, i); })},
          [&](const std::vector<void*>& p) { comm->broadcast(p[0], 7, dtype, root); },
          fmt::format("broadcast {} root {}", name, root));
      expect_device_matches_host(
          *comm,
          {filled(dtype, total(counts), [&](size_t i) { return tag_value(dtype, rank, i); }),
           TypedBuffer(dtype, counts[rank])},
          [&](const std::vector<void*>& p) {
            comm->scatter_v(p[0], counts, p[1], counts[rank], dtype, root);
          },
          fmt::format("scatter_v {} root {}", name, root));
      expect_device_matches_host(
          *comm,
          {filled(dtype, counts[rank], [&](size_t i) { return tag_value(dtype, rank, i); }),
           TypedBuffer(dtype, total(counts))},
          [&](const std::vector<void*>& p) {
            comm->gather_v(p[0], counts[rank], p[1], counts, dtype, root);
          },
          fmt::format("gather_v {} root {}", name, root));
    }

    // all_to_all_v: rank r sends (r + p) % 3 elements to p, with a one-element gap after each
    // block on both sides.
    std::vector<size_t> send_counts(size), recv_counts(size), send_displs(size), recv_displs(size);
    size_t send_end = 0, recv_end = 0;
    for (int p = 0; p < size; ++p) {
      send_counts[p] = static_cast<size_t>((rank + p) % 3);
      recv_counts[p] = static_cast<size_t>((p + rank) % 3);
      send_displs[p] = send_end;
      recv_displs[p] = recv_end;
      send_end += send_counts[p] + 1;
      recv_end += recv_counts[p] + 1;
    }
    expect_device_matches_host(
        *comm,
        {filled(dtype, send_end, [&](size_t i) { return tag_value(dtype, rank, i); }),
         filled(dtype, recv_end, [](size_t) { return 1; })},
        [&](const std::vector<void*>& p) {
          comm->all_to_all_v(p[0], send_counts, send_displs, p[1], recv_counts, recv_displs, dtype);
        },
        "all_to_all_v " + name);
  }

  for (DType dtype : {DType::f32, DType::f64, DType::i32, DType::bf16}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::avg}) {
      const std::vector<size_t> counts = uneven_counts(size, 2);
      expect_device_matches_host(
          *comm,
          {filled(dtype, total(counts), [&](size_t i) { return contribution(op, rank, size, i); }),
           TypedBuffer(dtype, counts[rank])},
          [&](const std::vector<void*>& p) {
            comm->reduce_scatter_v(p[0], p[1], counts, dtype, op);
          },
          fmt::format("reduce_scatter_v {} {}", dtype_name(dtype), reduce_op_name(op)));
      const std::vector<size_t> even(size, 5);
      expect_device_matches_host(
          *comm,
          {filled(dtype, 5 * size, [&](size_t i) { return contribution(op, rank, size, i); }),
           TypedBuffer(dtype, 5)},
          [&](const std::vector<void*>& p) { comm->reduce_scatter_v(p[0], p[1], even, dtype, op); },
          fmt::format("reduce_scatter_v even {} {}", dtype_name(dtype), reduce_op_name(op)));
    }
  }

  // all_to_all_w: rows [2p, 2p + 2) of a [2 * size, 3] array go to rank p, which stores the
  // block transposed into columns [2r, 2r + 2) of its [3, 2 * size] array.
  {
    std::vector<StridedBlock> send_blocks, recv_blocks;
    for (int p = 0; p < size; ++p) {
      send_blocks.push_back({.offset = 6 * p, .shape = {2, 3}, .strides = {3, 1}});
      recv_blocks.push_back({.offset = 2 * p, .shape = {2, 3}, .strides = {1, 2 * size}});
    }
    expect_device_matches_host(
        *comm,
        {filled(DType::f32, 6 * size, [&](size_t i) { return tag_value(DType::f32, rank, i); }),
         TypedBuffer(DType::f32, 6 * size)},
        [&](const std::vector<void*>& p) {
          comm->all_to_all_w(p[0], send_blocks, p[1], recv_blocks, DType::f32);
        },
        "all_to_all_w");
  }

  // A batch: ring neighbours both ways with two tags each, and a message to itself.
  {
    const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
    expect_device_matches_host(
        *comm,
        {filled(DType::u8, 10, [&](size_t i) { return tag_value(DType::u8, rank, i); }),
         filled(DType::u8, 6, [&](size_t i) { return tag_value(DType::u8, rank + 7, i); }),
         TypedBuffer(DType::u8, 10), TypedBuffer(DType::u8, 6), TypedBuffer(DType::u8, 10)},
        [&](const std::vector<void*>& p) {
          const P2POp ops[] = {
              P2POp::recv(p[3], 6, previous, 2), P2POp::send(p[0], 10, next, 1),
              P2POp::send(p[1], 6, next, 2),     P2POp::recv(p[2], 10, previous, 1),
              P2POp::send(p[0], 10, rank, 5),    P2POp::recv(p[4], 10, rank, 5)};
          comm->send_recv(ops);
        },
        "send_recv");
  }

  // A split: even and odd ranks reduce among themselves.
  {
    std::shared_ptr<Comm> half = comm->split(rank % 2, rank);
    ASSERT_NE(half, nullptr);
    expect_device_matches_host(
        *half,
        {filled(DType::f32, 9,
                [&](size_t i) { return contribution(ReduceOp::sum, rank, size, i); }),
         TypedBuffer(DType::f32, 9)},
        [&](const std::vector<void*>& p) {
          half->all_reduce(p[0], p[1], 9, DType::f32, ReduceOp::sum);
        },
        "all_reduce over a split");
  }
}

/// transfer_stats moved no byte between host and device between `before` and now.
void expect_no_host_device_bytes(const TransferStats& before, const std::string& what) {
  const TransferStats after = transfer_stats();
  EXPECT_EQ(after.host_to_device_bytes, before.host_to_device_bytes) << what;
  EXPECT_EQ(after.device_to_host_bytes, before.device_to_host_bytes) << what;
}

TEST(CommDeviceLocal, EveryCollectiveOnDeviceBuffersMatchesHostBuffersWithRanksSharingOneGpu) {
  SKIP_WITHOUT_GPU();
  ScopedEnv device("TESSERA_DEVICE", "cuda:0");
  for (int ranks : {1, 2, 4}) {
    const TransferStats before = transfer_stats();
    run_local_ranks(ranks, every_collective_on_device);
    expect_no_host_device_bytes(before, fmt::format("local backend, {} ranks", ranks));
  }
}

/// Rank 2k sends 64 MiB to rank 2k + 1 and overwrites its send buffer on its compute stream right
/// after wait(); rank 2k + 1 holds its copy back behind long work on its own compute stream (the
/// copy is ordered after it). The receiver must still get the bytes as sent: the local backend
/// returns from wait() without blocking on the device, so the sender's later work has to be
/// ordered after the receiver's copy.
TEST(CommDeviceLocal, ASendBufferOverwrittenRightAfterWaitReachesItsReceiverAsSent) {
  SKIP_WITHOUT_GPU();
  ScopedEnv device("TESSERA_DEVICE", "cuda:0");
  for (int ranks : {2, 4}) {
    run_local_ranks(ranks, [](std::shared_ptr<Comm> comm) {
      const int rank = comm->rank();
      const bool sender = rank % 2 == 0;
      constexpr size_t bytes = size_t{64} << 20, busy_bytes = size_t{1} << 30;
      const Stream& stream = current_rank_context().compute();
      const int device = stream.device.index;
      auto pattern_of = [](int from, size_t i) {
        return static_cast<std::byte>((i * 7 + static_cast<size_t>(from) * 13 + 1) % 251);
      };
      void* buffer = gpu::allocate(bytes, device);
      void* busy = sender ? nullptr : gpu::allocate(busy_bytes, device);
      std::vector<std::byte> host(bytes);
      for (size_t i = 0; i < bytes; ++i) host[i] = pattern_of(rank, i);
      if (sender) gpu::copy_bytes_async(buffer, host.data(), bytes, stream.handle, device);
      synchronize(stream);
      comm->barrier();
      if (sender) {
        const P2POp send[] = {P2POp::send(buffer, bytes, rank + 1)};
        comm->send_recv(send);
        gpu::zero_bytes_async(buffer, bytes, stream.handle, device);  // reused at once
      } else {
        for (int i = 0; i < 16; ++i) gpu::zero_bytes_async(busy, busy_bytes, stream.handle, device);
        const P2POp recv[] = {P2POp::recv(buffer, bytes, rank - 1)};
        comm->send_recv(recv);
        gpu::copy_bytes_async(host.data(), buffer, bytes, stream.handle, device);
      }
      synchronize(stream);
      if (!sender) {
        size_t wrong = 0, first = bytes;
        for (size_t i = 0; i < bytes; ++i)
          if (host[i] != pattern_of(rank - 1, i)) {
            ++wrong;
            first = std::min(first, i);
          }
        EXPECT_EQ(wrong, 0u) << "rank " << rank << " of " << comm->size()
                             << ": bytes differing from what rank " << rank - 1
                             << " sent, the first at " << first;
      }
      comm->barrier();
      gpu::release(buffer, device);
      if (busy) gpu::release(busy, device);
    });
  }
}

/// An all_reduce in place (recv == send) of 16 M floats on every rank, rank 0's reads held back
/// behind long work on its compute stream: the other ranks write their results into the buffers
/// rank 0 still has to read only after it has, so every rank gets the sum of the inputs. The
/// collective blocks no thread on the device (gpu::host_waits unchanged across it).
TEST(CommDeviceLocal, AnInPlaceAllReduceWithOneReaderHeldBackSumsTheInputs) {
  SKIP_WITHOUT_GPU();
  ScopedEnv device("TESSERA_DEVICE", "cuda:0");
  for (int ranks : {2, 4}) {
    std::atomic<uint64_t> waits_before{0}, waits_after{0};
    run_local_ranks(ranks, [&](std::shared_ptr<Comm> comm) {
      const int rank = comm->rank();
      constexpr size_t count = size_t{16} << 20, busy_bytes = size_t{1} << 30;
      const Stream& stream = current_rank_context().compute();
      const int gpu_index = stream.device.index;
      void* buffer = gpu::allocate(count * sizeof(float), gpu_index);
      void* busy = rank == 0 ? gpu::allocate(busy_bytes, gpu_index) : nullptr;
      std::vector<float> host(count, static_cast<float>(rank + 1));
      gpu::copy_bytes_async(buffer, host.data(), count * sizeof(float), stream.handle, gpu_index);
      synchronize(stream);
      comm->barrier();
      if (rank == 0) waits_before = gpu::host_waits();
      comm->barrier();
      if (rank == 0)
        for (int i = 0; i < 16; ++i)
          gpu::zero_bytes_async(busy, busy_bytes, stream.handle, gpu_index);
      comm->all_reduce(buffer, buffer, count, DType::f32, ReduceOp::sum);
      comm->barrier();
      if (rank == 0) waits_after = gpu::host_waits();
      comm->barrier();
      gpu::copy_bytes_async(host.data(), buffer, count * sizeof(float), stream.handle, gpu_index);
      synchronize(stream);
      const float expected = static_cast<float>(comm->size() * (comm->size() + 1) / 2);
      size_t wrong = 0;
      for (float value : host) wrong += value != expected;
      EXPECT_EQ(wrong, 0u) << "rank " << rank << " of " << comm->size() << ": elements not "
                           << expected << ", e.g. " << host[0];
      comm->barrier();
      gpu::release(buffer, gpu_index);
      if (busy) gpu::release(busy, gpu_index);
    });
    EXPECT_EQ(waits_after - waits_before, 0u) << ranks << " ranks: host waits in the all_reduce";
  }
}

TEST(CommDeviceNccl, EveryCollectiveOverNcclMatchesHostBuffersOnOneRankPerGpu) {
  SKIP_WITHOUT_GPU();
  if (!nccl_compiled()) GTEST_SKIP() << "this Tessera was built without NCCL";
  ScopedEnv device("TESSERA_DEVICE", "cuda");
  const int most = std::min(gpu::device_count(), 4);
  for (int ranks = 1; ranks <= most; ranks *= 2) {
    const TransferStats before = transfer_stats();
    launch(Backend::nccl, ranks, [](std::shared_ptr<Comm> comm) {
      EXPECT_EQ(comm->backend(), "nccl");
      every_collective_on_device(comm);
    });
    expect_no_host_device_bytes(before, fmt::format("nccl backend, {} ranks", ranks));
  }
}

TEST(CommDeviceNccl, SmallAllGathersRunAsAnAllReduceAndGatherTheBytesExactly) {
  // With the threshold at 1 rank every all-gather of at most 64 KiB takes the all-reduce path
  // (zero-padded buffer, u8 sum); the same checks against host buffers must hold bit for bit.
  SKIP_WITHOUT_GPU();
  if (!nccl_compiled()) GTEST_SKIP() << "this Tessera was built without NCCL";
  ScopedEnv device("TESSERA_DEVICE", "cuda");
  ScopedEnv threshold("TESSERA_NCCL_GATHER_BY_REDUCE_RANKS", "1");
  ASSERT_TRUE(nccl_plan::gather_by_all_reduce(1, 64));
  const int most = std::min(gpu::device_count(), 4);
  for (int ranks = 1; ranks <= most; ranks *= 2)
    launch(Backend::nccl, ranks,
           [](std::shared_ptr<Comm> comm) { every_collective_on_device(comm); });
}

TEST(CommDeviceMpi, EveryCollectiveOverMpiMatchesHostBuffersOnDeviceBuffers) {
  SKIP_WITHOUT_GPU();
  if (!testing::mpi_backend())
    GTEST_SKIP() << "runs under mpiexec with TESSERA_BACKEND=mpi (ctest "
                    "tessera_gpu_comm_tests_mpi_2)";
  ScopedEnv device("TESSERA_DEVICE", "cuda");
  launch(Backend::mpi, 1, [](std::shared_ptr<Comm> comm) {
    EXPECT_EQ(comm->backend(), "mpi");
    ASSERT_TRUE(current_rank_context().device().is_cuda());
    every_collective_on_device(comm);
  });
}

}  // namespace
}  // namespace tessera
