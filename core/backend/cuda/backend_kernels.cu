// Device kernels of the cuda backend: fill, accumulate, scale, convert and the deterministic
// sum (launch interface and arithmetic rules in backend_kernels.cuh). Strided kernels run one
// thread per element over a grid-stride loop and recompute each element's offsets from its flat
// index, so one kernel serves every merged rank up to kMaxBackendDims.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/backend/cuda/backend_kernels.cuh"

namespace tessera::gpu::kernels {

namespace {

constexpr int kThreads = 256;

/// Blocks of a grid-stride launch over `count` items.
unsigned grid_for(int64_t count) {
  return static_cast<unsigned>(
      std::min<int64_t>((count + kThreads - 1) / kThreads, int64_t{65535} * 8));
}

/// Element offsets of flat index `flat` in dst and src.
__device__ inline void offsets_of(const StridedLayout& layout, int64_t flat, int64_t* dst_offset,
                                  int64_t* src_offset) {
  int64_t dst = 0, src = 0;
  for (int d = layout.ndim - 1; d >= 0; --d) {
    const int64_t index = flat % layout.shape[d];
    flat /= layout.shape[d];
    dst += index * layout.dst_strides[d];
    src += index * layout.src_strides[d];
  }
  *dst_offset = dst;
  *src_offset = src;
}

// Element traits: the type arithmetic runs in (Acc) and the conversions to and from it.
template <typename T>
struct Element {
  using Acc = T;
  __device__ static Acc load(T value) { return value; }
  __device__ static T store(Acc value) { return value; }
};
template <>
struct Element<__half> {
  using Acc = float;
  __device__ static float load(__half value) { return __half2float(value); }
  __device__ static __half store(float value) { return __float2half_rn(value); }
};
template <>
struct Element<__nv_bfloat16> {
  using Acc = float;
  __device__ static float load(__nv_bfloat16 value) { return __bfloat162float(value); }
  __device__ static __nv_bfloat16 store(float value) { return __float2bfloat16_rn(value); }
};

template <typename T>
constexpr bool is_half_v = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

/// Calls fn(T{}) with T the device type of `kind`.
template <typename Fn>
cudaError_t dispatch(ElementKind kind, Fn&& fn) {
  switch (kind) {
    case ElementKind::f32: fn(float{}); break;
    case ElementKind::f64: fn(double{}); break;
    case ElementKind::f16: fn(__half{}); break;
    case ElementKind::bf16: fn(__nv_bfloat16{}); break;
    case ElementKind::i32: fn(int32_t{}); break;
    case ElementKind::i64: fn(int64_t{}); break;
    case ElementKind::u8: fn(uint8_t{}); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// ---- fill ---------------------------------------------------------------------------------

template <typename Word>
__global__ void fill_kernel(Word* dst, StridedLayout layout, Word value) {
  for (int64_t flat = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       flat < layout.count; flat += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t dst_offset, src_offset;
    offsets_of(layout, flat, &dst_offset, &src_offset);
    dst[dst_offset] = value;
  }
}

template <typename Word>
void launch_fill_words(void* dst, const StridedLayout& layout, const uint64_t pattern[2],
                       cudaStream_t stream) {
  Word value;
  static_assert(sizeof(Word) <= 16, "fill words are at most 16 bytes");
  std::memcpy(&value, pattern, sizeof(Word));
  fill_kernel<Word>
      <<<grid_for(layout.count), kThreads, 0, stream>>>(static_cast<Word*>(dst), layout, value);
}

// ---- accumulate ---------------------------------------------------------------------------

template <typename T>
__global__ void accumulate_kernel(T* dst, const T* src, StridedLayout layout, CombineKind combine) {
  using Acc = typename Element<T>::Acc;
  for (int64_t flat = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       flat < layout.count; flat += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t dst_offset, src_offset;
    offsets_of(layout, flat, &dst_offset, &src_offset);
    const Acc x = Element<T>::load(dst[dst_offset]);
    const Acc y = Element<T>::load(src[src_offset]);
    Acc result;
    switch (combine) {
      case CombineKind::sum: result = static_cast<Acc>(x + y); break;
      case CombineKind::prod: result = static_cast<Acc>(x * y); break;
      case CombineKind::max: result = (x < y) ? y : x; break;
      default: result = (y < x) ? y : x; break;
    }
    dst[dst_offset] = Element<T>::store(result);
  }
}

// ---- scale --------------------------------------------------------------------------------

template <typename T>
__global__ void scale_kernel(T* dst, StridedLayout layout, double factor) {
  // f16/bf16 and f32 multiply in float, f64 in double, integers in double then round toward
  // zero (as the cpu backend does).
  const float factor_float = static_cast<float>(factor);
  for (int64_t flat = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       flat < layout.count; flat += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t dst_offset, src_offset;
    offsets_of(layout, flat, &dst_offset, &src_offset);
    T& element = dst[dst_offset];
    if constexpr (is_half_v<T>)
      element = Element<T>::store(Element<T>::load(element) * factor_float);
    else if constexpr (std::is_same_v<T, float>)
      element = element * factor_float;
    else if constexpr (std::is_same_v<T, double>)
      element = element * factor;
    else
      element = static_cast<T>(static_cast<double>(element) * factor);
  }
}

// ---- convert ------------------------------------------------------------------------------

template <typename To, typename From>
__device__ inline To convert_element(From value) {
  if constexpr (is_half_v<To>)
    return Element<To>::store(static_cast<float>(Element<From>::load(value)));
  else if constexpr (is_half_v<From>)
    return static_cast<To>(Element<From>::load(value));
  else
    return static_cast<To>(value);
}

template <typename To, typename From>
__global__ void convert_kernel(To* dst, const From* src, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = convert_element<To>(src[i]);
}

// ---- deterministic sum --------------------------------------------------------------------

/// Tree reduction of `values[0..blockDim.x)` in shared memory (blockDim.x a power of two);
/// the result lands in values[0]. The pairing is fixed, so the order is too.
__device__ inline void tree_reduce(double* values) {
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.x < half) values[threadIdx.x] += values[threadIdx.x + half];
  }
  __syncthreads();
}

template <typename T>
__global__ void sum_partials_kernel(const T* data, int64_t count, int64_t chunk, double* partials) {
  extern __shared__ double values[];
  const int64_t begin = blockIdx.x * chunk;
  const int64_t end = min(count, begin + chunk);
  double sum = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
    sum += static_cast<double>(Element<T>::load(data[i]));
  values[threadIdx.x] = sum;
  tree_reduce(values);
  if (threadIdx.x == 0) partials[blockIdx.x] = values[0];
}

__global__ void sum_final_kernel(double* partials, int partial_count) {
  extern __shared__ double values[];
  double sum = 0.0;
  for (int i = threadIdx.x; i < partial_count; i += blockDim.x) sum += partials[i];
  values[threadIdx.x] = sum;
  tree_reduce(values);
  if (threadIdx.x == 0) partials[partial_count] = values[0];
}

}  // namespace

cudaError_t launch_fill(void* dst, const StridedLayout& layout, size_t word_bytes,
                        const uint64_t pattern[2], cudaStream_t stream) {
  if (layout.count == 0) return cudaSuccess;
  switch (word_bytes) {
    case 1: launch_fill_words<uint8_t>(dst, layout, pattern, stream); break;
    case 2: launch_fill_words<uint16_t>(dst, layout, pattern, stream); break;
    case 4: launch_fill_words<uint32_t>(dst, layout, pattern, stream); break;
    case 8: launch_fill_words<uint64_t>(dst, layout, pattern, stream); break;
    case 16: launch_fill_words<uint4>(dst, layout, pattern, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_accumulate(void* dst, const void* src, const StridedLayout& layout,
                              ElementKind kind, CombineKind combine, cudaStream_t stream) {
  if (layout.count == 0) return cudaSuccess;
  return dispatch(kind, [&](auto tag) {
    using T = decltype(tag);
    accumulate_kernel<T><<<grid_for(layout.count), kThreads, 0, stream>>>(
        static_cast<T*>(dst), static_cast<const T*>(src), layout, combine);
  });
}

cudaError_t launch_scale(void* dst, const StridedLayout& layout, ElementKind kind, double factor,
                         cudaStream_t stream) {
  if (layout.count == 0) return cudaSuccess;
  return dispatch(kind, [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<T>
        <<<grid_for(layout.count), kThreads, 0, stream>>>(static_cast<T*>(dst), layout, factor);
  });
}

cudaError_t launch_convert(void* dst, ElementKind dst_kind, const void* src, ElementKind src_kind,
                           int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  cudaError_t source_status = cudaSuccess;
  const cudaError_t status = dispatch(dst_kind, [&](auto to_tag) {
    using To = decltype(to_tag);
    source_status = dispatch(src_kind, [&](auto from_tag) {
      using From = decltype(from_tag);
      convert_kernel<To, From><<<grid_for(count), kThreads, 0, stream>>>(
          static_cast<To*>(dst), static_cast<const From*>(src), count);
    });
  });
  return source_status != cudaSuccess ? source_status : status;
}

cudaError_t launch_sum(const void* data, int64_t count, ElementKind kind, int partial_count,
                       int threads, double* workspace, cudaStream_t stream) {
  if (partial_count < 1 || threads < 1 || threads > 1024 || (threads & (threads - 1)) != 0)
    return cudaErrorInvalidValue;
  const int64_t chunk = std::max<int64_t>((count + partial_count - 1) / partial_count, 1);
  const size_t shared = sizeof(double) * static_cast<size_t>(threads);
  const cudaError_t status = dispatch(kind, [&](auto tag) {
    using T = decltype(tag);
    sum_partials_kernel<T><<<static_cast<unsigned>(partial_count), threads, shared, stream>>>(
        static_cast<const T*>(data), count, chunk, workspace);
  });
  if (status != cudaSuccess) return status;
  sum_final_kernel<<<1, threads, shared, stream>>>(workspace, partial_count);
  return cudaGetLastError();
}

}  // namespace tessera::gpu::kernels
