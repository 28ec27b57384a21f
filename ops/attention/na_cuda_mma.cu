// The register-tiled forward of neighborhood attention (f16/bf16, head dim 32, 64 or 128; NATTEN
// semantics, see docs/neighborhood-attention.md).
//
// One block of 4 warps per tile of 64 queries (1-d 64, 2-d 8x8, 3-d 4x4x4, as the fused kernel);
// each warp owns 16 query rows. The union of the tile's windows (its key box) is streamed through
// shared memory 64 keys at a time, two chunks in flight (cp.async: the next chunk's K, V and key
// coordinates load while this one is computed). Per chunk and warp:
//  - S = Q K^T on mma.sync m16n8k16 (f32 accumulation): Q's fragments stay in registers for the
//    whole tile, K's come from shared memory through ldmatrix;
//  - the window mask (and the bias) applied to S in registers, in the log2 domain; the online
//    softmax's row maximum reduced over the 4 lanes that hold a row;
//  - P rounded to the element type straight from S's accumulators (an m16n8 accumulator pair is
//    an m16k16 A fragment), and O += P V with V's fragments through ldmatrix.trans.
// O and each row's running maximum and sum never leave registers; S and P never reach shared
// memory. At the end o = O / l and lse = m + log l (natural log) are written for the tile's
// queries inside the piece. The backward (fused or plain) reads this lse as it reads the fused
// forward's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ops/attention/na_cuda.cuh"
#include "ops/cuda_elements.cuh"

// mma.sync on bf16, ldmatrix and cp.async need sm_80 or newer (the build targets sm_90); on an
// older architecture the kernel's body traps (the dispatch never picks it on such a device).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TESSERA_NA_MMA 1
#else
#define TESSERA_NA_MMA 0
#endif

