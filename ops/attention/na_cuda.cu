// Device code of neighborhood attention (NATTEN semantics, see docs/neighborhood-attention.md).
//
// Plain kernels (any dtype and head dim; the on-device oracle and the fallback), one warp per
// row, the lanes splitting the head dim and every dot product reduced by a butterfly (so every
// lane holds the same bits):
//  - forward: one warp per (query, head): a streaming pass for the row maximum and denominator,
//    then o = sum_j exp(s_j - lse) v_j, kLaneValues * 32 elements of o per pass;
//  - backward, query pass: one warp per (query, head): delta' = sum_j p_j dp_j - glse (kept per
//    row), dq = scale * sum_j ds_j k_j with ds_j = p_j (dp_j - delta');
//  - backward, key pass: one warp per (key of the tile, head) over the queries whose window holds
//    the key (na_axis_inverse_window: an interval of the key's dilation group on every axis):
//    dk = scale * sum ds q, dv = sum p go. Every row is written by one warp in a fixed order, so
//    the backward needs no atomics and is bitwise reproducible;
//  - d rpb: one block per (head, bias entry), its warps taking the queries in a fixed stride and
//    the warps' partial sums added in warp order.
//
// Fused forward (f16/bf16, head dim 32/64/128): one block of 4 warps per tile of 64 queries
// (1-d 64, 2-d 8x8, 3-d 4x4x4), the union of their windows (the tile's key box) streamed through
// shared memory 64 keys at a time; S = Q K^T and O += P V on tensor cores (wmma 16x16x16, f32
// accumulation), the window mask and bias applied to S, an online softmax per query row, the
// attention matrix never leaving shared memory; lse saved for the backward.
//
// Fused backward (same types and head dims): delta' = go . o - glse per row; a query-tile kernel
// for dq over the same key box (S, dP = dO V^T, dS = P (dP - delta'), dQ += dS K) and a key-tile
// kernel for dk and dv over the box of local queries that read the tile (from the inverse
// windows: dV += P^T dO, dK += dS^T Q); d rpb from the plain pass. Each output row is written by
// one block, so this backward has no atomics either.
#include <mma.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "ops/attention/na_cuda.cuh"
#include "ops/cuda_elements.cuh"

// The fused kernels' bf16 tensor-core tiles need sm_80 or newer (the build targets sm_90); for an
// older architecture their bodies trap (the dispatch never picks them on such a device).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TESSERA_NA_TENSOR_CORES 1
#else
#define TESSERA_NA_TENSOR_CORES 0
#endif

