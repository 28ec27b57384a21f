// Helpers the Comm backends share for device buffers: which device a buffer lives on, the
// streams a rank communicates on, shared events and scratch memory from the device allocator.
// Internal to core/comm/.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "core/comm/comm.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera::comm_device {

/// Device index of `pointer`; -1 for host memory, for null, and whenever no GPU is visible (then
/// without any CUDA call, so host-only runs pay nothing).
int buffer_device(const void* pointer);

/// The stream communication on cuda:`device` runs on: the rank's comm stream when its context
/// is on that device, else the thread's compute stream of the device.
Stream comm_stream_for(int device);

/// The stream compute work on cuda:`device` queues on from this thread.
Stream compute_stream_of(int device);

/// A CUDA event shared between ranks (destroyed with its last holder).
class SharedEvent {
 public:
  /// An event of cuda:`device`.
  explicit SharedEvent(int device);
  /// Records the work queued so far on `stream`.
  void record(const Stream& stream) const;
  /// Makes later work on `stream` wait for the recorded work.
  void wait_on(const Stream& stream) const;
  /// Blocks the calling thread until the recorded work is done.
  void synchronize() const;
  /// True when the recorded work is done (non-blocking).
  bool query() const;

 private:
  int device_;
  std::shared_ptr<void> event_;
};

/// `bytes` of device memory of cuda:`device` from its backend's allocator, used on `stream` and
/// released there when destroyed.
class DeviceScratch {
 public:
  DeviceScratch(size_t bytes, int device, const Stream& stream, const std::string& op);
  ~DeviceScratch();
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t bytes_;
  int device_;
  Stream stream_;
};

/// Comm::all_to_all_w for blocks in memory of cuda:`device`: packs every send block into
/// contiguous scratch (backend copies on the compute stream), exchanges the packed buffers with
/// comm.all_to_all_v (a device call) and unpacks the received ones.
void all_to_all_w_on_device(Comm& comm, int device, const void* send_base,
                            std::span<const StridedBlock> send_blocks, void* recv_base,
                            std::span<const StridedBlock> recv_blocks, DType dtype);

}  // namespace tessera::comm_device
