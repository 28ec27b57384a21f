// The failure flag of one launch of in-process ranks (the local backend's threads, estimate
// mode's simulated ranks), shared by the world group and every group split from it: the first
// rank that fails records why, and every rank waiting in a collective sees it and stops.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

namespace tessera::detail {

struct LaunchState {
  std::atomic<bool> aborted{false};
  std::mutex mu;
  std::string reason;

  void abort(const std::string& why) {
    std::lock_guard lock(mu);
    if (!aborted.exchange(true)) reason = why;
  }
  std::string why() {
    std::lock_guard lock(mu);
    return reason;
  }
};

}  // namespace tessera::detail
