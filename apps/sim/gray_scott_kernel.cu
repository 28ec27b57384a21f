// The Gray-Scott step kernel (gray_scott_kernel.cuh): one thread per owned cell, the operations
// in the scheme's order. Compiled with --fmad=false (apps/sim/CMakeLists.txt) so that no
// multiply-add is fused and the results equal the cpu step's bit for bit.
#include "apps/sim/gray_scott_cell.hpp"
#include "apps/sim/gray_scott_kernel.cuh"

namespace tessera::sim::kernels {

namespace {

template <class T>
__global__ void gray_scott_step(const T* __restrict__ u, const T* __restrict__ v,
                                T* __restrict__ u_next, T* __restrict__ v_next, int64_t sx,
                                int64_t sy, int64_t lo_x, int64_t lo_y, int64_t lo_z, int64_t ny,
                                int64_t nz, int64_t cells, GrayScottCoefficients p) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= cells) return;
  const int64_t k = index % nz, j = (index / nz) % ny, i = index / (nz * ny);
  const int64_t at = (lo_x + i + 1) * sx + (lo_y + j + 1) * sy + lo_z + k + 1;
  const CellCoefficients<T> c(p.du, p.dv, p.feed, p.kill, p.dt);
  gray_scott_cell(u, v, u_next, v_next, at, sx, sy, c);
}

}  // namespace

cudaError_t launch_gray_scott_step(const void* u, const void* v, void* u_next, void* v_next,
                                   bool f64, const int64_t* haloed_shape, const int64_t* lo,
                                   const int64_t* hi, GrayScottCoefficients coefficients,
                                   cudaStream_t stream) {
  const int64_t nx = hi[0] - lo[0], ny = hi[1] - lo[1], nz = hi[2] - lo[2];
  const int64_t cells = nx * ny * nz;
  if (nx <= 0 || ny <= 0 || nz <= 0) return cudaSuccess;
  const int64_t sy = haloed_shape[2], sx = haloed_shape[1] * sy;
  constexpr int kThreads = 256;
  const unsigned blocks = static_cast<unsigned>((cells + kThreads - 1) / kThreads);
  if (f64)
    gray_scott_step<double><<<blocks, kThreads, 0, stream>>>(
        static_cast<const double*>(u), static_cast<const double*>(v), static_cast<double*>(u_next),
        static_cast<double*>(v_next), sx, sy, lo[0], lo[1], lo[2], ny, nz, cells, coefficients);
  else
    gray_scott_step<float><<<blocks, kThreads, 0, stream>>>(
        static_cast<const float*>(u), static_cast<const float*>(v), static_cast<float*>(u_next),
        static_cast<float*>(v_next), sx, sy, lo[0], lo[1], lo[2], ny, nz, cells, coefficients);
  return cudaGetLastError();
}

}  // namespace tessera::sim::kernels
