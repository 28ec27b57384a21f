// Building blocks of the register-tiled (mma) kernels of neighborhood attention, shared by the
// forward (na_cuda_mma.cu) and the backward (na_cuda_mma_backward.cu): the warp-level primitives
// (cp.async copies, ldmatrix loads, mma.sync m16n8k16, packing two values into a register),
// the shared-memory layout and the per-lane query rows.
//
// The primitives are the only device instructions the kernels use besides threadIdx, blockIdx,
// __syncthreads and __shfl_xor_sync. With TESSERA_NA_EMULATE defined, tests/emu/ supplies host
// versions of all of them (following the PTX ISA's definitions), so the same kernel source runs
// on the cpu, one block of emulated threads at a time, in the unit tests.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ops/attention/na_cuda_plan.hpp"

#if defined(TESSERA_NA_EMULATE)
// The emulator defines TESSERA_NA_MMA, TESSERA_NA_DYNAMIC_SHARED and the primitives.
#else
// mma.sync on bf16, ldmatrix and cp.async need sm_80 or newer (the build targets sm_90); on an
// older architecture the kernels' bodies trap (the dispatch never picks them on such a device).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TESSERA_NA_MMA 1
#else
#define TESSERA_NA_MMA 0
#endif
/// The block's dynamic shared memory, as bytes.
#define TESSERA_NA_DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif

namespace tessera::ops::kernels::mma_detail {
constexpr int kWarp = 32;
/// Warps per block, each owning 16 query rows of the tile.
constexpr int kMmaWarps = kFusedQueries / 16;
/// Keys per streamed chunk: 8 n-tiles of S per warp.
constexpr int kMmaKeys = 64;
/// Chunks in flight.
constexpr int kStages = 2;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = __builtin_huge_valf();

/// Shared memory for head dim D: the Q tile, kStages chunks of K and of V (rows padded by 8
/// elements: 16-byte aligned rows whose ldmatrix phases hit 8 distinct 16-byte bank groups), the
/// chunks' key coordinates (int4: 3 global coordinates, the 4th unused; -1 for keys past the box),
/// and the tile's local flat query positions (-1: outside the piece).
template <int D>
struct MmaLayout {
  static constexpr int ld = D + 8;
  static constexpr size_t q_bytes = size_t(kFusedQueries) * ld * 2;
  static constexpr size_t kv_bytes = size_t(kMmaKeys) * ld * 2;
  static constexpr size_t key_bytes = size_t(kMmaKeys) * 16;
  static constexpr size_t k_at = q_bytes, v_at = k_at + kStages * kv_bytes,
                          key_at = v_at + kStages * kv_bytes,
                          flat_at = key_at + kStages * key_bytes,
                          bytes = flat_at + size_t(kFusedQueries) * 8;
  static_assert(k_at % 16 == 0 && v_at % 16 == 0 && key_at % 16 == 0 && flat_at % 16 == 0,
                "the regions must stay 16-byte aligned");
};

/// An element widened to float.
__device__ __forceinline__ float widen(__nv_bfloat16 value) {
  return __bfloat162float(value);
}
__device__ __forceinline__ float widen(__half value) {
  return __half2float(value);
}

/// Two values rounded to T and packed into one register, the first in the low half.
__device__ __forceinline__ uint32_t pack(float low, float high, __nv_bfloat16) {
  const __nv_bfloat162 value = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&value);
}
__device__ __forceinline__ uint32_t pack(float low, float high, __half) {
  const __half2 value = __floats2half2_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&value);
}

/// Splits a flat index over extents e0, e1, e2 (last fastest).
__device__ __forceinline__ void split_flat(int64_t flat, int64_t e0, int64_t e1, int64_t e2,
                                           int64_t out[3]) {
  (void)e0;
  out[2] = flat % e2;
  flat /= e2;
  out[1] = flat % e1;
  out[0] = flat / e1;
}

/// Whether the window [first, end) per axis holds key `at` (global coordinates; with `dilated`,
/// only keys of the window's dilation group, `dilation` per axis).
__device__ __forceinline__ bool window_holds(const int first[3], const int end[3], const int at[3],
                                             bool dilated, const int dilation[3]) {
  bool hit = true;
#pragma unroll
  for (int a = 0; a < 3; ++a) hit = hit && at[a] >= first[a] && at[a] < end[a];
  if (dilated) {
#pragma unroll
    for (int a = 0; a < 3; ++a) hit = hit && (at[a] - first[a]) % dilation[a] == 0;
  }
  return hit;
}

/// The entry of one head's bias table for query `query` and key `key` of its window:
/// (k - 1) + (key - query) / dilation per axis, over extents 2k - 1.
__device__ __forceinline__ int bias_entry(const int query[3], const int key[3], const int kernel[3],
                                          const int dilation[3]) {
  int index = 0;
#pragma unroll
  for (int a = 0; a < 3; ++a)
    index = index * (2 * kernel[a] - 1) + kernel[a] - 1 + (key[a] - query[a]) / dilation[a];
  return index;
}

/// Whether n-tile j (8 columns) of a warp's 16 x N block has a live element: `live` is the or
/// over the warp of each lane's hit bits, bit 4j + 2 half + e for row group + 8 half and column
/// 8j + 2 quad + e.
__device__ __forceinline__ bool tile_live(unsigned live, int j) {
  return (live >> (4 * j) & 0xFu) != 0;
}

/// One query row a lane holds: its window per axis as [first, end) in global coordinates (empty
/// for a row outside the piece) and its global coordinates.
struct Row {
  int first[3], end[3], at[3];
};

#if !defined(TESSERA_NA_EMULATE)
__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

/// 16 bytes from global to shared memory, asynchronously; zeros when !valid (nothing is read).
__device__ __forceinline__ void copy_async(void* shared, const void* global, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)),
               "l"(global), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void commit_async() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
/// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wait_async() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/// Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void load_matrices(uint32_t r[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}
/// The same, each matrix transposed.
__device__ __forceinline__ void load_matrices_transposed(uint32_t r[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}

/// c += a b for one m16n8k16 tile (a: 4 registers of the row-major A fragment, b: 2 of the
/// column-major B fragment, c: the f32 accumulator).
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1,
                                    __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1,
                                    __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

}  // namespace tessera::ops::kernels::mma_detail
