// GpuTimer stub for builds without CUDA: constructing one raises NotAvailable.
#include "apps/bench/gpu_timer.hpp"
#include "core/errors.hpp"

namespace tessera::bench {

GpuTimer::GpuTimer(const Stream& stream) : stream_(stream) {
  throw NotAvailable("bench", "GPU timing needs a build with CUDA");
}

GpuTimer::~GpuTimer() = default;

void GpuTimer::start() {}

double GpuTimer::stop() {
  return 0;
}

}  // namespace tessera::bench