namespace tessera::ops::kernels {

namespace {

constexpr int kWarp = 32;
/// Warps per block of the plain row kernels.
constexpr int kRowWarps = 4;
/// Head-dim elements a lane accumulates per pass of the plain kernels (a pass covers 128).
constexpr int kLaneValues = 4;
/// Warps per block of the d rpb reduction.
constexpr int kRpbWarps = 8;

__device__ __forceinline__ float na_exp(float x) {
  return expf(x);
}
__device__ __forceinline__ double na_exp(double x) {
  return exp(x);
}
__device__ __forceinline__ float na_log(float x) {
  return logf(x);
}
__device__ __forceinline__ double na_log(double x) {
  return log(x);
}

/// The sum over the warp, the same bits in every lane (a butterfly adds each pair in both lanes
/// in the same order).
template <typename C>
__device__ __forceinline__ C warp_sum(C value) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

/// a . b over `dim` elements, the lanes taking every 32nd element; every lane gets the sum.
template <typename T>
__device__ Compute<T> warp_dot(const T* a, const T* b, int64_t dim, int lane) {
  Compute<T> sum = 0;
  for (int64_t e = lane; e < dim; e += kWarp) sum += to_compute(a[e]) * to_compute(b[e]);
  return warp_sum(sum);
}

/// Splits a flat index over extents e[0..2] (last fastest).
__device__ __forceinline__ void split3(int64_t flat, const int64_t e0, const int64_t e1,
                                       const int64_t e2, int64_t out[3]) {
  out[2] = flat % e2;
  flat /= e2;
  out[1] = flat % e1;
  out[0] = flat / e1;
}

/// The flat position of global key j in the tile.
__device__ __forceinline__ int64_t tile_position(const NaCall& c, const int64_t j[3]) {
  return ((j[0] - c.axes[0].tile_offset) * c.axes[1].tile + (j[1] - c.axes[1].tile_offset)) *
             c.axes[2].tile +
         (j[2] - c.axes[2].tile_offset);
}

/// The flat local index of global query i.
__device__ __forceinline__ int64_t query_position(const NaCall& c, const int64_t i[3]) {
  return ((i[0] - c.axes[0].query_offset) * c.axes[1].queries + (i[1] - c.axes[1].query_offset)) *
             c.axes[2].queries +
         (i[2] - c.axes[2].query_offset);
}

/// The index of (query i, key j) in one head's bias table: (k-1) + (j-i)/d per axis.
__device__ __forceinline__ int64_t bias_index(const NaCall& c, const int64_t i[3],
                                              const int64_t j[3]) {
  int64_t index = 0;
#pragma unroll
  for (int a = 0; a < 3; ++a)
    index = index * c.rpb_extent(a) + c.axes[a].kernel - 1 + (j[a] - i[a]) / c.axes[a].dilation;
  return index;
}

/// Calls fn(j) for every key j of global query i's window, in window order.
template <typename Fn>
__device__ void for_each_key(const NaCall& c, const int64_t i[3], Fn&& fn) {
  const NaSpan w0 = na_axis_window(c.axes[0], i[0]), w1 = na_axis_window(c.axes[1], i[1]),
               w2 = na_axis_window(c.axes[2], i[2]);
  int64_t j[3];
  for (int64_t t0 = 0; t0 < w0.count; ++t0) {
    j[0] = w0.first + t0 * w0.step;
    for (int64_t t1 = 0; t1 < w1.count; ++t1) {
      j[1] = w1.first + t1 * w1.step;
      for (int64_t t2 = 0; t2 < w2.count; ++t2) {
        j[2] = w2.first + t2 * w2.step;
        fn(j);
      }
    }
  }
}

/// Calls fn(i) for every local query i whose window holds global key j, in query order.
template <typename Fn>
__device__ void for_each_query(const NaCall& c, const int64_t j[3], Fn&& fn) {
  const NaSpan u0 = na_axis_inverse_window(c.axes[0], j[0]),
               u1 = na_axis_inverse_window(c.axes[1], j[1]),
               u2 = na_axis_inverse_window(c.axes[2], j[2]);
  int64_t i[3];
  for (int64_t t0 = 0; t0 < u0.count; ++t0) {
    i[0] = u0.first + t0 * u0.step;
    for (int64_t t1 = 0; t1 < u1.count; ++t1) {
      i[1] = u1.first + t1 * u1.step;
      for (int64_t t2 = 0; t2 < u2.count; ++t2) {
        i[2] = u2.first + t2 * u2.step;
        fn(i);
      }
    }
  }
}

/// The logit scale * q.k (+ bias) of query i and key j (rpb_head: this head's table or null).
template <typename T>
__device__ Compute<T> logit(const NaCall& c, const T* q_row, const T* k_row, const T* rpb_head,
                            const int64_t i[3], const int64_t j[3], int lane) {
  Compute<T> s = static_cast<Compute<T>>(c.scale) * warp_dot(q_row, k_row, c.dim, lane);
  if (rpb_head) s += to_compute(rpb_head[bias_index(c, i, j)]);
  return s;
}

/// Decodes a (batch, query, head) row: batch b, head h and global query coordinates i.
__device__ __forceinline__ void query_row(const NaCall& c, int64_t row, int64_t& b, int64_t& h,
                                          int64_t i[3]) {
  h = row % c.heads;
  const int64_t rest = row / c.heads;
  const int64_t query = rest % c.query_count();
  b = rest / c.query_count();
  split3(query, c.axes[0].queries, c.axes[1].queries, c.axes[2].queries, i);
#pragma unroll
  for (int a = 0; a < 3; ++a) i[a] += c.axes[a].query_offset;
}

/// The global warp index of the calling thread.
__device__ __forceinline__ int64_t global_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}

template <typename T>
__global__ void __launch_bounds__(kRowWarps* kWarp)
    plain_forward(NaCall c, const T* q, const T* k, const T* v, const T* rpb, T* o,
                  Compute<T>* lse) {
  using C = Compute<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = global_warp();
  if (row >= c.batch * c.query_count() * c.heads) return;
  int64_t b, h, i[3];
  query_row(c, row, b, h, i);
  const int64_t stride = c.heads * c.dim;  // between tile rows
  const T* q_row = q + row * c.dim;
  const T* k_head = k + b * c.tile_count() * stride + h * c.dim;
  const T* v_head = v + b * c.tile_count() * stride + h * c.dim;
  const T* rpb_head = c.has_rpb ? rpb + h * c.rpb_count() : nullptr;
  // The row maximum m and the denominator l relative to it, in one streaming pass.
  C m = -std::numeric_limits<C>::infinity(), l = 0;
  for_each_key(c, i, [&](const int64_t j[3]) {
    const C s = logit(c, q_row, k_head + tile_position(c, j) * stride, rpb_head, i, j, lane);
    if (s > m) {
      l = l * na_exp(m - s) + 1;
      m = s;
    } else {
      l += na_exp(s - m);
    }
  });
  const C row_lse = m + na_log(l);
  if (lane == 0) lse[row] = row_lse;
  for (int64_t e0 = 0; e0 < c.dim; e0 += kWarp * kLaneValues) {
    C acc[kLaneValues] = {};
    for_each_key(c, i, [&](const int64_t j[3]) {
      const int64_t position = tile_position(c, j) * stride;
      const C p = na_exp(logit(c, q_row, k_head + position, rpb_head, i, j, lane) - row_lse);
      const T* v_row = v_head + position;
#pragma unroll
      for (int r = 0; r < kLaneValues; ++r) {
        const int64_t e = e0 + lane + kWarp * r;
        if (e < c.dim) acc[r] += p * to_compute(v_row[e]);
      }
    });
#pragma unroll
    for (int r = 0; r < kLaneValues; ++r) {
      const int64_t e = e0 + lane + kWarp * r;
      if (e < c.dim) o[row * c.dim + e] = from_compute<T>(acc[r]);
    }
  }
}

/// The backward's operands as the plain kernels read them.
template <typename T>
struct Backward {
  const T *q, *k, *v, *rpb, *go;
  const Compute<T>*lse, *glse;
  T *dq, *dk, *dv, *drpb;
  Compute<T>* delta;
};

template <typename T>
__global__ void __launch_bounds__(kRowWarps* kWarp) plain_query_pass(NaCall c, Backward<T> g) {
  using C = Compute<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = global_warp();
  if (row >= c.batch * c.query_count() * c.heads) return;
  int64_t b, h, i[3];
  query_row(c, row, b, h, i);
  const int64_t stride = c.heads * c.dim;
  const T* q_row = g.q + row * c.dim;
  const T* go_row = g.go + row * c.dim;
  const T* k_head = g.k + b * c.tile_count() * stride + h * c.dim;
  const T* v_head = g.v + b * c.tile_count() * stride + h * c.dim;
  const T* rpb_head = c.has_rpb ? g.rpb + h * c.rpb_count() : nullptr;
  const C row_lse = g.lse[row];
  // delta' = sum_j p_j dp_j - glse, so that ds_j = p_j (dp_j - delta').
  C delta = 0;
  for_each_key(c, i, [&](const int64_t j[3]) {
    const int64_t position = tile_position(c, j) * stride;
    const C p = na_exp(logit(c, q_row, k_head + position, rpb_head, i, j, lane) - row_lse);
    delta += p * warp_dot(go_row, v_head + position, c.dim, lane);
  });
  if (g.glse) delta -= g.glse[row];
  if (lane == 0) g.delta[row] = delta;
  for (int64_t e0 = 0; e0 < c.dim; e0 += kWarp * kLaneValues) {
    C acc[kLaneValues] = {};
    for_each_key(c, i, [&](const int64_t j[3]) {
      const int64_t position = tile_position(c, j) * stride;
      const C p = na_exp(logit(c, q_row, k_head + position, rpb_head, i, j, lane) - row_lse);
      const C ds = p * (warp_dot(go_row, v_head + position, c.dim, lane) - delta);
      const T* k_row = k_head + position;
#pragma unroll
      for (int r = 0; r < kLaneValues; ++r) {
        const int64_t e = e0 + lane + kWarp * r;
        if (e < c.dim) acc[r] += ds * to_compute(k_row[e]);
      }
    });
    const C scale = static_cast<C>(c.scale);
#pragma unroll
    for (int r = 0; r < kLaneValues; ++r) {
      const int64_t e = e0 + lane + kWarp * r;
      if (e < c.dim) g.dq[row * c.dim + e] = from_compute<T>(scale * acc[r]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kRowWarps* kWarp) plain_key_pass(NaCall c, Backward<T> g) {
  using C = Compute<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = global_warp();  // (batch, tile position, head)
  if (row >= c.batch * c.tile_count() * c.heads) return;
  const int64_t h = row % c.heads, rest = row / c.heads;
  const int64_t b = rest / c.tile_count();
  int64_t j[3];
  split3(rest % c.tile_count(), c.axes[0].tile, c.axes[1].tile, c.axes[2].tile, j);
#pragma unroll
  for (int a = 0; a < 3; ++a) j[a] += c.axes[a].tile_offset;
  const int64_t stride = c.heads * c.dim;
  const T* k_row = g.k + row * c.dim;
  const T* v_row = g.v + row * c.dim;
  const T* q_head = g.q + b * c.query_count() * stride + h * c.dim;
  const T* go_head = g.go + b * c.query_count() * stride + h * c.dim;
  const T* rpb_head = c.has_rpb ? g.rpb + h * c.rpb_count() : nullptr;
  for (int64_t e0 = 0; e0 < c.dim; e0 += kWarp * kLaneValues) {
    C dk[kLaneValues] = {}, dv[kLaneValues] = {};
    for_each_query(c, j, [&](const int64_t i[3]) {
      const int64_t query = query_position(c, i);
      const int64_t stat = (b * c.query_count() + query) * c.heads + h;
      const T* q_row = q_head + query * stride;
      const T* go_row = go_head + query * stride;
      const C p = na_exp(logit(c, q_row, k_row, rpb_head, i, j, lane) - g.lse[stat]);
      const C ds = p * (warp_dot(go_row, v_row, c.dim, lane) - g.delta[stat]);
#pragma unroll
      for (int r = 0; r < kLaneValues; ++r) {
        const int64_t e = e0 + lane + kWarp * r;
        if (e < c.dim) {
          dk[r] += ds * to_compute(q_row[e]);
          dv[r] += p * to_compute(go_row[e]);
        }
      }
    });
    const C scale = static_cast<C>(c.scale);
#pragma unroll
    for (int r = 0; r < kLaneValues; ++r) {
      const int64_t e = e0 + lane + kWarp * r;
      if (e < c.dim) {
        g.dk[row * c.dim + e] = from_compute<T>(scale * dk[r]);
        g.dv[row * c.dim + e] = from_compute<T>(dv[r]);
      }
    }
  }
}

/// d rpb[h, entry] = sum over the queries q (all batches) whose window holds the key at the
/// entry's offset of ds(q, key); one block per (h, entry).
template <typename T>
__global__ void __launch_bounds__(kRpbWarps* kWarp) plain_rpb_pass(NaCall c, Backward<T> g) {
  using C = Compute<T>;
  __shared__ C partial[kRpbWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t h = blockIdx.x / c.rpb_count(), entry = blockIdx.x % c.rpb_count();
  int64_t offset[3];
  split3(entry, c.rpb_extent(0), c.rpb_extent(1), c.rpb_extent(2), offset);
  const int64_t stride = c.heads * c.dim;
  const T* rpb_head = g.rpb + h * c.rpb_count();
  C sum = 0;
  for (int64_t n = warp; n < c.batch * c.query_count(); n += kRpbWarps) {
    const int64_t b = n / c.query_count();
    int64_t i[3], j[3];
    split3(n % c.query_count(), c.axes[0].queries, c.axes[1].queries, c.axes[2].queries, i);
    bool hit = true;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      i[a] += c.axes[a].query_offset;
      j[a] = i[a] + (offset[a] - (c.axes[a].kernel - 1)) * c.axes[a].dilation;
      hit = hit && na_axis_window(c.axes[a], i[a]).holds(j[a]);
    }
    if (!hit) continue;
    const int64_t stat = n * c.heads + h;
    const int64_t position = (b * c.tile_count() + tile_position(c, j)) * stride + h * c.dim;
    const C p =
        na_exp(logit(c, g.q + stat * c.dim, g.k + position, rpb_head, i, j, lane) - g.lse[stat]);
    sum += p * (warp_dot(g.go + stat * c.dim, g.v + position, c.dim, lane) - g.delta[stat]);
  }
  if (lane == 0) partial[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    C total = 0;
    for (int w = 0; w < kRpbWarps; ++w) total += partial[w];
    g.drpb[blockIdx.x] = from_compute<T>(total);
  }
}

// ---------------------------------------------------------------------------------------------
// Fused forward.

/// Queries of a fused tile, keys of a streamed chunk, warps of a block (16 query rows each).
constexpr int kTileQueries = kFusedQueries;
constexpr int kChunkKeys = 64;
constexpr int kFusedWarps = kTileQueries / 16;

/// The fused kernel's shared memory for head dim D: Q tile, K and V chunks (half rows padded by 8
/// elements against bank conflicts), per warp S (f32), P (half) and the O accumulator (f32), and
/// the tile's query and chunk's key coordinates. Every region and every 16-row block starts on a
/// 32-byte boundary, as wmma's loads and stores need.
template <int D>
struct FusedLayout {
  static constexpr int ld_half = D + 8, ld_s = kChunkKeys + 4, ld_p = kChunkKeys + 8, ld_o = D + 4;
  static constexpr size_t q_bytes = size_t(kTileQueries) * ld_half * 2;
  static constexpr size_t kv_bytes = size_t(kChunkKeys) * ld_half * 2;
  static constexpr size_t s_bytes = size_t(kFusedWarps) * 16 * ld_s * 4;
  static constexpr size_t p_bytes = size_t(kFusedWarps) * 16 * ld_p * 2;
  static constexpr size_t o_bytes = size_t(kFusedWarps) * 16 * ld_o * 4;
  static constexpr size_t info_bytes = size_t(kTileQueries) * 3 * 3 * 4 + kChunkKeys * 3 * 4;
  static constexpr size_t flat_bytes = size_t(kTileQueries) * 8;
  static constexpr size_t k_at = q_bytes, v_at = k_at + kv_bytes, s_at = v_at + kv_bytes,
                          p_at = s_at + s_bytes, o_at = p_at + p_bytes, info_at = o_at + o_bytes,
                          flat_at = info_at + info_bytes, bytes = flat_at + flat_bytes;
  static_assert(k_at % 32 == 0 && s_at % 32 == 0 && p_at % 32 == 0 && o_at % 32 == 0 &&
                    info_at % 32 == 0 && flat_at % 32 == 0,
                "fused regions must stay 32-byte aligned");
};

/// Elements per 16-byte vector load of a half type.
constexpr int kVector = 8;

template <typename T, int D>
__global__ void __launch_bounds__(kFusedWarps* kWarp)
    fused_forward(NaCall c, NaTileShape tile, const T* q, const T* k, const T* v, const T* rpb,
                  T* o, float* lse) {
#if TESSERA_NA_TENSOR_CORES
  namespace wmma = nvcuda::wmma;
  using L = FusedLayout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* ks = reinterpret_cast<T*>(smem + L::k_at);
  T* vs = reinterpret_cast<T*>(smem + L::v_at);
  int* q_at = reinterpret_cast<int*>(smem + L::info_at);  // global query coordinates [64][3]
  int* q_first = q_at + kTileQueries * 3;                 // window starts [64][3]
  int* q_end = q_first + kTileQueries * 3;                // window ends [64][3] (empty: 0)
  int* key_at = q_end + kTileQueries * 3;                 // chunk keys [64][3] (none: -1)
  long long* q_flat = reinterpret_cast<long long*>(smem + L::flat_at);  // local flat, -1: none
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int64_t h = blockIdx.y % c.heads, b = blockIdx.y / c.heads;
  const int64_t stride = c.heads * c.dim;

  // The tile's corner, and its key box: per axis the union of the tile queries' windows.
  int64_t corner[3], lo[3], box[3], volume = 1;
  {
    int64_t tiles[3];
#pragma unroll
    for (int a = 0; a < 3; ++a)
      tiles[a] = (c.axes[a].queries + tile.extent[a] - 1) / tile.extent[a];
    int64_t coords[3];
    split3(blockIdx.x, tiles[0], tiles[1], tiles[2], coords);
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      corner[a] = coords[a] * tile.extent[a];
      const int64_t first = c.axes[a].query_offset + corner[a];
      const int64_t last_local = c.axes[a].query_offset + c.axes[a].queries;
      const int64_t last =
          first + tile.extent[a] < last_local ? first + tile.extent[a] : last_local;
      int64_t hi;
      na_axis_key_range(c.axes[a], first, last, lo[a], hi);
      box[a] = hi - lo[a];
      volume *= box[a];
    }
  }
  if (tid < kTileQueries) {
    int64_t t[3];
    split3(tid, tile.extent[0], tile.extent[1], tile.extent[2], t);
    bool valid = tid < tile.extent[0] * tile.extent[1] * tile.extent[2];
#pragma unroll
    for (int a = 0; a < 3; ++a) valid = valid && corner[a] + t[a] < c.axes[a].queries;
    int64_t i[3];
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      i[a] = c.axes[a].query_offset + corner[a] + t[a];
      const NaSpan w = valid ? na_axis_window(c.axes[a], i[a]) : NaSpan{0, 0, 1};
      q_at[tid * 3 + a] = static_cast<int>(i[a]);
      q_first[tid * 3 + a] = static_cast<int>(w.first);
      q_end[tid * 3 + a] = static_cast<int>(w.end());
    }
    q_flat[tid] = valid ? query_position(c, i) : -1;
  }
  __syncthreads();
  // The Q tile (zero rows for queries outside the piece), and a zero O accumulator.
  for (int index = tid; index < kTileQueries * D / kVector; index += kFusedWarps * kWarp) {
    const int r = index / (D / kVector), col = index % (D / kVector) * kVector;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (q_flat[r] >= 0)
      value = *reinterpret_cast<const uint4*>(
          q + ((b * c.query_count() + q_flat[r]) * c.heads + h) * c.dim + col);
    *reinterpret_cast<uint4*>(qs + r * L::ld_half + col) = value;
  }
  float* o_warp = reinterpret_cast<float*>(smem + L::o_at) + warp * 16 * L::ld_o;
  float* s_warp = reinterpret_cast<float*>(smem + L::s_at) + warp * 16 * L::ld_s;
  T* p_warp = reinterpret_cast<T*>(smem + L::p_at) + warp * 16 * L::ld_p;
  for (int index = lane; index < 16 * L::ld_o; index += kWarp) o_warp[index] = 0.0f;

  // Each query row of the warp is handled by two lanes (32 keys of a chunk each).
  const int r = lane / 2, half = lane % 2, query = warp * 16 + r;
  const float scale = static_cast<float>(c.scale);
  const T* rpb_head = c.has_rpb ? rpb + h * c.rpb_count() : nullptr;
  float m = -std::numeric_limits<float>::infinity(), l = 0.0f;

  for (int64_t chunk = 0; chunk < volume; chunk += kChunkKeys) {
    __syncthreads();  // the previous chunk's K and V are no longer read
    if (tid < kChunkKeys) {
      int64_t j[3];
      const bool valid = chunk + tid < volume;
      split3(valid ? chunk + tid : 0, box[0], box[1], box[2], j);
#pragma unroll
      for (int a = 0; a < 3; ++a) key_at[tid * 3 + a] = valid ? static_cast<int>(lo[a] + j[a]) : -1;
    }
    for (int index = tid; index < kChunkKeys * D / kVector; index += kFusedWarps * kWarp) {
      const int row = index / (D / kVector), col = index % (D / kVector) * kVector;
      uint4 k_value = make_uint4(0, 0, 0, 0), v_value = k_value;
      if (chunk + row < volume) {
        int64_t j[3];
        split3(chunk + row, box[0], box[1], box[2], j);
#pragma unroll
        for (int a = 0; a < 3; ++a) j[a] += lo[a];
        const int64_t at = (b * c.tile_count() + tile_position(c, j)) * stride + h * c.dim + col;
        k_value = *reinterpret_cast<const uint4*>(k + at);
        v_value = *reinterpret_cast<const uint4*>(v + at);
      }
      *reinterpret_cast<uint4*>(ks + row * L::ld_half + col) = k_value;
      *reinterpret_cast<uint4*>(vs + row * L::ld_half + col) = v_value;
    }
    __syncthreads();

    // S = Q K^T for the warp's 16 queries and the chunk's 64 keys.
#pragma unroll
    for (int n = 0; n < kChunkKeys / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int step = 0; step < D / 16; ++step) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bt;
        wmma::load_matrix_sync(a, qs + warp * 16 * L::ld_half + step * 16, L::ld_half);
        wmma::load_matrix_sync(bt, ks + n * 16 * L::ld_half + step * 16, L::ld_half);
        wmma::mma_sync(acc, a, bt, acc);
      }
      wmma::store_matrix_sync(s_warp + n * 16, acc, L::ld_s, wmma::mem_row_major);
    }
    __syncwarp();

    // Mask, bias and the online softmax of row r over this lane's 32 keys.
    float values[kChunkKeys / 2];
    float chunk_max = -std::numeric_limits<float>::infinity();
#pragma unroll
    for (int t = 0; t < kChunkKeys / 2; ++t) {
      const int key = half * (kChunkKeys / 2) + t;
      bool hit = key_at[key * 3] >= 0;
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        const int j = key_at[key * 3 + a], first = q_first[query * 3 + a];
        hit = hit && j >= first && j < q_end[query * 3 + a] &&
              (j - first) % static_cast<int>(c.axes[a].dilation) == 0;
      }
      float s = -std::numeric_limits<float>::infinity();
      if (hit) {
        s = scale * s_warp[r * L::ld_s + key];
        if (rpb_head) {
          const int64_t i[3] = {q_at[query * 3], q_at[query * 3 + 1], q_at[query * 3 + 2]};
          const int64_t j[3] = {key_at[key * 3], key_at[key * 3 + 1], key_at[key * 3 + 2]};
          s += to_compute(rpb_head[bias_index(c, i, j)]);
        }
      }
      values[t] = s;
      chunk_max = fmaxf(chunk_max, s);
    }
    chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, 1));
    const float m_new = fmaxf(m, chunk_max);
    // A row with no key in this chunk so far keeps m = -inf: nothing to rescale or add.
    const bool none = m_new == -std::numeric_limits<float>::infinity();
    const float alpha = none ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < kChunkKeys / 2; ++t) {
      const float p = none ? 0.0f : expf(values[t] - m_new);
      sum += p;
      p_warp[r * L::ld_p + half * (kChunkKeys / 2) + t] = from_compute<T>(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    for (int e = half * (D / 2); e < (half + 1) * (D / 2); ++e) o_warp[r * L::ld_o + e] *= alpha;
    __syncwarp();

    // O += P V.
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, o_warp + n * 16, L::ld_o, wmma::mem_row_major);
#pragma unroll
      for (int step = 0; step < kChunkKeys / 16; ++step) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bv;
        wmma::load_matrix_sync(a, p_warp + step * 16, L::ld_p);
        wmma::load_matrix_sync(bv, vs + step * 16 * L::ld_half + n * 16, L::ld_half);
        wmma::mma_sync(acc, a, bv, acc);
      }
      wmma::store_matrix_sync(o_warp + n * 16, acc, L::ld_o, wmma::mem_row_major);
    }
    __syncwarp();
  }

  // o = O / l and lse = m + log l for the tile's queries inside the piece.
  if (q_flat[query] >= 0) {
    const int64_t row = (b * c.query_count() + q_flat[query]) * c.heads + h;
    const float inverse = 1.0f / l;
    for (int e = half * (D / 2); e < (half + 1) * (D / 2); ++e)
      o[row * c.dim + e] = from_compute<T>(o_warp[r * L::ld_o + e] * inverse);
    if (half == 0) lse[row] = m + logf(l);
  }
