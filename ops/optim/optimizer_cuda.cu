// The optimizers' cuda kernels: a grid-stride loop applying rules::Sgd / rules::Adam (the same
// per-element formulas as the cpu loops) to contiguous f32/f64 buffers.
#include "ops/optim/optimizer_cuda.cuh"

namespace tessera::optim::kernels {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

template <typename T>
__global__ void sgd_kernel(rules::Sgd<T> rule, T* p, const T* grad, T* b, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    rule(p[i], grad[i], b ? b + i : nullptr);
}

template <typename T>
__global__ void adam_kernel(rules::Adam<T> rule, T* p, const T* grad, T* m, T* v, T* v_max,
                            int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    rule(p[i], grad[i], m[i], v[i], v_max ? v_max + i : nullptr);
}

}  // namespace

template <typename T>
cudaError_t launch_sgd(const rules::Sgd<T>& rule, T* p, const T* grad, T* b, int64_t count,
                       cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  sgd_kernel<T><<<blocks_for(count), kThreads, 0, stream>>>(rule, p, grad, b, count);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_adam(const rules::Adam<T>& rule, T* p, const T* grad, T* m, T* v, T* v_max,
                        int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  adam_kernel<T><<<blocks_for(count), kThreads, 0, stream>>>(rule, p, grad, m, v, v_max, count);
  return cudaGetLastError();
}

template cudaError_t launch_sgd<float>(const rules::Sgd<float>&, float*, const float*, float*,
                                       int64_t, cudaStream_t);
template cudaError_t launch_sgd<double>(const rules::Sgd<double>&, double*, const double*, double*,
                                        int64_t, cudaStream_t);
template cudaError_t launch_adam<float>(const rules::Adam<float>&, float*, const float*, float*,
                                        float*, float*, int64_t, cudaStream_t);
template cudaError_t launch_adam<double>(const rules::Adam<double>&, double*, const double*,
                                         double*, double*, double*, int64_t, cudaStream_t);

}  // namespace tessera::optim::kernels