namespace tessera::ops::kernels {

namespace {

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

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

#if TESSERA_NA_MMA
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

/// One query row a lane holds: its window per axis as [first, end) in global coordinates (empty
/// for a row outside the piece) and its global coordinates.
struct Row {
  int first[3], end[3], at[3];
};

template <typename T, int D>
__global__ void __launch_bounds__(kMmaWarps* kWarp)
    mma_forward(NaCall c, NaTileShape tile, const T* q, const T* k, const T* v, const T* rpb, T* o,
                float* lse) {
#if TESSERA_NA_MMA
  using L = MmaLayout<D>;
  constexpr int kVector = 8;  // elements per 16-byte copy
  constexpr int kRowVectors = D / kVector;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  long long* q_flat = reinterpret_cast<long long*>(smem + L::flat_at);
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int group = lane / 4, quad = lane % 4;  // the mma fragments' row group and column pair
  const int64_t h = blockIdx.y % c.heads, b = blockIdx.y / c.heads;
  const int64_t token_stride = c.heads * c.dim;

  // The tile's corner, and its key box: per axis the union [lo, lo + box) of its windows.
  int64_t corner[3], lo[3], box[3], volume = 1;
  {
    int64_t tiles[3], coords[3];
#pragma unroll
    for (int a = 0; a < 3; ++a)
      tiles[a] = (c.axes[a].queries + tile.extent[a] - 1) / tile.extent[a];
    split_flat(blockIdx.x, tiles[0], tiles[1], tiles[2], coords);
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      corner[a] = coords[a] * tile.extent[a];
      const int64_t first = c.axes[a].query_offset + corner[a];
      const int64_t end_local = c.axes[a].query_offset + c.axes[a].queries;
      const int64_t last = first + tile.extent[a] < end_local ? first + tile.extent[a] : end_local;
      int64_t hi;
      na_axis_key_range(c.axes[a], first, last, lo[a], hi);
      box[a] = hi - lo[a];
      volume *= box[a];
    }
  }
  // Tile row r (0..63): its query's local offsets per axis, and whether it is inside the piece.
  auto tile_row = [&](int r, int64_t i[3]) {
    int64_t t[3];
    split_flat(r, tile.extent[0], tile.extent[1], tile.extent[2], t);
    bool valid = true;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      valid = valid && corner[a] + t[a] < c.axes[a].queries;
      i[a] = c.axes[a].query_offset + corner[a] + t[a];
    }
    return valid;
  };
  if (tid < kFusedQueries) {
    int64_t i[3];
    const bool valid = tile_row(tid, i);
    long long flat = 0;
#pragma unroll
    for (int a = 0; a < 3; ++a) flat = flat * c.axes[a].queries + (i[a] - c.axes[a].query_offset);
    q_flat[tid] = valid ? flat : -1;
  }
  // This lane's two rows: warp * 16 + group and 8 rows further.
  Row rows[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int64_t i[3];
    const bool valid = tile_row(warp * 16 + group + 8 * half, i);
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      const NaSpan w = na_axis_window(c.axes[a], i[a]);
      rows[half].first[a] = valid ? static_cast<int>(w.first) : 0;
      rows[half].end[a] = valid ? static_cast<int>(w.end()) : 0;
      rows[half].at[a] = static_cast<int>(i[a]);
    }
  }
  const bool dilated = c.axes[0].dilation > 1 || c.axes[1].dilation > 1 || c.axes[2].dilation > 1;
  const int dilation[3] = {static_cast<int>(c.axes[0].dilation),
                           static_cast<int>(c.axes[1].dilation),
                           static_cast<int>(c.axes[2].dilation)};
  const T* rpb_head = c.has_rpb ? rpb + h * c.rpb_count() : nullptr;
  const int rpb_extent[3] = {static_cast<int>(c.rpb_extent(0)), static_cast<int>(c.rpb_extent(1)),
                             static_cast<int>(c.rpb_extent(2))};
  const int kernel[3] = {static_cast<int>(c.axes[0].kernel), static_cast<int>(c.axes[1].kernel),
                         static_cast<int>(c.axes[2].kernel)};
  const float scale_log2 = static_cast<float>(c.scale) * kLog2e;
  __syncthreads();  // q_flat

  // The Q tile (zero rows outside the piece): the first group of copies.
  for (int index = tid; index < kFusedQueries * kRowVectors; index += kMmaWarps * kWarp) {
    const int r = index / kRowVectors, col = index % kRowVectors * kVector;
    const bool valid = q_flat[r] >= 0;
    const T* source = valid ? q + ((b * c.query_count() + q_flat[r]) * c.heads + h) * c.dim + col : q;
    copy_async(qs + r * L::ld + col, source, valid);
  }

  // Chunk `chunk` of the box (keys chunk * 64 ..) into stage `stage`: K and V rows (zeros past the
  // box) and the keys' coordinates.
  auto load_chunk = [&](int64_t chunk, int stage) {
    const int64_t first_key = chunk * kMmaKeys;
    T* ks = reinterpret_cast<T*>(smem + L::k_at + stage * L::kv_bytes);
    T* vs = reinterpret_cast<T*>(smem + L::v_at + stage * L::kv_bytes);
    for (int index = tid; index < kMmaKeys * kRowVectors; index += kMmaWarps * kWarp) {
      const int row = index / kRowVectors, col = index % kRowVectors * kVector;
      const bool valid = first_key + row < volume;
      int64_t at = 0;
      if (valid) {
        int64_t j[3];
        split_flat(first_key + row, box[0], box[1], box[2], j);
        int64_t position = 0;
#pragma unroll
        for (int a = 0; a < 3; ++a)
          position = position * c.axes[a].tile + (lo[a] + j[a] - c.axes[a].tile_offset);
        at = (b * c.tile_count() + position) * token_stride + h * c.dim + col;
      }
      copy_async(ks + row * L::ld + col, k + at, valid);
      copy_async(vs + row * L::ld + col, v + at, valid);
    }
    if (tid < kMmaKeys) {
      int4* keys = reinterpret_cast<int4*>(smem + L::key_at + stage * L::key_bytes);
      int4 key = make_int4(-1, -1, -1, 0);
      if (first_key + tid < volume) {
        int64_t j[3];
        split_flat(first_key + tid, box[0], box[1], box[2], j);
        key = make_int4(static_cast<int>(lo[0] + j[0]), static_cast<int>(lo[1] + j[1]),
                        static_cast<int>(lo[2] + j[2]), 0);
      }
      keys[tid] = key;
    }
  };

  const int64_t chunks = (volume + kMmaKeys - 1) / kMmaKeys;
  if (chunks > 0) load_chunk(0, 0);
  commit_async();

  uint32_t qf[D / 16][4];  // Q's A fragments, one per 16 elements of the head dim
  float acc[D / 8][4];     // O: 8 columns of the head dim per accumulator
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};  // log2 domain; this lane's sum

  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int stage = static_cast<int>(chunk % kStages);
    if (chunk + 1 < chunks) {
      load_chunk(chunk + 1, (stage + 1) % kStages);
      commit_async();
      wait_async<1>();
    } else {
      wait_async<0>();
    }
    __syncthreads();
    if (chunk == 0) {
      // A fragment of rows warp*16.., columns 16s..: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15).
#pragma unroll
      for (int s = 0; s < D / 16; ++s)
        load_matrices(qf[s], qs + (warp * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * L::ld + 16 * s +
                                 8 * (lane / 16));
    }
    const T* ks = reinterpret_cast<const T*>(smem + L::k_at + stage * L::kv_bytes);
    const T* vs = reinterpret_cast<const T*>(smem + L::v_at + stage * L::kv_bytes);
    const int4* keys = reinterpret_cast<const int4*>(smem + L::key_at + stage * L::key_bytes);

    // S = Q K^T: n-tile j holds keys 8j..8j+7; B fragments of two k-steps per ldmatrix.x4
    // (matrix m: keys 8j + 0..7, head-dim columns 32p + 8m ..).
    float s[kMmaKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kMmaKeys / 8; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int p = 0; p < D / 32; ++p) {
        uint32_t kf[4];
        load_matrices(kf, ks + (8 * j + lane % 8) * L::ld + 32 * p + 8 * (lane / 8));
        mma(s[j], qf[2 * p], kf[0], kf[1], T{});
        mma(s[j], qf[2 * p + 1], kf[2], kf[3], T{});
      }
    }

    // The mask, scale and bias: s[j][2 * half + e] is row group + 8 * half, key 8j + 2 quad + e.
    float chunk_max[2] = {-kInf, -kInf};