#else
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Fused backward: delta' = go . o - glse per row, then one kernel per query tile for dq (the
// tile's key box streamed as in the forward) and one per key tile for dk and dv (the queries
// that read the tile, the union of its keys' inverse windows, streamed 64 at a time). Each
// output row is written by one block, so there are no atomics; d rpb comes from the plain pass.

/// delta'[row] = go . o - glse, one warp per (query, head) row.
template <typename T>
__global__ void __launch_bounds__(kRowWarps* kWarp)
    delta_rows(int64_t rows, int64_t dim, const T* go, const T* o, const float* glse,
               float* delta) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = global_warp();
  if (row >= rows) return;
  float value = warp_dot(go + row * dim, o + row * dim, dim, lane);
  if (glse) value -= glse[row];
  if (lane == 0) delta[row] = value;
}

/// Shared memory of the fused backward kernels for head dim D: four 64-row half tiles (dq: Q,
/// dO, K, V; dk/dv: K, V, Q, dO), per warp two f32 score blocks, two half blocks and two f32
/// accumulators (dq uses one), the coordinates and statistics of the 64 rows of each side.
template <int D>
struct BackwardLayout {
  static constexpr int ld_half = D + 8, ld_s = kChunkKeys + 4, ld_p = kChunkKeys + 8, ld_o = D + 4;
  static constexpr size_t tile_bytes = size_t(64) * ld_half * 2;
  static constexpr size_t s_bytes = size_t(kFusedWarps) * 16 * ld_s * 4;
  static constexpr size_t p_bytes = size_t(kFusedWarps) * 16 * ld_p * 2;
  static constexpr size_t acc_bytes = size_t(kFusedWarps) * 16 * ld_o * 4;
  static constexpr size_t info_bytes = size_t(64) * 3 * 4 * 4 + 64 * 8 * 2 + 64 * 4 * 2;
  static constexpr size_t tiles_at = 0, s_at = 4 * tile_bytes, dp_at = s_at + s_bytes,
                          p_at = dp_at + s_bytes, ds_at = p_at + p_bytes, acc_at = ds_at + p_bytes,
                          acc2_at = acc_at + acc_bytes, info_at = acc2_at + acc_bytes,
                          bytes = info_at + info_bytes;
  static_assert(s_at % 32 == 0 && dp_at % 32 == 0 && p_at % 32 == 0 && ds_at % 32 == 0 &&
                    acc_at % 32 == 0 && acc2_at % 32 == 0 && info_at % 32 == 0,
                "fused regions must stay 32-byte aligned");
  /// Half tile t (0..3).
  template <typename T>
  static __device__ T* tile(unsigned char* smem, int t) {
    return reinterpret_cast<T*>(smem + tiles_at + t * tile_bytes);
  }
};

