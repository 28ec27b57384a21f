// parallel_for on OpenMP threads (built when CMake finds OpenMP; see parallel_for.hpp).
#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>

#include "core/parallel_for.hpp"

namespace tessera {

namespace {

// libgomp's thread pool does not survive fork(): in a child of a process that has run a
// parallel region, the next region waits for threads that no longer exist. A forked child (a
// crash-safety test, a launcher that forks workers) runs every loop on its one thread instead.
std::atomic<bool> in_forked_child{false};
const bool fork_handler_registered = [] {
  return ::pthread_atfork(
             nullptr, nullptr, +[] { in_forked_child.store(true); }) == 0;
}();

}  // namespace

void parallel_for(int64_t count, int threads,
                  const std::function<void(int64_t begin, int64_t end, int slot)>& body) {
  if (count <= 0) return;
  threads = static_cast<int>(std::clamp<int64_t>(threads, 1, count));
  if (threads == 1 || in_forked_child.load(std::memory_order_relaxed)) {
    body(0, count, 0);
    return;
  }
  // About eight chunks per thread: enough to even out uneven rows (causal windows, borders)
  // while keeping the per-chunk overhead negligible.
  const int64_t chunk = std::max<int64_t>(1, count / (8 * static_cast<int64_t>(threads)));
  const int64_t chunks = (count + chunk - 1) / chunk;
  std::exception_ptr failure;
  std::mutex failure_mutex;
#pragma omp parallel num_threads(threads)
  {
    const int slot = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      try {
        body(c * chunk, std::min(count, (c + 1) * chunk), slot);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(failure_mutex);
        if (!failure) failure = std::current_exception();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
}

bool parallel_for_has_threads() {
  return true;
}

}  // namespace tessera
