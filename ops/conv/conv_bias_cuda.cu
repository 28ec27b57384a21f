// Device code of the conv bias gradient (see conv_bias_plan.hpp for the order of the sums).
// First pass: one block per (channel group, chunk); each walker adds its groups of the chunk,
// stepping through the reduced dims with an add-with-carry (no division per element), reading a
// contiguous group with one 16-byte load when its address is aligned (the values are added in
// the same order either way, so alignment never changes the result) and keeping several loads
// in flight before adding them in order; the walkers of a channel are combined in a fixed tree.
// Second pass (chunks > 1): one thread per channel adds the chunk sums in chunk order.
#include <cstdint>

#include "ops/conv/conv_bias_cuda.cuh"
#include "ops/cuda_elements.cuh"

namespace tessera::ops::kernels {

namespace {

/// Loads issued before their sums are added, per walker (they do not depend on the sum, so a
/// walker keeps this many 16-byte reads in flight; the order of the additions is unchanged).
constexpr int kLoadsInFlight = 4;

/// The `V` consecutive elements of one group.
template <typename T, int V>
struct alignas(V * sizeof(T)) Group {
  T values[V];
};

/// The group at `p`: one 16-byte load when `p` is aligned to it, else element by element (the
/// same values either way).
template <typename T, int V>
__device__ __forceinline__ Group<T, V> load_group(const T* __restrict__ p) {
  Group<T, V> group;
  if constexpr (V == 1) {
    group.values[0] = p[0];
  } else {
    static_assert(V * sizeof(T) == sizeof(uint4), "a group is one 16-byte vector");
    if ((reinterpret_cast<uintptr_t>(p) & (sizeof(uint4) - 1)) == 0) {
      *reinterpret_cast<uint4*>(group.values) = *reinterpret_cast<const uint4*>(p);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) group.values[i] = p[i];
    }
  }
  return group;
}

/// Adds the elements of `group` to `sum`, in index order.
template <typename T, int V>
__device__ __forceinline__ void add_group(const Group<T, V>& group, Compute<T>& sum) {
#pragma unroll
  for (int i = 0; i < V; ++i) sum += to_compute(group.values[i]);
}

template <typename T, int V>
__global__ void __launch_bounds__(kBiasGradThreads)
    bias_grad_kernel(const T* __restrict__ dy, T* __restrict__ db, Compute<T>* chunk_sums,
                     BiasGradPlan plan) {
  __shared__ Compute<T> partial[kBiasGradThreads];
  const int64_t channel_group = blockIdx.x % plan.channel_groups;
  const int64_t chunk = blockIdx.x / plan.channel_groups;
  const int lane = threadIdx.x % plan.lanes;
  const int walker = threadIdx.x / plan.lanes;
  const int64_t channel = channel_group * plan.lanes + lane;
  Compute<T> sum = 0;
  if (channel < plan.channels) {
    const T* base = dy + channel * plan.channel_stride;
    const int64_t begin = chunk * plan.chunk_groups;
    const int64_t end =
        begin + plan.chunk_groups < plan.groups ? begin + plan.chunk_groups : plan.groups;
    if (begin + walker < end) {
      int64_t index[kBiasGradMaxDims] = {};
      bias_grad_index(plan, begin + walker, index);
      int64_t g = begin + walker;
      for (; g + (kLoadsInFlight - 1) * plan.walkers < end; g += kLoadsInFlight * plan.walkers) {
        Group<T, V> groups[kLoadsInFlight];
#pragma unroll
        for (int k = 0; k < kLoadsInFlight; ++k) {
          groups[k] = load_group<T, V>(base + bias_grad_offset(plan, index));
          bias_grad_advance(plan, index);
        }
#pragma unroll
        for (int k = 0; k < kLoadsInFlight; ++k) add_group<T, V>(groups[k], sum);
      }
      for (; g < end; g += plan.walkers) {
        add_group<T, V>(load_group<T, V>(base + bias_grad_offset(plan, index)), sum);
        bias_grad_advance(plan, index);
      }
    }
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  // Walkers of one lane sit `lanes` apart: combine them in a fixed tree.
  for (int half = plan.walkers / 2; half > 0; half /= 2) {
    if (walker < half) partial[threadIdx.x] += partial[threadIdx.x + half * plan.lanes];
    __syncthreads();
  }
  if (walker != 0 || channel >= plan.channels) return;
  if (plan.chunks == 1)
    db[channel * plan.out_stride] = from_compute<T>(partial[threadIdx.x]);
  else
    chunk_sums[channel * plan.chunks + chunk] = partial[threadIdx.x];
}

template <typename T>
__global__ void bias_grad_chunks_kernel(const Compute<T>* chunk_sums, T* db, BiasGradPlan plan) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < plan.channels;
       c += step) {
    Compute<T> sum = 0;
    for (int64_t chunk = 0; chunk < plan.chunks; ++chunk)
      sum += chunk_sums[c * plan.chunks + chunk];
    db[c * plan.out_stride] = from_compute<T>(sum);
  }
}

template <typename T, int V>
cudaError_t bias_grad_of(const BiasGradPlan& plan, const void* dy_data, void* db_data,
                         void* workspace, cudaStream_t stream) {
  const T* dy = static_cast<const T*>(dy_data);
  T* db = static_cast<T*>(db_data);
  Compute<T>* chunk_sums = static_cast<Compute<T>*>(workspace);
  bias_grad_kernel<T, V>
      <<<static_cast<unsigned>(plan.channel_groups * plan.chunks), kBiasGradThreads, 0, stream>>>(
          dy, db, chunk_sums, plan);
  if (plan.chunks == 1) return cudaGetLastError();
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  bias_grad_chunks_kernel<T>
      <<<grid_blocks(plan.channels), kBlockThreads, 0, stream>>>(chunk_sums, db, plan);
  return cudaGetLastError();
}

template <typename T>
cudaError_t bias_grad_typed(const BiasGradPlan& plan, const void* dy, void* db, void* workspace,
                            cudaStream_t stream) {
  constexpr int kVector = kBiasGradVectorBytes / static_cast<int>(sizeof(T));
  if (plan.vector == 1) return bias_grad_of<T, 1>(plan, dy, db, workspace, stream);
  if (plan.vector == kVector) return bias_grad_of<T, kVector>(plan, dy, db, workspace, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_conv_bias_grad(ElementType type, const BiasGradPlan& plan, const void* dy,
                                  void* db, void* workspace, cudaStream_t stream) {
  if (plan.channels == 0) return cudaSuccess;
  const int64_t blocks = plan.channel_groups * plan.chunks;
  if (plan.groups < 0 || plan.lanes * plan.walkers != kBiasGradThreads || blocks > 0x7fffffffLL ||
      (plan.chunks > 1 && workspace == nullptr))
    return cudaErrorInvalidValue;
  switch (type) {
    case ElementType::f32: return bias_grad_typed<float>(plan, dy, db, workspace, stream);
    case ElementType::f64: return bias_grad_typed<double>(plan, dy, db, workspace, stream);
    case ElementType::f16: return bias_grad_typed<__half>(plan, dy, db, workspace, stream);
    case ElementType::bf16: return bias_grad_typed<__nv_bfloat16>(plan, dy, db, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tessera::ops::kernels