/// Copies 64 rows of D elements into a shared tile (row r from `source(r)`, zeros for null).
template <typename T, int D, typename Source>
__device__ void load_tile(T* tile, int ld, Source&& source) {
  for (int index = threadIdx.x; index < 64 * D / kVector; index += kFusedWarps * kWarp) {
    const int r = index / (D / kVector), col = index % (D / kVector) * kVector;
    const T* row = source(r);
    const uint4 value = row ? *reinterpret_cast<const uint4*>(row + col) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(tile + r * ld + col) = value;
  }
}

/// out (16 x 64, f32, ld_out) = A (16 x D rows of `a`) B^T (64 x D rows of `b`), both half
/// tiles with leading dimension ld.
template <typename T, int D>
__device__ void scores(const T* a, const T* b, int ld, float* out, int ld_out) {
  namespace wmma = nvcuda::wmma;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int step = 0; step < D / 16; ++step) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
      wmma::load_matrix_sync(fa, a + step * 16, ld);
      wmma::load_matrix_sync(fb, b + n * 16 * ld + step * 16, ld);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, ld_out, wmma::mem_row_major);
  }
}

/// acc (16 x D, f32 in shared memory, ld_acc) += P (16 x 64 half, ld_p) M (64 x D half, ld).
template <typename T, int D>
__device__ void accumulate(const T* p, int ld_p, const T* m, int ld, float* acc, int ld_acc) {
  namespace wmma = nvcuda::wmma;
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> sum;
    wmma::load_matrix_sync(sum, acc + n * 16, ld_acc, wmma::mem_row_major);
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
      wmma::load_matrix_sync(fa, p + step * 16, ld_p);
      wmma::load_matrix_sync(fb, m + step * 16 * ld + n * 16, ld);
      wmma::mma_sync(sum, fa, fb, sum);
    }
    wmma::store_matrix_sync(acc + n * 16, sum, ld_acc, wmma::mem_row_major);
  }
}

