// Device code of the normalizations: per-slot moments and backward sums with one block per slot
// (threads stride over the slot's planes, then a fixed tree reduction in shared memory: two
// passes for the moments, mean first), per-channel / per-column parameter gradients, and
// grid-stride elementwise forward and dx. Every sum is in f64 and in a fixed order.
#include <cmath>
#include <cstdint>

#include "ops/cuda_elements.cuh"
#include "ops/norm/norm_cuda.cuh"

namespace tessera::ops::kernels {

namespace {

/// Sums `value` over the block (blockDim.x == kBlockThreads) in a fixed tree; every thread gets
/// the total. `buffer` holds kBlockThreads doubles of shared memory.
__device__ double block_sum(double value, double* buffer) {
  buffer[threadIdx.x] = value;
  __syncthreads();
  for (int half = kBlockThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) buffer[threadIdx.x] += buffer[threadIdx.x + half];
    __syncthreads();
  }
  const double total = buffer[0];
  __syncthreads();
  return total;
}

/// Calls visit(plane) for the planes of a slot, in order.
template <typename Visit>
__device__ void for_slot_planes(const NormGeometry& g, int64_t slot, Visit&& visit) {
  const SlotPlanes planes = slot_planes(g, slot);
  for (int64_t n = planes.n_lo; n < planes.n_hi; ++n)
    for (int64_t c = planes.c_lo; c < planes.c_hi; ++c) visit(n * g.channels + c);
}

template <typename T>
__global__ void moments_kernel(NormGeometry g, const T* x, double* moments) {
  __shared__ double buffer[kBlockThreads];
  const int64_t slot = blockIdx.x;
  const SlotPlanes planes = slot_planes(g, slot);
  const double count =
      static_cast<double>((planes.n_hi - planes.n_lo) * (planes.c_hi - planes.c_lo) * g.length);
  double sum = 0;
  for_slot_planes(g, slot, [&](int64_t plane) {
    const T* p = x + plane * g.length;
    for (int64_t i = threadIdx.x; i < g.length; i += blockDim.x)
      sum += static_cast<double>(to_compute(p[i]));
  });
  const double mean = count > 0 ? block_sum(sum, buffer) / count : 0.0;
  double m2 = 0;
  for_slot_planes(g, slot, [&](int64_t plane) {
    const T* p = x + plane * g.length;
    for (int64_t i = threadIdx.x; i < g.length; i += blockDim.x) {
      const double d = static_cast<double>(to_compute(p[i])) - mean;
      m2 += d * d;
    }
  });
  m2 = block_sum(m2, buffer);
  if (threadIdx.x == 0) {
    moments[3 * slot] = count;
    moments[3 * slot + 1] = mean;
    moments[3 * slot + 2] = m2;
  }
}

__global__ void statistics_kernel(const double* gathered, int64_t ranks, int64_t slots, double eps,
                                  double* statistics) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (s >= slots) return;
  double count = 0, mean = 0, m2 = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    const double* m = gathered + 3 * (r * slots + s);
    combine_moments(count, mean, m2, m[0], m[1], m[2]);
  }
  statistics[4 * s] = mean;
  statistics[4 * s + 1] = 1.0 / sqrt((count > 0 ? m2 / count : 0.0) + eps);
  statistics[4 * s + 2] = count;
  statistics[4 * s + 3] = m2;
}

template <typename T>
__global__ void running_statistics_kernel(const T* mean, const T* var, int64_t channels, double eps,
                                          double* statistics) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= channels) return;
  statistics[4 * c] = static_cast<double>(to_compute(mean[c]));
  statistics[4 * c + 1] = 1.0 / sqrt(static_cast<double>(to_compute(var[c])) + eps);
  statistics[4 * c + 2] = 0;
  statistics[4 * c + 3] = 0;
}

template <typename T>
__global__ void update_running_kernel(const double* statistics, const T* mean, const T* var,
                                      int64_t channels, double momentum, T* new_mean, T* new_var) {
  using C = Compute<T>;
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= channels) return;
  const double count = statistics[4 * c + 2];
  const double unbiased = count > 1 ? statistics[4 * c + 3] / (count - 1) : 0.0;
  new_mean[c] = from_compute<T>(
      static_cast<C>((1 - momentum) * to_compute(mean[c]) + momentum * statistics[4 * c]));
  new_var[c] =
      from_compute<T>(static_cast<C>((1 - momentum) * to_compute(var[c]) + momentum * unbiased));
}

template <typename T>
__global__ void forward_kernel(NormGeometry g, const T* x, const double* statistics, const T* w,
                               const T* b, T* y, int64_t count) {
  using C = Compute<T>;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t plane = e / g.length, i = e % g.length;
    const int64_t slot = g.slot_of(plane);
    const C mean = static_cast<C>(statistics[4 * slot]);
    const C rstd = static_cast<C>(statistics[4 * slot + 1]);
    const int64_t p = g.per_element_affine ? i : g.channel_of(plane);
    C value = (to_compute(x[e]) - mean) * rstd;
    if (w) value *= to_compute(w[p]);
    if (b) value += to_compute(b[p]);
    y[e] = from_compute<T>(value);
  }
}

