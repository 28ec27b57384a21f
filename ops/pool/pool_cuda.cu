// Device code of the pooling ops: the forward with one thread per output (the window's real
// cells from pool_windows.hpp, max: the first maximum in window order or the last NaN and its
// global index, avg: the sum over the divisor), and the backward as a gather with one thread per
// input cell over the windows that contain it (max: those whose argmax, written by a first pass, is
// the cell), so every gradient is summed in a fixed order without atomics.
#include <cstdint>
#include <limits>

#include "ops/cuda_elements.cuh"
#include "ops/pool/pool_cuda.cuh"

namespace tessera::ops::kernels {

namespace {

/// The local input index of the maximum of output `o`'s window in plane `plane` (first maximum in
/// window order, the last NaN when there is one, the first real cell when all are -inf), -1 when
/// no cell of the window is real; with `global`, its pool_global_index there too (-1 likewise).
template <typename T>
__device__ int64_t window_argmax(const PoolWindows& w, const T* plane, int64_t j0, int64_t j1,
                                 int64_t j2, int64_t* global = nullptr) {
  using C = Compute<T>;
  const PoolRange r0 = pool_range(w.dims[0], j0), r1 = pool_range(w.dims[1], j1),
                  r2 = pool_range(w.dims[2], j2);
  const int64_t s0 = w.dims[0].first + j0 * w.dims[0].stride;
  const int64_t s1 = w.dims[1].first + j1 * w.dims[1].stride;
  const int64_t s2 = w.dims[2].first + j2 * w.dims[2].stride;
  if (r0.hi <= r0.lo || r1.hi <= r1.lo || r2.hi <= r2.lo) {
    if (global != nullptr) *global = -1;
    return -1;
  }
  C best = -std::numeric_limits<C>::infinity();
  // The kernel cell of the maximum; the first real cell (PyTorch's argmax when every real cell
  // is -inf) until a larger one is seen.
  int64_t b0 = r0.lo, b1 = r1.lo, b2 = r2.lo;
  for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0) {
    const int64_t i0 = s0 + t0 * w.dims[0].dilation;
    for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
      const int64_t row = (i0 * w.dims[1].in + s1 + t1 * w.dims[1].dilation) * w.dims[2].in + s2;
      for (int64_t t2 = r2.lo; t2 < r2.hi; ++t2) {
        const C value = to_compute(plane[row + t2 * w.dims[2].dilation]);
        if (value > best || value != value) {
          best = value;
          b0 = t0;
          b1 = t1;
          b2 = t2;
        }
      }
    }
  }
  const int64_t i0 = s0 + b0 * w.dims[0].dilation, i1 = s1 + b1 * w.dims[1].dilation,
                i2 = s2 + b2 * w.dims[2].dilation;
  if (global != nullptr) *global = pool_global_index(w, i0, i1, i2);
  return (i0 * w.dims[1].in + i1) * w.dims[2].in + i2;
}

/// avg's divisor of output (j0, j1, j2), 0 when its window holds no real cell.
__device__ double avg_divisor(const PoolWindows& w, int64_t j0, int64_t j1, int64_t j2) {
  const PoolRange r0 = pool_range(w.dims[0], j0), r1 = pool_range(w.dims[1], j1),
                  r2 = pool_range(w.dims[2], j2);
  if (r0.hi <= r0.lo || r1.hi <= r1.lo || r2.hi <= r2.lo) return 0.0;
  if (w.divisor_override != 0) return static_cast<double>(w.divisor_override);
  if (w.count_include_pad) return static_cast<double>(r0.padded * r1.padded * r2.padded);
  return static_cast<double>((r0.hi - r0.lo) * (r1.hi - r1.lo) * (r2.hi - r2.lo));
}

/// Splits a flat output index into plane and (j0, j1, j2).
__device__ void split_output(const PoolWindows& w, int64_t index, int64_t& plane, int64_t& j0,
                             int64_t& j1, int64_t& j2) {
  j2 = index % w.dims[2].out;
  index /= w.dims[2].out;
  j1 = index % w.dims[1].out;
  index /= w.dims[1].out;
  j0 = index % w.dims[0].out;
  plane = index / w.dims[0].out;
}

template <typename T>
__global__ void pool_forward_kernel(PoolWindows w, const T* x, T* y, int64_t* indices,
                                    int64_t count) {
  using C = Compute<T>;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t p, j0, j1, j2;
    split_output(w, index, p, j0, j1, j2);
    const T* plane = x + p * w.in_plane();
    if (w.kind == PoolKind::max) {
      const int64_t arg = window_argmax(w, plane, j0, j1, j2, indices + index);
      y[index] = arg < 0 ? from_compute<T>(-std::numeric_limits<C>::infinity()) : plane[arg];
      continue;
    }
    const double divisor = avg_divisor(w, j0, j1, j2);
    if (divisor == 0.0) {
      y[index] = from_compute<T>(C(0));
      continue;
    }
    const PoolRange r0 = pool_range(w.dims[0], j0), r1 = pool_range(w.dims[1], j1),
                    r2 = pool_range(w.dims[2], j2);
    const int64_t s0 = w.dims[0].first + j0 * w.dims[0].stride;
    const int64_t s1 = w.dims[1].first + j1 * w.dims[1].stride;
    const int64_t s2 = w.dims[2].first + j2 * w.dims[2].stride;
    C sum = 0;
    for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0)
      for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
        const T* row = plane + ((s0 + t0) * w.dims[1].in + s1 + t1) * w.dims[2].in + s2;
        for (int64_t t2 = r2.lo; t2 < r2.hi; ++t2) sum += to_compute(row[t2]);
      }
    y[index] = from_compute<T>(sum / static_cast<C>(divisor));
  }
}