#pragma unroll
    for (int j = 0; j < kMmaKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int4 key = keys[8 * j + 2 * quad + e];
        const int at[3] = {key.x, key.y, key.z};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const Row& row = rows[half];
          bool hit = true;
#pragma unroll
          for (int a = 0; a < 3; ++a) hit = hit && at[a] >= row.first[a] && at[a] < row.end[a];
          if (dilated) {
#pragma unroll
            for (int a = 0; a < 3; ++a) hit = hit && (at[a] - row.first[a]) % dilation[a] == 0;
          }
          float x = -kInf;
          if (hit) {
            x = s[j][2 * half + e] * scale_log2;
            if (rpb_head) {
              int index = 0;
#pragma unroll
              for (int a = 0; a < 3; ++a)
                index = index * rpb_extent[a] + kernel[a] - 1 + (at[a] - row.at[a]) / dilation[a];
              x += to_compute(rpb_head[index]) * kLog2e;
            }
          }
          s[j][2 * half + e] = x;
          chunk_max[half] = fmaxf(chunk_max[half], x);
        }
      }
    }

    // The online softmax: the rows' maxima over their 4 lanes, the rescale of O and of the sums.
    float alpha[2], next_max[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = chunk_max[half];
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      next_max[half] = fmaxf(row_max[half], m);
      // A row with no key so far keeps -inf: nothing to rescale, every p of it 0.
      alpha[half] = next_max[half] == -kInf ? 1.0f : exp2f(row_max[half] - next_max[half]);
      row_max[half] = next_max[half];
      row_sum[half] *= alpha[half];
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }
#pragma unroll
    for (int j = 0; j < kMmaKeys / 8; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2;
        const float p = next_max[half] == -kInf ? 0.0f : exp2f(s[j][i] - next_max[half]);
        s[j][i] = p;
        row_sum[half] += p;
      }
    }

    // O += P V: k-step t takes keys 16t..16t+15, whose A fragment is S's n-tiles 2t and 2t+1;
    // V's B fragments for head-dim n-tiles n and n+1 in one ldmatrix.x4.trans (matrix m: keys
    // 16t + 8 (m % 2) + 0..7, columns 8n + 8 (m / 2) ..).
