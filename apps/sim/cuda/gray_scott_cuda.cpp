// The cuda step of the Gray-Scott simulation (gray_scott_cuda.hpp): launches the kernel of
// gray_scott_kernel.cu on the rank's compute stream.
#include "apps/sim/gray_scott_cuda.hpp"

#include <fmt/format.h>

#include "apps/sim/gray_scott_kernel.cuh"
#include "core/cuda/check.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera::sim {

void step_cells_cuda(const Tensor& u, const Tensor& v, const Tensor& u_next, const Tensor& v_next,
                     const Box& cells, const GrayScottParams& params) {
  const Stream stream = compute_stream_for(u.device());
  const kernels::GrayScottCoefficients coefficients{params.du, params.dv, params.feed, params.kill,
                                                    params.dt};
  TESSERA_CUDA_CHECK(kernels::launch_gray_scott_step(
                         u.raw_data(), v.raw_data(), u_next.raw_data(), v_next.raw_data(),
                         u.dtype() == DType::f64, u.shape().data(), cells.lo.data(),
                         cells.hi.data(), coefficients, static_cast<cudaStream_t>(stream.handle)),
                     u.device().index);
}

}  // namespace tessera::sim