template <typename T>
__global__ void pool_argmax_kernel(PoolWindows w, const T* x, int64_t* argmax, int64_t count) {
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t p, j0, j1, j2;
    split_output(w, index, p, j0, j1, j2);
    argmax[index] = window_argmax(w, x + p * w.in_plane(), j0, j1, j2);
  }
}

/// Whether some output's window along `dim` reads input cell i as its kernel cell t: output
/// j = (i - first - t*dilation) / stride when that divides and lies in [0, out).
__device__ bool output_at(const PoolDim& dim, int64_t i, int64_t t, int64_t& j) {
  const int64_t offset = i - dim.first - t * dim.dilation;
  if (offset < 0 || offset % dim.stride != 0) return false;
  j = offset / dim.stride;
  return j < dim.out;
}

template <typename T>
__global__ void pool_backward_kernel(PoolWindows w, const T* gy, const int64_t* argmax, T* dx,
                                     int64_t count) {
  using C = Compute<T>;
  const int64_t in_plane = w.in_plane(), out_plane = w.out_plane();
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = index;
    const int64_t i2 = rest % w.dims[2].in;
    rest /= w.dims[2].in;
    const int64_t i1 = rest % w.dims[1].in;
    rest /= w.dims[1].in;
    const int64_t i0 = rest % w.dims[0].in;
    const int64_t p = rest / w.dims[0].in;
    const int64_t local = index - p * in_plane;
    C sum = 0;
    const bool real = i0 >= w.dims[0].real_lo && i0 < w.dims[0].real_hi &&
                      i1 >= w.dims[1].real_lo && i1 < w.dims[1].real_hi &&
                      i2 >= w.dims[2].real_lo && i2 < w.dims[2].real_hi;
    if (real) {
      const T* g = gy + p * out_plane;
      for (int64_t t0 = 0; t0 < w.dims[0].kernel; ++t0) {
        int64_t j0;
        if (!output_at(w.dims[0], i0, t0, j0)) continue;
        for (int64_t t1 = 0; t1 < w.dims[1].kernel; ++t1) {
          int64_t j1;
          if (!output_at(w.dims[1], i1, t1, j1)) continue;
          for (int64_t t2 = 0; t2 < w.dims[2].kernel; ++t2) {
            int64_t j2;
            if (!output_at(w.dims[2], i2, t2, j2)) continue;
            const int64_t o = (j0 * w.dims[1].out + j1) * w.dims[2].out + j2;
            if (w.kind == PoolKind::max) {
              if (argmax[p * out_plane + o] == local) sum += to_compute(g[o]);
            } else {
              // A real cell lies inside the padded extent, where avg windows are clipped.
              sum += to_compute(g[o]) / static_cast<C>(avg_divisor(w, j0, j1, j2));
            }
          }
        }
      }
    }
    dx[index] = from_compute<T>(sum);
  }
}

unsigned grid_for(int64_t count) {
  const long long blocks = (count + kBlockThreads - 1) / kBlockThreads;
  return static_cast<unsigned>(blocks < kMaxGridBlocks ? blocks : kMaxGridBlocks);
}

template <typename Fn>
cudaError_t dispatch(ElementType type, Fn&& fn) {
  switch (type) {
    case ElementType::f32: return fn(float{});
    case ElementType::f64: return fn(double{});
    case ElementType::f16: return fn(__half{});
    case ElementType::bf16: return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_pool_forward(const PoolWindows& windows, ElementType type, const void* x,
                                void* y, int64_t* indices, cudaStream_t stream) {
  const int64_t count = windows.planes * windows.out_plane();
  if (count == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    pool_forward_kernel<T><<<grid_for(count), kBlockThreads, 0, stream>>>(
        windows, static_cast<const T*>(x), static_cast<T*>(y), indices, count);
    return cudaGetLastError();
  });
}

cudaError_t launch_pool_backward(const PoolWindows& windows, ElementType type, const void* x,
                                 const void* gy, void* dx, int64_t* argmax, cudaStream_t stream) {
  const int64_t outputs = windows.planes * windows.out_plane();
  const int64_t inputs = windows.planes * windows.in_plane();
  if (inputs == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    if (windows.kind == PoolKind::max && outputs > 0) {
      pool_argmax_kernel<T><<<grid_for(outputs), kBlockThreads, 0, stream>>>(
          windows, static_cast<const T*>(x), argmax, outputs);
      const cudaError_t status = cudaGetLastError();
      if (status != cudaSuccess) return status;
    }
    pool_backward_kernel<T><<<grid_for(inputs), kBlockThreads, 0, stream>>>(
        windows, static_cast<const T*>(gy), argmax, static_cast<T*>(dx), inputs);
    return cudaGetLastError();
  });
}

}  // namespace tessera::ops::kernels