/// Whether the window (starts `first`, ends `end` per axis) holds key j.
__device__ __forceinline__ bool window_holds(const NaCall& c, const int* first, const int* end,
                                             const int* j) {
  bool hit = j[0] >= 0;
#pragma unroll
  for (int a = 0; a < 3; ++a)
    hit = hit && j[a] >= first[a] && j[a] < end[a] &&
          (j[a] - first[a]) % static_cast<int>(c.axes[a].dilation) == 0;
  return hit;
}

/// The tile corner of block x over `extents` cut in tiles of `tile`.
__device__ __forceinline__ void tile_corner(const int64_t extents[3], const NaTileShape& tile,
                                            int64_t corner[3]) {
  int64_t tiles[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) tiles[a] = (extents[a] + tile.extent[a] - 1) / tile.extent[a];
  split3(blockIdx.x, tiles[0], tiles[1], tiles[2], corner);
#pragma unroll
  for (int a = 0; a < 3; ++a) corner[a] *= tile.extent[a];
}

template <typename T, int D>
__global__ void __launch_bounds__(kFusedWarps* kWarp)
    fused_backward_query(NaCall c, NaTileShape tile, Backward<T> g) {
#if TESSERA_NA_TENSOR_CORES
  using L = BackwardLayout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = L::template tile<T>(smem, 0);
  T* gos = L::template tile<T>(smem, 1);
  T* ks = L::template tile<T>(smem, 2);
  T* vs = L::template tile<T>(smem, 3);
  int* q_at = reinterpret_cast<int*>(smem + L::info_at);
  int* q_first = q_at + 64 * 3;
  int* q_end = q_first + 64 * 3;
  int* key_at = q_end + 64 * 3;
  long long* q_flat = reinterpret_cast<long long*>(key_at + 64 * 3);
  float* q_lse = reinterpret_cast<float*>(q_flat + 64 * 2);
  float* q_delta = q_lse + 64;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int64_t h = blockIdx.y % c.heads, b = blockIdx.y / c.heads;
  const int64_t stride = c.heads * c.dim;

  const int64_t queries[3] = {c.axes[0].queries, c.axes[1].queries, c.axes[2].queries};
  int64_t corner[3], lo[3], box[3], volume = 1;
  tile_corner(queries, tile, corner);
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    const int64_t first = c.axes[a].query_offset + corner[a];
    const int64_t end = c.axes[a].query_offset + c.axes[a].queries;
    int64_t hi;
    na_axis_key_range(c.axes[a], first, first + tile.extent[a] < end ? first + tile.extent[a] : end,
                      lo[a], hi);
    box[a] = hi - lo[a];
    volume *= box[a];
  }
  if (tid < 64) {
    int64_t t[3], i[3];
    split3(tid, tile.extent[0], tile.extent[1], tile.extent[2], t);
    bool valid = true;
#pragma unroll
    for (int a = 0; a < 3; ++a) valid = valid && corner[a] + t[a] < c.axes[a].queries;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      i[a] = c.axes[a].query_offset + corner[a] + t[a];
      const NaSpan w = valid ? na_axis_window(c.axes[a], i[a]) : NaSpan{0, 0, 1};
      q_at[tid * 3 + a] = static_cast<int>(i[a]);
      q_first[tid * 3 + a] = static_cast<int>(w.first);
      q_end[tid * 3 + a] = static_cast<int>(w.end());
    }
    const int64_t flat = valid ? query_position(c, i) : -1;
    q_flat[tid] = flat;
    const int64_t stat = (b * c.query_count() + flat) * c.heads + h;
    q_lse[tid] = valid ? g.lse[stat] : 0.0f;
    q_delta[tid] = valid ? g.delta[stat] : 0.0f;
  }
  __syncthreads();
  auto row_of = [&](const T* base, int r) -> const T* {
    return q_flat[r] < 0 ? nullptr
                         : base + ((b * c.query_count() + q_flat[r]) * c.heads + h) * c.dim;
  };
  load_tile<T, D>(qs, L::ld_half, [&](int r) { return row_of(g.q, r); });
  load_tile<T, D>(gos, L::ld_half, [&](int r) { return row_of(g.go, r); });
  float* s_warp = reinterpret_cast<float*>(smem + L::s_at) + warp * 16 * L::ld_s;
  float* dp_warp = reinterpret_cast<float*>(smem + L::dp_at) + warp * 16 * L::ld_s;
  T* ds_warp = reinterpret_cast<T*>(smem + L::ds_at) + warp * 16 * L::ld_p;
  float* dq_warp = reinterpret_cast<float*>(smem + L::acc_at) + warp * 16 * L::ld_o;
  for (int index = lane; index < 16 * L::ld_o; index += kWarp) dq_warp[index] = 0.0f;
  const int r = lane / 2, half = lane % 2, query = warp * 16 + r;
  const float scale = static_cast<float>(c.scale);
  const T* rpb_head = c.has_rpb ? g.rpb + h * c.rpb_count() : nullptr;

  for (int64_t chunk = 0; chunk < volume; chunk += kChunkKeys) {
    __syncthreads();
    if (tid < 64) {
      int64_t j[3];
      const bool valid = chunk + tid < volume;
      split3(valid ? chunk + tid : 0, box[0], box[1], box[2], j);
#pragma unroll
      for (int a = 0; a < 3; ++a) key_at[tid * 3 + a] = valid ? static_cast<int>(lo[a] + j[a]) : -1;
    }
    auto key_row = [&](const T* base, int row) -> const T* {
      if (chunk + row >= volume) return nullptr;
      int64_t j[3];
      split3(chunk + row, box[0], box[1], box[2], j);
#pragma unroll
      for (int a = 0; a < 3; ++a) j[a] += lo[a];
      return base + (b * c.tile_count() + tile_position(c, j)) * stride + h * c.dim;
    };
    load_tile<T, D>(ks, L::ld_half, [&](int row) { return key_row(g.k, row); });
    load_tile<T, D>(vs, L::ld_half, [&](int row) { return key_row(g.v, row); });
    __syncthreads();
    scores<T, D>(qs + warp * 16 * L::ld_half, ks, L::ld_half, s_warp, L::ld_s);
    scores<T, D>(gos + warp * 16 * L::ld_half, vs, L::ld_half, dp_warp, L::ld_s);
    __syncwarp();
#pragma unroll 4
    for (int t = 0; t < kChunkKeys / 2; ++t) {
      const int key = half * (kChunkKeys / 2) + t;
      float ds = 0.0f;
      if (window_holds(c, q_first + query * 3, q_end + query * 3, key_at + key * 3)) {
        float s = scale * s_warp[r * L::ld_s + key];
        if (rpb_head) {
          const int64_t i[3] = {q_at[query * 3], q_at[query * 3 + 1], q_at[query * 3 + 2]};
          const int64_t j[3] = {key_at[key * 3], key_at[key * 3 + 1], key_at[key * 3 + 2]};
          s += to_compute(rpb_head[bias_index(c, i, j)]);
        }
        const float p = expf(s - q_lse[query]);
        ds = p * (dp_warp[r * L::ld_s + key] - q_delta[query]);
      }
      ds_warp[r * L::ld_p + key] = from_compute<T>(ds);
    }
    __syncwarp();
    accumulate<T, D>(ds_warp, L::ld_p, ks, L::ld_half, dq_warp, L::ld_o);
    __syncwarp();
  }
  if (q_flat[query] >= 0) {
    const int64_t row = (b * c.query_count() + q_flat[query]) * c.heads + h;
    for (int e = half * (D / 2); e < (half + 1) * (D / 2); ++e)
      g.dq[row * c.dim + e] = from_compute<T>(scale * dq_warp[r * L::ld_o + e]);
  }
