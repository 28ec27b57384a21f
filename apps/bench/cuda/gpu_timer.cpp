// GpuTimer on CUDA events (cudaEventElapsedTime between two events recorded on one stream).
#include "apps/bench/gpu_timer.hpp"

#include <cuda_runtime.h>

#include "core/cuda/check.hpp"

namespace tessera::bench {

GpuTimer::GpuTimer(const Stream& stream) : stream_(stream) {
  const int device = stream_.device.index;
  TESSERA_CUDA_CHECK(cudaSetDevice(device), device);
  cudaEvent_t start = nullptr, stop = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreate(&start), device);
  TESSERA_CUDA_CHECK(cudaEventCreate(&stop), device);
  start_ = start;
  stop_ = stop;
}

GpuTimer::~GpuTimer() {
  cudaEventDestroy(static_cast<cudaEvent_t>(start_));
  cudaEventDestroy(static_cast<cudaEvent_t>(stop_));
}

void GpuTimer::start() {
  TESSERA_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(start_), static_cast<cudaStream_t>(stream_.handle)),
      stream_.device.index);
}

double GpuTimer::stop() {
  const int device = stream_.device.index;
  TESSERA_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(stop_), static_cast<cudaStream_t>(stream_.handle)),
      device);
  TESSERA_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(stop_)), device);
  float milliseconds = 0;
  TESSERA_CUDA_CHECK(cudaEventElapsedTime(&milliseconds, static_cast<cudaEvent_t>(start_),
                                          static_cast<cudaEvent_t>(stop_)),
                     device);
  return milliseconds * 1e-3;
}

}  // namespace tessera::bench
