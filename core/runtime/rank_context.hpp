// RankContext: where one rank's device work runs. Each rank (a thread of the local backend or
// an MPI process) has a device and, on cuda, two streams: `compute` (kernels, copies of the
// data path) and `comm` (communication). Work moves between them only through events
// (order_after), never by synchronizing the whole device. Ranks on cpu have no streams: the
// ordering calls are no-ops and work runs inline.
//
// Ordering rules every layer follows (and the tests check on the host):
//  - Kernels and copies of the data path are queued on the rank's compute stream.
//  - Before communication reads a buffer, the comm stream waits for the compute stream;
//    once it has written one, the compute stream waits for the comm stream (order_after).
//  - A Comm call returns when the data it moved is in place as seen from the compute stream:
//    later compute work that reads the received buffer is ordered after the copies.
//  - Host code that reads device memory synchronizes the compute stream first
//    (synchronize_compute), and only then.
#pragma once

#include <memory>
#include <string>

#include "core/device.hpp"
#include "core/gpu_runtime.hpp"

namespace tessera {

/// A stream of one device: where asynchronous work is queued in order. For a cpu device the
/// handle is null and the work runs inline.
struct Stream {
  Device device = Device::cpu();
  gpu::StreamHandle handle = nullptr;
  bool is_cpu() const { return device.is_cpu(); }
};

/// The device and streams of the calling rank.
class RankContext {
 public:
  /// A context on `device` (cuda: creates its two streams; cpu: none).
  explicit RankContext(Device device);
  ~RankContext();
  RankContext(const RankContext&) = delete;
  RankContext& operator=(const RankContext&) = delete;

  /// The rank's device: where its tensors are created by default.
  Device device() const { return device_; }
  /// Stream of kernels and data-path copies.
  const Stream& compute() const { return compute_; }
  /// Stream of communication copies.
  const Stream& comm() const { return comm_; }

 private:
  Device device_;
  Stream compute_;
  Stream comm_;
};

/// The calling thread's rank context (a cpu context when none was installed).
RankContext& current_rank_context();

/// The stream that device work on `device` queues on from this thread: the current rank's
/// compute stream when the rank's device is `device`, else a per-thread stream of `device`
/// (created on first use), and the null stream for the cpu.
Stream compute_stream_for(Device device);

/// Installs `context` as the calling thread's rank context while alive (nests; restores the
/// previous one on destruction).
class RankContextScope {
 public:
  explicit RankContextScope(std::shared_ptr<RankContext> context);
  ~RankContextScope();
  RankContextScope(const RankContextScope&) = delete;
  RankContextScope& operator=(const RankContextScope&) = delete;

 private:
  std::shared_ptr<RankContext> previous_;
};

/// The default device of a rank: TESSERA_DEVICE (cpu | cuda | cuda:N) when set, else cpu.
/// With "cuda", rank `local_rank` gets cuda:(local_rank % device_count) (several local ranks may
/// share one GPU). Pure given its arguments (tested without a GPU).
Device default_rank_device(const std::string& requested, int local_rank, int device_count);

/// Makes future work on `waiter` wait for the work queued so far on `producer` (an event
/// between the two streams; no-op when either is a cpu stream or they are the same stream).
void order_after(const Stream& waiter, const Stream& producer);

/// Blocks the calling thread until `stream`'s queued work is done (no-op on cpu).
void synchronize(const Stream& stream);

}  // namespace tessera
