// Device code of the deterministic reductions. Short reductions (or very many outputs): one
// thread per output walks the reduced indices in row-major order. Long ones: one block per
// (output, chunk) where each thread adds a fixed strided subset and the block combines them in
// a fixed tree, then one thread per output adds the chunk sums in order. The split comes from
// the plan (a function of the shapes), so the order never depends on timing.
#include <cstdint>

#include "ops/cuda_elements.cuh"
#include "ops/reduce/reduce_cuda.cuh"

namespace tessera::ops::kernels {

namespace {

/// Offsets (operands and output) of kept index `o`.
__device__ __forceinline__ void kept_offsets(const ReducePlan& plan, int64_t o, int64_t* operand,
                                             int64_t& out) {
  operand[0] = operand[1] = out = 0;
  for (int d = plan.kept_ndim - 1; d >= 0; --d) {
    const int64_t index = o % plan.kept_extent[d];
    o /= plan.kept_extent[d];
    operand[0] += index * plan.kept_stride[0][d];
    operand[1] += index * plan.kept_stride[1][d];
    out += index * plan.out_stride[d];
  }
}

/// The reduced element `r` (row-major over the reduced dims) at operand bases `base`.
template <typename T, ReduceLoad L>
__device__ __forceinline__ Compute<T> load_reduced(const ReducePlan& plan, const T* a, const T* b,
                                                   const int64_t* base, int64_t r) {
  int64_t offset_a = base[0], offset_b = base[1];
  for (int d = plan.reduced_ndim - 1; d >= 0; --d) {
    const int64_t index = r % plan.reduced_extent[d];
    r /= plan.reduced_extent[d];
    offset_a += index * plan.reduced_stride[0][d];
    offset_b += index * plan.reduced_stride[1][d];
  }
  if constexpr (L == ReduceLoad::value) {
    return to_compute(a[offset_a]);
  } else {
    const Compute<T> difference = to_compute(a[offset_a]) - to_compute(b[offset_b]);
    return difference * difference;
  }
}

template <typename T, ReduceLoad L>
__global__ void reduce_thread_kernel(const T* a, const T* b, T* out, ReducePlan plan,
                                     Compute<T> scale) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t o = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; o < plan.outputs;
       o += step) {
    int64_t base[2], out_offset;
    kept_offsets(plan, o, base, out_offset);
    Compute<T> sum = 0;
    for (int64_t r = 0; r < plan.reduce_count; ++r) sum += load_reduced<T, L>(plan, a, b, base, r);
    out[out_offset] = from_compute<T>(sum * scale);
  }
}

template <typename T, ReduceLoad L>
__global__ void reduce_block_kernel(const T* a, const T* b, T* out, Compute<T>* chunk_sums,
                                    ReducePlan plan, Compute<T> scale) {
  __shared__ Compute<T> partial[kBlockThreads];
  const int64_t o = blockIdx.x / plan.chunks, chunk = blockIdx.x % plan.chunks;
  int64_t base[2], out_offset;
  kept_offsets(plan, o, base, out_offset);
  const int64_t begin = chunk * plan.chunk_length;
  const int64_t end =
      begin + plan.chunk_length < plan.reduce_count ? begin + plan.chunk_length : plan.reduce_count;
  Compute<T> sum = 0;
  for (int64_t r = begin + threadIdx.x; r < end; r += kBlockThreads)
    sum += load_reduced<T, L>(plan, a, b, base, r);
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kBlockThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  if (plan.chunks == 1)
    out[out_offset] = from_compute<T>(partial[0] * scale);
  else
    chunk_sums[o * plan.chunks + chunk] = partial[0];
}

template <typename T>
__global__ void reduce_chunks_kernel(const Compute<T>* chunk_sums, T* out, ReducePlan plan,
                                     Compute<T> scale) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t o = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; o < plan.outputs;
       o += step) {
    int64_t base[2], out_offset;
    kept_offsets(plan, o, base, out_offset);
    Compute<T> sum = 0;
    for (int64_t chunk = 0; chunk < plan.chunks; ++chunk)
      sum += chunk_sums[o * plan.chunks + chunk];
    out[out_offset] = from_compute<T>(sum * scale);
  }
}

template <typename T, ReduceLoad L>
cudaError_t reduce_of(const ReducePlan& plan, const void* a_data, const void* b_data,
                      void* out_data, void* workspace, double scale_value, cudaStream_t stream) {
  if (plan.outputs == 0) return cudaSuccess;
  const T* a = static_cast<const T*>(a_data);
  const T* b = static_cast<const T*>(L == ReduceLoad::value ? a_data : b_data);
  T* out = static_cast<T*>(out_data);
  const Compute<T> scale = static_cast<Compute<T>>(scale_value);
  if (plan.strategy == ReduceStrategy::thread_per_output) {
    reduce_thread_kernel<T, L>
        <<<grid_blocks(plan.outputs), kBlockThreads, 0, stream>>>(a, b, out, plan, scale);
    return cudaGetLastError();
  }
  const int64_t blocks = plan.outputs * plan.chunks;
  if (plan.threads != kBlockThreads || blocks > 0x7fffffffLL ||
      (plan.chunks > 1 && workspace == nullptr))
    return cudaErrorInvalidValue;
  Compute<T>* chunk_sums = static_cast<Compute<T>*>(workspace);
  reduce_block_kernel<T, L><<<static_cast<unsigned>(blocks), kBlockThreads, 0, stream>>>(
      a, b, out, chunk_sums, plan, scale);
  if (plan.chunks > 1) {
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
    reduce_chunks_kernel<T>
        <<<grid_blocks(plan.outputs), kBlockThreads, 0, stream>>>(chunk_sums, out, plan, scale);
  }
  return cudaGetLastError();
}

template <ReduceLoad L>
cudaError_t reduce_typed(ElementType type, const ReducePlan& plan, const void* a, const void* b,
                         void* out, void* workspace, double scale, cudaStream_t stream) {
  switch (type) {
    case ElementType::f32: return reduce_of<float, L>(plan, a, b, out, workspace, scale, stream);
    case ElementType::f64: return reduce_of<double, L>(plan, a, b, out, workspace, scale, stream);
    case ElementType::f16: return reduce_of<__half, L>(plan, a, b, out, workspace, scale, stream);
    case ElementType::bf16:
      return reduce_of<__nv_bfloat16, L>(plan, a, b, out, workspace, scale, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_reduce(ElementType type, const ReducePlan& plan, ReduceLoad load, const void* a,
                          const void* b, void* out, void* workspace, double scale,
                          cudaStream_t stream) {
  if (load == ReduceLoad::squared_difference && plan.operands != 2) return cudaErrorInvalidValue;
  return load == ReduceLoad::value
             ? reduce_typed<ReduceLoad::value>(type, plan, a, b, out, workspace, scale, stream)
             : reduce_typed<ReduceLoad::squared_difference>(type, plan, a, b, out, workspace, scale,
                                                            stream);
}

}  // namespace tessera::ops::kernels