#else
  __trap();
#endif
}

template <typename T, int D>
__global__ void __launch_bounds__(kFusedWarps* kWarp)
    fused_backward_key(NaCall c, NaTileShape tile, Backward<T> g) {
#if TESSERA_NA_TENSOR_CORES
  using L = BackwardLayout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = L::template tile<T>(smem, 0);
  T* vs = L::template tile<T>(smem, 1);
  T* qs = L::template tile<T>(smem, 2);
  T* gos = L::template tile<T>(smem, 3);
  int* q_at = reinterpret_cast<int*>(smem + L::info_at);
  int* q_first = q_at + 64 * 3;
  int* q_end = q_first + 64 * 3;
  int* key_at = q_end + 64 * 3;
  long long* q_flat = reinterpret_cast<long long*>(key_at + 64 * 3);
  long long* key_flat = q_flat + 64;
  float* q_lse = reinterpret_cast<float*>(key_flat + 64);
  float* q_delta = q_lse + 64;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int64_t h = blockIdx.y % c.heads, b = blockIdx.y / c.heads;

  // The key tile and the box of local queries that read it (empty: no local query does).
  const int64_t keys[3] = {c.axes[0].tile, c.axes[1].tile, c.axes[2].tile};
  int64_t corner[3], lo[3], box[3], volume = 1;
  tile_corner(keys, tile, corner);
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    const int64_t first = c.axes[a].tile_offset + corner[a];
    const int64_t end = c.axes[a].tile_offset + c.axes[a].tile;
    int64_t hi;
    na_axis_query_range(c.axes[a], first,
                        first + tile.extent[a] < end ? first + tile.extent[a] : end, lo[a], hi);
    box[a] = hi - lo[a];
    volume *= box[a];
  }
  if (tid < 64) {
    int64_t t[3], j[3];
    split3(tid, tile.extent[0], tile.extent[1], tile.extent[2], t);
    bool valid = true;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      valid = valid && corner[a] + t[a] < c.axes[a].tile;
      j[a] = c.axes[a].tile_offset + corner[a] + t[a];
    }