template <typename T>
__global__ void backward_sums_kernel(NormGeometry g, const T* x, const T* dy,
                                     const double* statistics, const T* w, double* sums) {
  __shared__ double buffer[kBlockThreads];
  const int64_t slot = blockIdx.x;
  const double mean = statistics[4 * slot], rstd = statistics[4 * slot + 1];
  double first = 0, second = 0;
  for_slot_planes(g, slot, [&](int64_t plane) {
    const T* p = x + plane * g.length;
    const T* d = dy + plane * g.length;
    const double scale =
        w && !g.per_element_affine ? static_cast<double>(to_compute(w[g.channel_of(plane)])) : 1.0;
    for (int64_t i = threadIdx.x; i < g.length; i += blockDim.x) {
      double dxhat = static_cast<double>(to_compute(d[i])) * scale;
      if (w && g.per_element_affine) dxhat *= static_cast<double>(to_compute(w[i]));
      first += dxhat;
      second += dxhat * ((static_cast<double>(to_compute(p[i])) - mean) * rstd);
    }
  });
  first = block_sum(first, buffer);
  second = block_sum(second, buffer);
  if (threadIdx.x == 0) {
    sums[2 * slot] = first;
    sums[2 * slot + 1] = second;
  }
}

/// dw, db of local channel blockIdx.x: sums over its planes (n in order).
template <typename T>
__global__ void channel_grads_kernel(NormGeometry g, const T* x, const T* dy,
                                     const double* statistics, T* dw, T* db) {
  using C = Compute<T>;
  __shared__ double buffer[kBlockThreads];
  const int64_t c = blockIdx.x;
  double sum_w = 0, sum_b = 0;
  for (int64_t n = 0; n < g.batch; ++n) {
    const int64_t plane = n * g.channels + c;
    const int64_t slot = g.slot_of(plane);
    const double mean = statistics[4 * slot], rstd = statistics[4 * slot + 1];
    const T* p = x + plane * g.length;
    const T* d = dy + plane * g.length;
    for (int64_t i = threadIdx.x; i < g.length; i += blockDim.x) {
      const double grad = static_cast<double>(to_compute(d[i]));
      sum_b += grad;
      sum_w += grad * ((static_cast<double>(to_compute(p[i])) - mean) * rstd);
    }
  }
  sum_w = block_sum(sum_w, buffer);
  sum_b = block_sum(sum_b, buffer);
  if (threadIdx.x == 0) {
    if (dw) dw[c] = from_compute<T>(static_cast<C>(sum_w));
    if (db) db[c] = from_compute<T>(static_cast<C>(sum_b));
  }
}

/// layer_norm's dw, db of position i: sums over the planes in order.
template <typename T>
__global__ void column_grads_kernel(NormGeometry g, const T* x, const T* dy,
                                    const double* statistics, T* dw, T* db) {
  using C = Compute<T>;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= g.length) return;
  double sum_w = 0, sum_b = 0;
  for (int64_t plane = 0; plane < g.planes(); ++plane) {
    const double mean = statistics[4 * plane], rstd = statistics[4 * plane + 1];
    const double grad = static_cast<double>(to_compute(dy[plane * g.length + i]));
    sum_b += grad;
    sum_w += grad * ((static_cast<double>(to_compute(x[plane * g.length + i])) - mean) * rstd);
  }
  if (dw) dw[i] = from_compute<T>(static_cast<C>(sum_w));
  if (db) db[i] = from_compute<T>(static_cast<C>(sum_b));
}

__global__ void sum_ranks_kernel(const double* gathered, int64_t ranks, int64_t count,
                                 double* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  double sum = 0;
  for (int64_t r = 0; r < ranks; ++r) sum += gathered[r * count + i];
  out[i] = sum;
}

template <typename T>
__global__ void backward_dx_kernel(NormGeometry g, const T* x, const T* dy,
                                   const double* statistics, const double* sums, const T* w, T* dx,
                                   int64_t count) {
  using C = Compute<T>;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t plane = e / g.length, i = e % g.length;
    const int64_t slot = g.slot_of(plane);
    const C mean = static_cast<C>(statistics[4 * slot]);
    const C rstd = static_cast<C>(statistics[4 * slot + 1]);
    C mean_dxhat = 0, mean_dxhat_xhat = 0;
    if (sums) {
      const double n = statistics[4 * slot + 2];
      mean_dxhat = static_cast<C>(sums[2 * slot] / n);
      mean_dxhat_xhat = static_cast<C>(sums[2 * slot + 1] / n);
    }
    C dxhat = to_compute(dy[e]);
    if (w) dxhat *= to_compute(w[g.per_element_affine ? i : g.channel_of(plane)]);
    const C xhat = (to_compute(x[e]) - mean) * rstd;
    dx[e] = from_compute<T>(rstd * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat));
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

