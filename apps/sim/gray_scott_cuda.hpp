// The cuda step of the Gray-Scott simulation (cuda/gray_scott_cuda.cpp launches the kernel of
// gray_scott_kernel.cu; no_cuda_gray_scott.cpp stands in for builds without CUDA).
#pragma once

#include "apps/sim/gray_scott.hpp"

namespace tessera::sim {

/// step_cells for cuda fields: one kernel on the calling rank's compute stream (NotAvailable in
/// a build without CUDA).
void step_cells_cuda(const Tensor& u, const Tensor& v, const Tensor& u_next, const Tensor& v_next,
                     const Box& cells, const GrayScottParams& params);

}  // namespace tessera::sim
