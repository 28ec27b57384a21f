// GpuTimer: elapsed device time between two points of a stream, measured with CUDA events
// (apps/bench/cuda/gpu_timer.cpp; without CUDA, apps/bench/no_gpu_timer.cpp throws NotAvailable).
#pragma once

#include "core/runtime/rank_context.hpp"

namespace tessera::bench {

/// Times the work queued on one cuda stream between start() and stop().
class GpuTimer {
 public:
  /// Two timing events on `stream`'s device.
  explicit GpuTimer(const Stream& stream);
  ~GpuTimer();
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;
  /// Records the start event on the stream.
  void start();
  /// Records the stop event, waits for it, and returns the seconds between the two events.
  double stop();

 private:
  Stream stream_;
  void* start_ = nullptr;
  void* stop_ = nullptr;
};

}  // namespace tessera::bench
