// Estimate mode's exceptions, in a header of their own (estimate_mode.hpp is included by every
// tensor user): real tensor data for the values that decide a program's structure (an ONNX
// model's constants, read from the file and folded on the host), and the ops whose kernels run in
// estimate mode because they communicate (a norm's statistics gathered over the ranks).
#pragma once

#include <string>
#include <string_view>

namespace tessera::estimate {

/// Marks `op`'s kernel as one that runs in estimate mode: it communicates, so apply_op calls it
/// on the shape-only pieces (it then makes shape-only results and posts its collectives with
/// null payloads) instead of skipping it. Called where the op is registered.
void run_kernel_in_estimate_mode(const std::string& op);

/// True when `op`'s kernel runs in estimate mode (run_kernel_in_estimate_mode).
bool runs_kernel_in_estimate_mode(std::string_view op);

/// While alive, tensors made on the calling thread hold real data even in estimate mode (their
/// bytes are counted as before). Nests; restores the previous state.
class RealDataScope {
 public:
  RealDataScope();
  ~RealDataScope();
  RealDataScope(const RealDataScope&) = delete;
  RealDataScope& operator=(const RealDataScope&) = delete;

 private:
  bool previous_active_;
};

}  // namespace tessera::estimate
