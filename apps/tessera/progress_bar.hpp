// A progress bar for long CLI runs (simulate, train): one line on stderr, redrawn in place at
// most every 0.1 s, ended by a newline when the run is done. Callers draw it only on a terminal
// (isatty) and print plain lines otherwise, so logs and pipes never receive carriage returns.
#pragma once

#include <cstdint>
#include <string>

namespace tessera::cli {

class ProgressBar {
 public:
  /// Draws `done` of `total` steps, followed by `detail` (e.g. "loss 0.25, 310 samples/s, ETA
  /// 4 s"); skipped when the last draw is under 0.1 s old, unless the run is done.
  void operator()(int64_t done, int64_t total, const std::string& detail = {});

 private:
  double last_ = 0;
};

/// "4 s", "3 min 20 s", "2 h 05 min": a remaining time for a progress line.
std::string format_eta(double seconds);

}  // namespace tessera::cli
