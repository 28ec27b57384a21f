// Estimate mode: a rank that runs "without data". While an EstimateScope is alive on a thread,
// every tensor that thread makes is shape-only (shape, dtype, device, no storage), kernels and
// element loops are skipped, and communication carries no payload (core/estimate/sim_comm.hpp).
// The bytes the shape-only tensors would hold are counted per rank (TensorBytes), so the peak
// memory of a rank is known without allocating it. docs/scaling.md describes the mode.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <string_view>

namespace tessera {

/// Bytes of tensor storage held by one rank: live now and the most live at once. Shared by the
/// storages it counts (a storage released on another thread still finds its rank's counter).
struct TensorBytes {
  std::atomic<size_t> live{0};
  std::atomic<size_t> peak{0};
  /// Counts `bytes` more live.
  void add(size_t bytes);
  /// Counts `bytes` fewer live.
  void remove(size_t bytes);
};

namespace estimate {

/// True while the calling thread runs a rank in estimate mode.
bool active();

/// The tensor byte counter installed on the calling thread (null when none).
const std::shared_ptr<TensorBytes>& tensor_bytes();

/// Puts the calling thread in estimate mode while alive (nests; restores the previous state),
/// counting its tensors' bytes in `bytes`.
class Scope {
 public:
  explicit Scope(std::shared_ptr<TensorBytes> bytes);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool previous_active_;
  std::shared_ptr<TensorBytes> previous_bytes_;
};

/// Counts the tensor bytes of the calling thread in `bytes` while alive, without estimate mode:
/// a real run measured the way an estimate counts (nests; restores the previous counter).
class CountScope {
 public:
  explicit CountScope(std::shared_ptr<TensorBytes> bytes);
  ~CountScope();
  CountScope(const CountScope&) = delete;
  CountScope& operator=(const CountScope&) = delete;

 private:
  std::shared_ptr<TensorBytes> previous_;
};

/// The error raised when a path without an estimate mode touches a shape-only tensor's data:
/// "[estimate] <what> touched tensor data (<tensor>) ...".
[[noreturn]] void throw_touched(std::string_view what, std::string_view tensor);

}  // namespace estimate
}  // namespace tessera
