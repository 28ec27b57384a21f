// Device code of pad: the forward with one thread per output copying its source cell (or the
// constant value), the backward with one thread per gradient cell adding it into its source cell
// (in the computation type: float for f16/bf16) with atomics.
#include <cstdint>

#include "ops/cuda_elements.cuh"
#include "ops/pad/pad_cuda.cuh"

namespace tessera::ops::kernels {

namespace {

/// The local source cell of flat output `index` within its plane, or -1; its plane in `plane`.
__device__ int64_t source_of(const PadPlan& plan, int64_t index, int64_t& plane) {
  const int64_t j2 = index % plan.dims[2].out;
  index /= plan.dims[2].out;
  const int64_t j1 = index % plan.dims[1].out;
  index /= plan.dims[1].out;
  const int64_t j0 = index % plan.dims[0].out;
  plane = index / plan.dims[0].out;
  const int64_t a = pad_tap(plan.mode, plan.dims[0], j0);
  const int64_t b = pad_tap(plan.mode, plan.dims[1], j1);
  const int64_t c = pad_tap(plan.mode, plan.dims[2], j2);
  if (a < 0 || b < 0 || c < 0) return -1;
  return (a * plan.dims[1].in + b) * plan.dims[2].in + c;
}

template <typename T>
__global__ void pad_forward_kernel(PadPlan plan, const T* x, T* y, int64_t count) {
  using C = Compute<T>;
  const T value = from_compute<T>(static_cast<C>(plan.value));
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t p;
    const int64_t source = source_of(plan, index, p);
    y[index] = source < 0 ? value : x[p * plan.in_plane() + source];
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
__global__ void pad_backward_kernel(PadPlan plan, const T* gy, Compute<T>* dx, int64_t count) {
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t p;
    const int64_t source = source_of(plan, index, p);
    if (source >= 0) add_to(dx + p * plan.in_plane() + source, to_compute(gy[index]));
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

cudaError_t launch_pad_forward(const PadPlan& plan, ElementType type, const void* x, void* y,
                               cudaStream_t stream) {
  const int64_t count = plan.planes * plan.out_plane();
  if (count == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    pad_forward_kernel<T><<<grid_for(count), kBlockThreads, 0, stream>>>(
        plan, static_cast<const T*>(x), static_cast<T*>(y), count);
    return cudaGetLastError();
  });
}

cudaError_t launch_pad_backward(const PadPlan& plan, ElementType type, const void* gy, void* dx,
                                cudaStream_t stream) {
  const int64_t count = plan.planes * plan.out_plane();
  if (count == 0 || plan.in_plane() == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    pad_backward_kernel<T><<<grid_for(count), kBlockThreads, 0, stream>>>(
        plan, static_cast<const T*>(gy), static_cast<Compute<T>*>(dx), count);
    return cudaGetLastError();
  });
}

}  // namespace tessera::ops::kernels
