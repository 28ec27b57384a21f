// Device-side element helpers of the op kernels (C++17, device code only): the computation
// type of each element type (float for f32, f16 and bf16; double for f64) and conversions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace tessera::ops::kernels {

/// The type elements of T are computed (and accumulated) in.
template <typename T>
struct ComputeOf {
  using type = float;
};
template <>
struct ComputeOf<double> {
  using type = double;
};
template <typename T>
using Compute = typename ComputeOf<T>::type;

/// Widens an element to its computation type.
__device__ __forceinline__ float to_compute(float value) {
  return value;
}
__device__ __forceinline__ double to_compute(double value) {
  return value;
}
__device__ __forceinline__ float to_compute(__half value) {
  return __half2float(value);
}
__device__ __forceinline__ float to_compute(__nv_bfloat16 value) {
  return __bfloat162float(value);
}

/// Rounds a computed value to the element type (round to nearest even).
template <typename T>
__device__ __forceinline__ T from_compute(Compute<T> value);
template <>
__device__ __forceinline__ float from_compute<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ double from_compute<double>(double value) {
  return value;
}
template <>
__device__ __forceinline__ __half from_compute<__half>(float value) {
  return __float2half_rn(value);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_compute<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

/// Threads per block of the elementwise and reduction kernels.
constexpr int kBlockThreads = 256;
/// Most blocks of a grid-stride elementwise launch.
constexpr long long kMaxGridBlocks = 65535LL * 8;

/// Blocks for `work` items of one thread each, capped (the kernels loop over the rest).
inline unsigned grid_blocks(long long work) {
  long long blocks = (work + kBlockThreads - 1) / kBlockThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxGridBlocks) blocks = kMaxGridBlocks;
  return static_cast<unsigned>(blocks);
}

}  // namespace tessera::ops::kernels
