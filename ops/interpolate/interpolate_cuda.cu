// Device code of interpolate: the forward with one thread per output reading its (up to eight)
// source cells with the weights of interpolate_taps.hpp, the innermost dim combined first as on
// the cpu; the backward with one thread per gradient cell adding its weighted shares into dx (in
// the computation type: float for f16/bf16) with atomics, as source cells are shared between
// neighbouring outputs.
#include <cstdint>

#include "ops/cuda_elements.cuh"
#include "ops/interpolate/interpolate_cuda.cuh"

namespace tessera::ops::kernels {

namespace {

/// Splits a flat output index into plane and (j0, j1, j2).
__device__ void split_output(const InterpPlan& plan, int64_t index, int64_t& plane, int64_t& j0,
                             int64_t& j1, int64_t& j2) {
  j2 = index % plan.dims[2].out;
  index /= plan.dims[2].out;
  j1 = index % plan.dims[1].out;
  index /= plan.dims[1].out;
  j0 = index % plan.dims[0].out;
  plane = index / plan.dims[0].out;
}

template <typename T>
__global__ void interpolate_forward_kernel(InterpPlan plan, const T* x, T* y, int64_t count) {
  using C = Compute<T>;
  const int64_t in1 = plan.dims[1].in, in2 = plan.dims[2].in;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t p, j0, j1, j2;
    split_output(plan, index, p, j0, j1, j2);
    const T* plane = x + p * plan.in_plane();
    const InterpTap a = interp_tap(plan.mode, plan.dims[0], j0);
    const InterpTap b = interp_tap(plan.mode, plan.dims[1], j1);
    const InterpTap c = interp_tap(plan.mode, plan.dims[2], j2);
    if (plan.mode != InterpMode::linear) {
      y[index] = plane[(a.i0 * in1 + b.i0) * in2 + c.i0];
      continue;
    }
    auto row = [&](int64_t i0, int64_t i1) {
      const T* r = plane + (i0 * in1 + i1) * in2;
      return static_cast<C>(c.w0) * to_compute(r[c.i0]) +
             static_cast<C>(c.w1) * to_compute(r[c.i1]);
    };
    const C bw0 = static_cast<C>(b.w0), bw1 = static_cast<C>(b.w1);
    const C value = static_cast<C>(a.w0) * (bw0 * row(a.i0, b.i0) + bw1 * row(a.i0, b.i1)) +
                    static_cast<C>(a.w1) * (bw0 * row(a.i1, b.i0) + bw1 * row(a.i1, b.i1));
    y[index] = from_compute<T>(value);
  }
}

/// *target += value, atomically.
__device__ void add_to(float* target, float value) {
  atomicAdd(target, value);
}
__device__ void add_to(double* target, double value) {
  atomicAdd(target, value);
}

template <typename T>
__global__ void interpolate_backward_kernel(InterpPlan plan, const T* gy, Compute<T>* dx,
                                            int64_t count) {
  using C = Compute<T>;
  const int64_t in1 = plan.dims[1].in, in2 = plan.dims[2].in;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t p, j0, j1, j2;
    split_output(plan, index, p, j0, j1, j2);
    C* plane = dx + p * plan.in_plane();
    const C g = to_compute(gy[index]);
    const InterpTap a = interp_tap(plan.mode, plan.dims[0], j0);
    const InterpTap b = interp_tap(plan.mode, plan.dims[1], j1);
    const InterpTap c = interp_tap(plan.mode, plan.dims[2], j2);
    if (plan.mode != InterpMode::linear) {
      add_to(plane + (a.i0 * in1 + b.i0) * in2 + c.i0, g);
      continue;
    }
    const int64_t i0s[2] = {a.i0, a.i1}, i1s[2] = {b.i0, b.i1}, i2s[2] = {c.i0, c.i1};
    const double w0s[2] = {a.w0, a.w1}, w1s[2] = {b.w0, b.w1}, w2s[2] = {c.w0, c.w1};
    for (int u = 0; u < 2; ++u)
      for (int v = 0; v < 2; ++v)
        for (int w = 0; w < 2; ++w) {
          const C weight = static_cast<C>(w0s[u]) * static_cast<C>(w1s[v]) * static_cast<C>(w2s[w]);
          if (weight == C(0)) continue;
          add_to(plane + (i0s[u] * in1 + i1s[v]) * in2 + i2s[w], weight * g);
        }
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

cudaError_t launch_interpolate_forward(const InterpPlan& plan, ElementType type, const void* x,
                                       void* y, cudaStream_t stream) {
  const int64_t count = plan.planes * plan.out_plane();
  if (count == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    interpolate_forward_kernel<T><<<grid_for(count), kBlockThreads, 0, stream>>>(
        plan, static_cast<const T*>(x), static_cast<T*>(y), count);
    return cudaGetLastError();
  });
}

cudaError_t launch_interpolate_backward(const InterpPlan& plan, ElementType type, const void* gy,
                                        void* dx, cudaStream_t stream) {
  const int64_t count = plan.planes * plan.out_plane();
  if (count == 0 || plan.in_plane() == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    interpolate_backward_kernel<T><<<grid_for(count), kBlockThreads, 0, stream>>>(
        plan, static_cast<const T*>(gy), static_cast<Compute<T>*>(dx), count);
    return cudaGetLastError();
  });
}

}  // namespace tessera::ops::kernels