#pragma unroll
    for (int a = 0; a < 3; ++a) key_at[tid * 3 + a] = valid ? static_cast<int>(j[a]) : -1;
    key_flat[tid] = valid ? tile_position(c, j) : -1;
  }
  __syncthreads();
  auto key_row = [&](const T* base, int r) -> const T* {
    return key_flat[r] < 0 ? nullptr
                           : base + ((b * c.tile_count() + key_flat[r]) * c.heads + h) * c.dim;
  };
  load_tile<T, D>(ks, L::ld_half, [&](int r) { return key_row(g.k, r); });
  load_tile<T, D>(vs, L::ld_half, [&](int r) { return key_row(g.v, r); });
  float* s_warp = reinterpret_cast<float*>(smem + L::s_at) + warp * 16 * L::ld_s;
  float* dp_warp = reinterpret_cast<float*>(smem + L::dp_at) + warp * 16 * L::ld_s;
  T* p_warp = reinterpret_cast<T*>(smem + L::p_at) + warp * 16 * L::ld_p;
  T* ds_warp = reinterpret_cast<T*>(smem + L::ds_at) + warp * 16 * L::ld_p;
  float* dk_warp = reinterpret_cast<float*>(smem + L::acc_at) + warp * 16 * L::ld_o;
  float* dv_warp = reinterpret_cast<float*>(smem + L::acc2_at) + warp * 16 * L::ld_o;
  for (int index = lane; index < 16 * L::ld_o; index += kWarp) {
    dk_warp[index] = 0.0f;
    dv_warp[index] = 0.0f;
  }
  const int r = lane / 2, half = lane % 2, key = warp * 16 + r;
  const float scale = static_cast<float>(c.scale);
  const T* rpb_head = c.has_rpb ? g.rpb + h * c.rpb_count() : nullptr;

  for (int64_t chunk = 0; chunk < volume; chunk += 64) {
    __syncthreads();
    if (tid < 64) {
      int64_t u[3], i[3];
      const bool valid = chunk + tid < volume;
      split3(valid ? chunk + tid : 0, box[0], box[1], box[2], u);
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        i[a] = lo[a] + u[a];
        const NaSpan w = valid ? na_axis_window(c.axes[a], i[a]) : NaSpan{0, 0, 1};
        q_at[tid * 3 + a] = static_cast<int>(i[a]);
        q_first[tid * 3 + a] = static_cast<int>(w.first);
        q_end[tid * 3 + a] = static_cast<int>(w.end());
      }
      const int64_t flat = valid ? query_position(c, i) : -1;
      q_flat[tid] = flat;
      const int64_t stat = (b * c.query_count() + flat) * c.heads + h;
      q_lse[tid] = valid ? g.lse[stat] : 0.0f;
      q_delta[tid] = valid ? g.delta[stat] : 0.0f;
    }
    __syncthreads();
    auto row_of = [&](const T* base, int row) -> const T* {
      return q_flat[row] < 0 ? nullptr
                             : base + ((b * c.query_count() + q_flat[row]) * c.heads + h) * c.dim;
    };
    load_tile<T, D>(qs, L::ld_half, [&](int row) { return row_of(g.q, row); });
    load_tile<T, D>(gos, L::ld_half, [&](int row) { return row_of(g.go, row); });
    __syncthreads();
    // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys and the chunk's 64 queries.
    scores<T, D>(ks + warp * 16 * L::ld_half, qs, L::ld_half, s_warp, L::ld_s);
    scores<T, D>(vs + warp * 16 * L::ld_half, gos, L::ld_half, dp_warp, L::ld_s);
    __syncwarp();
#pragma unroll 4
    for (int t = 0; t < 32; ++t) {
      const int query = half * 32 + t;
      float p = 0.0f, ds = 0.0f;
      if (q_flat[query] >= 0 &&
          window_holds(c, q_first + query * 3, q_end + query * 3, key_at + key * 3)) {
        float s = scale * s_warp[r * L::ld_s + query];
        if (rpb_head) {
          const int64_t i[3] = {q_at[query * 3], q_at[query * 3 + 1], q_at[query * 3 + 2]};
          const int64_t j[3] = {key_at[key * 3], key_at[key * 3 + 1], key_at[key * 3 + 2]};
          s += to_compute(rpb_head[bias_index(c, i, j)]);
        }
        p = expf(s - q_lse[query]);
        ds = p * (dp_warp[r * L::ld_s + query] - q_delta[query]);
      }
      p_warp[r * L::ld_p + query] = from_compute<T>(p);
      ds_warp[r * L::ld_p + query] = from_compute<T>(ds);
    }
    __syncwarp();
    accumulate<T, D>(p_warp, L::ld_p, gos, L::ld_half, dv_warp, L::ld_o);
    accumulate<T, D>(ds_warp, L::ld_p, qs, L::ld_half, dk_warp, L::ld_o);
    __syncwarp();
  }
  if (key_flat[key] >= 0) {
    const int64_t row = (b * c.tile_count() + key_flat[key]) * c.heads + h;
    for (int e = half * (D / 2); e < (half + 1) * (D / 2); ++e) {
      g.dk[row * c.dim + e] = from_compute<T>(scale * dk_warp[r * L::ld_o + e]);
      g.dv[row * c.dim + e] = from_compute<T>(dv_warp[r * L::ld_o + e]);
    }
  }
#else
  __trap();
#endif
}

/// Whether the mma kernels take `call`: its boxes split in 32 bits (na_mma_boxes_fit) and their
/// shared memory fits the current device's opt-in limit per block (their membership tables grow
/// with kernel x dilation); if not, the fused kernels run.
bool mma_fits(const NaCall& call, bool backward) {
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess)
    return false;
  return na_mma_boxes_fit(call) &&
         na_mma_shared_bytes(call, backward) <= static_cast<size_t>(limit);
}

