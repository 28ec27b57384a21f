// Launch interface of the Gray-Scott step kernel (device code in gray_scott_kernel.cu, C++17 for
// nvcc). The scheme is the one of apps/sim/gray_scott.hpp, operation for operation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::sim::kernels {

/// The model's parameters as given (converted to the field's type on the device).
struct GrayScottCoefficients {
  double du, dv, feed, kill, dt;
};

/// Enqueues one step on `stream` for the owned cells [lo, hi) (owned-piece coordinates) of
/// haloed contiguous fields u, v -> u_next, v_next of `haloed_shape` (halo width 1); `f64`
/// chooses double elements, else float.
cudaError_t launch_gray_scott_step(const void* u, const void* v, void* u_next, void* v_next,
                                   bool f64, const int64_t* haloed_shape, const int64_t* lo,
                                   const int64_t* hi, GrayScottCoefficients coefficients,
                                   cudaStream_t stream);

}  // namespace tessera::sim::kernels