cudaError_t launch_norm_moments(const NormGeometry& g, ElementType type, const void* x,
                                double* moments, cudaStream_t stream) {
  if (g.slots == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    moments_kernel<T><<<static_cast<unsigned>(g.slots), kBlockThreads, 0, stream>>>(
        g, static_cast<const T*>(x), moments);
    return cudaGetLastError();
  });
}

cudaError_t launch_norm_statistics(const double* gathered, int64_t ranks, int64_t slots, double eps,
                                   double* statistics, cudaStream_t stream) {
  if (slots == 0) return cudaSuccess;
  statistics_kernel<<<grid_for(slots), kBlockThreads, 0, stream>>>(gathered, ranks, slots, eps,
                                                                   statistics);
  return cudaGetLastError();
}

cudaError_t launch_norm_running_statistics(ElementType type, const void* mean, const void* var,
                                           int64_t channels, double eps, double* statistics,
                                           cudaStream_t stream) {
  if (channels == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    running_statistics_kernel<T><<<grid_for(channels), kBlockThreads, 0, stream>>>(
        static_cast<const T*>(mean), static_cast<const T*>(var), channels, eps, statistics);
    return cudaGetLastError();
  });
}

cudaError_t launch_norm_update_running(ElementType type, const double* statistics, const void* mean,
                                       const void* var, int64_t channels, double momentum,
                                       void* new_mean, void* new_var, cudaStream_t stream) {
  if (channels == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    update_running_kernel<T><<<grid_for(channels), kBlockThreads, 0, stream>>>(
        statistics, static_cast<const T*>(mean), static_cast<const T*>(var), channels, momentum,
        static_cast<T*>(new_mean), static_cast<T*>(new_var));
    return cudaGetLastError();
  });
}

cudaError_t launch_norm_forward(const NormGeometry& g, ElementType type, const void* x,
                                const double* statistics, const void* w, const void* b, void* y,
                                cudaStream_t stream) {
  const int64_t count = g.numel();
  if (count == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    forward_kernel<T><<<grid_for(count), kBlockThreads, 0, stream>>>(
        g, static_cast<const T*>(x), statistics, static_cast<const T*>(w), static_cast<const T*>(b),
        static_cast<T*>(y), count);
    return cudaGetLastError();
  });
}

cudaError_t launch_norm_backward_sums(const NormGeometry& g, ElementType type, const void* x,
                                      const void* dy, const double* statistics, const void* w,
                                      double* sums, void* dw, void* db, cudaStream_t stream) {
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    const T* xt = static_cast<const T*>(x);
    const T* dyt = static_cast<const T*>(dy);
    if (g.slots > 0) {
      backward_sums_kernel<T><<<static_cast<unsigned>(g.slots), kBlockThreads, 0, stream>>>(
          g, xt, dyt, statistics, static_cast<const T*>(w), sums);
      const cudaError_t status = cudaGetLastError();
      if (status != cudaSuccess) return status;
    }
    if (!dw && !db) return cudaSuccess;
    if (!g.per_element_affine) {
      if (g.channels == 0) return cudaSuccess;
      channel_grads_kernel<T><<<static_cast<unsigned>(g.channels), kBlockThreads, 0, stream>>>(
          g, xt, dyt, statistics, static_cast<T*>(dw), static_cast<T*>(db));
    } else {
      if (g.length == 0) return cudaSuccess;
      column_grads_kernel<T><<<grid_for(g.length), kBlockThreads, 0, stream>>>(
          g, xt, dyt, statistics, static_cast<T*>(dw), static_cast<T*>(db));
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_norm_sum_ranks(const double* gathered, int64_t ranks, int64_t count, double* out,
                                  cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  sum_ranks_kernel<<<grid_for(count), kBlockThreads, 0, stream>>>(gathered, ranks, count, out);
  return cudaGetLastError();
}

cudaError_t launch_norm_backward_dx(const NormGeometry& g, ElementType type, const void* x,
                                    const void* dy, const double* statistics, const double* sums,
                                    const void* w, void* dx, cudaStream_t stream) {
  const int64_t count = g.numel();
  if (count == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    backward_dx_kernel<T><<<grid_for(count), kBlockThreads, 0, stream>>>(
        g, static_cast<const T*>(x), static_cast<const T*>(dy), statistics, sums,
        static_cast<const T*>(w), static_cast<T*>(dx), count);
    return cudaGetLastError();
  });
}

}  // namespace tessera::ops::kernels