/// Blocks for `rows` rows of one warp each.
unsigned row_blocks(int64_t rows, int warps) {
  const int64_t blocks = (rows + warps - 1) / warps;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

template <typename T>
cudaError_t forward_plain(const NaCall& call, const NaForwardArgs& args, cudaStream_t stream) {
  const int64_t rows = call.batch * call.query_count() * call.heads;
  if (rows == 0) return cudaSuccess;
  plain_forward<T><<<row_blocks(rows, kRowWarps), kRowWarps * kWarp, 0, stream>>>(
      call, static_cast<const T*>(args.q), static_cast<const T*>(args.k),
      static_cast<const T*>(args.v), static_cast<const T*>(args.rpb), static_cast<T*>(args.o),
      static_cast<Compute<T>*>(args.lse));
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t forward_fused_dim(const NaCall& call, const NaForwardArgs& args, int spatial,
                              cudaStream_t stream) {
  NaTileShape tile{};
  na_fused_tile_shape(spatial, tile.extent);
  const int64_t tiles = na_tile_count(call, tile, false);
  if (tiles == 0 || call.batch * call.heads == 0) return cudaSuccess;
  const size_t bytes = FusedLayout<D>::bytes;
  cudaError_t status = cudaFuncSetAttribute(
      fused_forward<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(call.batch * call.heads));
  fused_forward<T, D><<<grid, kFusedWarps * kWarp, bytes, stream>>>(
      call, tile, static_cast<const T*>(args.q), static_cast<const T*>(args.k),
      static_cast<const T*>(args.v), static_cast<const T*>(args.rpb), static_cast<T*>(args.o),
      static_cast<float*>(args.lse));
  return cudaGetLastError();
}

template <typename T>
cudaError_t forward_fused(const NaCall& call, const NaForwardArgs& args, cudaStream_t stream) {
  const int spatial = call.spatial;
  switch (call.dim) {
    case 32: return forward_fused_dim<T, 32>(call, args, spatial, stream);
    case 64: return forward_fused_dim<T, 64>(call, args, spatial, stream);
    case 128: return forward_fused_dim<T, 128>(call, args, spatial, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t backward_plain(const NaCall& call, const NaBackwardArgs& args, cudaStream_t stream) {
  using C = Compute<T>;
  const Backward<T> g{static_cast<const T*>(args.q),    static_cast<const T*>(args.k),
                      static_cast<const T*>(args.v),    static_cast<const T*>(args.rpb),
                      static_cast<const T*>(args.go),   static_cast<const C*>(args.lse),
                      static_cast<const C*>(args.glse), static_cast<T*>(args.dq),
                      static_cast<T*>(args.dk),         static_cast<T*>(args.dv),
                      static_cast<T*>(args.drpb),       static_cast<C*>(args.delta)};
  const int64_t query_rows = call.batch * call.query_count() * call.heads;
  const int64_t key_rows = call.batch * call.tile_count() * call.heads;
  // The key pass and d rpb read the query pass's delta' (same stream, so in order).
  if (query_rows > 0)
    plain_query_pass<T>
        <<<row_blocks(query_rows, kRowWarps), kRowWarps * kWarp, 0, stream>>>(call, g);
  if (key_rows > 0)
    plain_key_pass<T><<<row_blocks(key_rows, kRowWarps), kRowWarps * kWarp, 0, stream>>>(call, g);
  if (call.has_rpb && call.heads > 0)
    plain_rpb_pass<T>
        <<<static_cast<unsigned>(call.heads * call.rpb_count()), kRpbWarps * kWarp, 0, stream>>>(
            call, g);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t backward_fused_dim(const NaCall& call, const Backward<T>& g, cudaStream_t stream) {
  NaTileShape tile{};
  na_fused_tile_shape(call.spatial, tile.extent);
  const int64_t query_tiles = na_tile_count(call, tile, false),
                key_tiles = na_tile_count(call, tile, true);
  const size_t bytes = BackwardLayout<D>::bytes;
  const unsigned pairs = static_cast<unsigned>(call.batch * call.heads);
  for (const void* kernel : {reinterpret_cast<const void*>(fused_backward_query<T, D>),
                             reinterpret_cast<const void*>(fused_backward_key<T, D>)}) {
    const cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (status != cudaSuccess) return status;
  }
  if (query_tiles > 0)
    fused_backward_query<T, D>
        <<<dim3(static_cast<unsigned>(query_tiles), pairs), kFusedWarps * kWarp, bytes, stream>>>(
            call, tile, g);
  if (key_tiles > 0)
    fused_backward_key<T, D>
        <<<dim3(static_cast<unsigned>(key_tiles), pairs), kFusedWarps * kWarp, bytes, stream>>>(
            call, tile, g);
  return cudaGetLastError();
}

/// The fused backward of a half type: delta' rows, dq per query tile, dk and dv per key tile,
/// and d rpb from the plain pass (all reading delta', queued in that order).
template <typename T>
cudaError_t backward_fused(NaKernel kernel, const NaCall& call, const NaBackwardArgs& args,
                           cudaStream_t stream) {
  const Backward<T> g{static_cast<const T*>(args.q),
                      static_cast<const T*>(args.k),
                      static_cast<const T*>(args.v),
                      static_cast<const T*>(args.rpb),
                      static_cast<const T*>(args.go),
                      static_cast<const float*>(args.lse),
                      static_cast<const float*>(args.glse),
                      static_cast<T*>(args.dq),
                      static_cast<T*>(args.dk),
                      static_cast<T*>(args.dv),
                      static_cast<T*>(args.drpb),
                      static_cast<float*>(args.delta)};
  const int64_t rows = call.batch * call.query_count() * call.heads;
  if (rows > 0)
    delta_rows<T><<<row_blocks(rows, kRowWarps), kRowWarps * kWarp, 0, stream>>>(
        rows, call.dim, g.go, static_cast<const T*>(args.o), g.glse, g.delta);
  if (call.batch * call.heads > 0 && kernel == NaKernel::mma && mma_fits(call, true)) {
    const cudaError_t status = launch_na_backward_mma(
        call, std::is_same_v<T, __half> ? ElementType::f16 : ElementType::bf16, args, stream);
    if (status != cudaSuccess) return status;
  } else if (call.batch * call.heads > 0) {
    cudaError_t status = cudaSuccess;
    switch (call.dim) {
      case 32: status = backward_fused_dim<T, 32>(call, g, stream); break;
      case 64: status = backward_fused_dim<T, 64>(call, g, stream); break;
      case 128: status = backward_fused_dim<T, 128>(call, g, stream); break;
      default: return cudaErrorInvalidValue;
    }
    if (status != cudaSuccess) return status;
  }
  if (call.has_rpb && call.heads > 0)
    plain_rpb_pass<T>
        <<<static_cast<unsigned>(call.heads * call.rpb_count()), kRpbWarps * kWarp, 0, stream>>>(
            call, g);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_na_forward(NaKernel kernel, const NaCall& call, ElementType type,
                              const NaForwardArgs& args, cudaStream_t stream) {
  switch (type) {
    case ElementType::f32: return forward_plain<float>(call, args, stream);
    case ElementType::f64: return forward_plain<double>(call, args, stream);
    case ElementType::f16:
    case ElementType::bf16: break;
  }
  if (kernel == NaKernel::mma && mma_fits(call, false))
    return launch_na_forward_mma(call, type, args, stream);
  if (kernel == NaKernel::mma) kernel = NaKernel::fused;
  if (type == ElementType::f16)
    return kernel == NaKernel::fused ? forward_fused<__half>(call, args, stream)
                                     : forward_plain<__half>(call, args, stream);
  if (type == ElementType::bf16)
    return kernel == NaKernel::fused ? forward_fused<__nv_bfloat16>(call, args, stream)
                                     : forward_plain<__nv_bfloat16>(call, args, stream);
  return cudaErrorInvalidValue;
}

cudaError_t launch_na_backward(NaKernel kernel, const NaCall& call, ElementType type,
                               const NaBackwardArgs& args, cudaStream_t stream) {
  switch (type) {
    case ElementType::f32: return backward_plain<float>(call, args, stream);
    case ElementType::f64: return backward_plain<double>(call, args, stream);
    case ElementType::f16:
      return kernel != NaKernel::plain && args.o
                 ? backward_fused<__half>(kernel, call, args, stream)
                 : backward_plain<__half>(call, args, stream);
    case ElementType::bf16:
      return kernel != NaKernel::plain && args.o
                 ? backward_fused<__nv_bfloat16>(kernel, call, args, stream)
                 : backward_plain<__nv_bfloat16>(call, args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tessera::ops::kernels