#pragma unroll
    for (int t = 0; t < kMmaKeys / 16; ++t) {
      uint32_t pf[4];
      pf[0] = pack(s[2 * t][0], s[2 * t][1], T{});
      pf[1] = pack(s[2 * t][2], s[2 * t][3], T{});
      pf[2] = pack(s[2 * t + 1][0], s[2 * t + 1][1], T{});
      pf[3] = pack(s[2 * t + 1][2], s[2 * t + 1][3], T{});
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t vf[4];
        load_matrices_transposed(
            vf, vs + (16 * t + lane % 8 + 8 * ((lane / 8) % 2)) * L::ld + 8 * n + 8 * (lane / 16));
        mma(acc[n], pf, vf[0], vf[1], T{});
        mma(acc[n + 1], pf, vf[2], vf[3], T{});
      }
    }
    __syncthreads();  // this stage is free for the chunk after next
  }

  // o = O / l and lse = m ln 2 + ln l for the rows inside the piece.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const long long flat = q_flat[warp * 16 + group + 8 * half];
    if (flat < 0 || sum <= 0.0f) continue;
    const int64_t row = (b * c.query_count() + flat) * c.heads + h;
    const float inverse = 1.0f / sum;
    T* out = o + row * c.dim + 2 * quad;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(out + 8 * n) =
          pack(acc[n][2 * half] * inverse, acc[n][2 * half + 1] * inverse, T{});
    if (quad == 0) lse[row] = row_max[half] * kLn2 + logf(sum);
  }
#else
  __trap();
#endif
}

template <typename T, int D>
cudaError_t launch_dim(const NaCall& call, const NaForwardArgs& args, cudaStream_t stream) {
  NaTileShape tile{};
  na_fused_tile_shape(call.spatial, tile.extent);
  int64_t tiles = 1;
  for (int a = 0; a < 3; ++a) tiles *= (call.axes[a].queries + tile.extent[a] - 1) / tile.extent[a];
  if (tiles == 0 || call.batch * call.heads == 0) return cudaSuccess;
  const size_t bytes = MmaLayout<D>::bytes;
  const cudaError_t status = cudaFuncSetAttribute(
      mma_forward<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(call.batch * call.heads));
  mma_forward<T, D><<<grid, kMmaWarps * kWarp, bytes, stream>>>(
      call, tile, static_cast<const T*>(args.q), static_cast<const T*>(args.k),
      static_cast<const T*>(args.v), static_cast<const T*>(args.rpb), static_cast<T*>(args.o),
      static_cast<float*>(args.lse));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const NaCall& call, const NaForwardArgs& args, cudaStream_t stream) {
  switch (call.dim) {
    case 32: return launch_dim<T, 32>(call, args, stream);
    case 64: return launch_dim<T, 64>(call, args, stream);
    case 128: return launch_dim<T, 128>(call, args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_na_forward_mma(const NaCall& call, ElementType type, const NaForwardArgs& args,
                                  cudaStream_t stream) {
  switch (type) {
    case ElementType::f16: return launch_typed<__half>(call, args, stream);
    case ElementType::bf16: return launch_typed<__nv_bfloat16>(call, args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace tessera::ops::kernels
