// The register-tiled backward kernels of neighborhood attention (f16/bf16, head dim 32, 64 or
// 128), built from the primitives of na_mma.cuh. A header so that the unit tests can run the same
// source on the cpu (TESSERA_NA_EMULATE, tests/emu/).
//
// Both read delta' = go . o - glse per (query, head), computed before them (delta_rows in
// na_cuda.cu), and the forward's lse; p = exp(s - lse) is recomputed from S, never stored.
//  - mma_backward_query: one block of 4 warps per tile of 64 queries (as the forward), each warp
//    16 query rows. The tile's key box is streamed 64 keys at a time (K, V and the keys'
//    coordinates, two chunks in flight). Per chunk: S = Q K^T and dP = dO V^T on mma.sync, then
//    dS = P (dP - delta') in registers, and dQ += dS K with dS rounded to the element type
//    straight from the accumulators. dq = scale dQ.
//  - mma_backward_key: one block per tile of 64 keys of the key/value tile (the same tile shapes
//    over the tile's extents), each warp 16 key rows. The box of local queries whose windows may
//    hold these keys (na_axis_query_range) is streamed 64 queries at a time (Q, dO and each
//    query's window, lse and delta'). Per chunk: S^T = K Q^T and dP^T = V dO^T, then P^T and
//    dS^T in registers, dV += P^T dO and dK += dS^T Q. dk = scale dK, dv = dV.
// Each row of dq, dk and dv is written by one warp of one block, in a fixed order: no atomics,
// the same bits run to run. d rpb comes from the plain pass (na_cuda.cu).
#pragma once

#include <cstdint>

#include "ops/attention/na_mma.cuh"

namespace tessera::ops::kernels::mma_detail {

/// Operands of the backward kernels: the forward's inputs, the gradient go of o, the forward's
/// lse and delta' per (query, head) (float), and the outputs dq (the query pieces' shape) and dk,
/// dv (the tile's shape).
template <typename T>
struct MmaBackward {
  const T *q, *k, *v, *rpb, *go;
  const float *lse, *delta;
  T *dq, *dk, *dv;
};

/// What the key kernel keeps of each streamed query: the rows of the key tile its window holds
/// (a row mask; 0 past the box), its global coordinates (for the bias), lse in the log2 domain
/// and delta'. 32 bytes.
struct QueryInfo {
  unsigned long long member;
  int at[3];
  float lse2, delta;
  int unused;
};
static_assert(sizeof(QueryInfo) == 32, "QueryInfo is 32 bytes");

/// Shared memory of both backward kernels for head dim D: two fixed 64-row tiles (query kernel: Q
/// and dO; key kernel: K and V), kStages stages of two streamed 64-row tiles (K and V; Q and dO)
/// with the streamed rows' information (int4 key coordinates, then the keys' row masks;
/// QueryInfo), and the flat local positions of the fixed tile's rows (-1: none). The membership
/// tables (MaskTables) follow at `bytes`.
template <int D>
struct MmaBackwardLayout {
  static constexpr int ld = D + 8;
  static constexpr size_t tile_bytes = size_t(64) * ld * 2;
  static constexpr size_t info_bytes = size_t(64) * sizeof(QueryInfo);
  static constexpr size_t stage_bytes = 2 * tile_bytes + info_bytes;
  static constexpr size_t stage_at = 2 * tile_bytes, flat_at = stage_at + kStages * stage_bytes,
                          bytes = flat_at + size_t(64) * 8;
  static_assert(tile_bytes % 16 == 0 && stage_bytes % 16 == 0 && flat_at % 16 == 0,
                "the regions must stay 16-byte aligned");
  template <typename T>
  static __device__ T* fixed(unsigned char* smem, int t) {
    return reinterpret_cast<T*>(smem + t * tile_bytes);
  }
  template <typename T>
  static __device__ T* streamed(unsigned char* smem, int stage, int t) {
    return reinterpret_cast<T*>(smem + stage_at + stage * stage_bytes + t * tile_bytes);
  }
  static __device__ unsigned char* info(unsigned char* smem, int stage) {
    return smem + stage_at + stage * stage_bytes + 2 * tile_bytes;
  }
  static __device__ long long* flat(unsigned char* smem) {
    return reinterpret_cast<long long*>(smem + flat_at);
  }
};

template <typename T, int D, bool kBias>
__global__ void __launch_bounds__(kMmaWarps* kWarp)
    mma_backward_query(NaCall c, NaTileShape tile, MaskTables m, MmaBackward<T> g) {
#if TESSERA_NA_MMA
  using L = MmaBackwardLayout<D>;
  constexpr int ld = L::ld;
  // Keys per pass over a chunk: fewer for D = 128, whose accumulator takes 64 registers.
  constexpr int kPass = D == 128 ? 32 : 64;
  TESSERA_NA_DYNAMIC_SHARED(smem);
  T* qs = L::template fixed<T>(smem, 0);
  T* gs = L::template fixed<T>(smem, 1);
  long long* q_flat = L::flat(smem);
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int group = lane / 4, quad = lane % 4;
  const int64_t h = blockIdx.y % c.heads, b = blockIdx.y / c.heads;

  // The tile and its key box, as in the forward; this lane's rows, their lse and delta'.
  unsigned long long* masks = reinterpret_cast<unsigned long long*>(smem + L::bytes);
  const TileBox t = setup_tile(c, tile, false, m, q_flat, masks);
  int row_at[2][3];
  long long row_flat[2];
  lane_rows(c, tile, t, warp * 16 + group, false, row_at, row_flat);
  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t stat =
        (b * c.query_count() + (row_flat[half] >= 0 ? row_flat[half] : 0)) * c.heads + h;
    lse2[half] = row_flat[half] >= 0 ? g.lse[stat] * kLog2e : 0.0f;
    delta[half] = row_flat[half] >= 0 ? g.delta[stat] : 0.0f;
  }
  const Windows w = windows_of(c);
  const T* rpb_head = kBias ? g.rpb + h * c.rpb_count() : nullptr;  // kBias: c.has_rpb
  const float scale = static_cast<float>(c.scale), scale_log2 = scale * kLog2e;
  __syncthreads();  // q_flat

  // Q and dO of the tile (zero rows outside the piece).
  load_rows<T, D>(qs, g.q, gs, g.go, ld, [&](int r) -> int64_t {
    return q_flat[r] >= 0 ? ((b * c.query_count() + q_flat[r]) * c.heads + h) * c.dim : -1;
  });
  // Chunk `chunk` of the key box into `stage`: K, V and the keys' coordinates.
  auto load_chunk = [&](int64_t chunk, int stage) {
    int4* keys = reinterpret_cast<int4*>(L::info(smem, stage));
    load_key_chunk<T, D>(c, tile, t, m, masks, b, h, chunk, g.k, g.v,
                         L::template streamed<T>(smem, stage, 0),
                         L::template streamed<T>(smem, stage, 1), keys,
                         reinterpret_cast<unsigned long long*>(keys + 64), ld);
  };
  const int64_t chunks = (t.volume + 63) / 64;
  if (chunks > 0) load_chunk(0, 0);
  commit_async();

  float acc[D / 8][4];  // dQ
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int stage = next_chunk(chunk, chunks, load_chunk);
#pragma unroll
    for (int pass = 0; pass < 64 / kPass; ++pass) {
      const T* ks = L::template streamed<T>(smem, stage, 0) + pass * kPass * ld;
      const T* vs = L::template streamed<T>(smem, stage, 1) + pass * kPass * ld;
      // This pass's keys: coordinates, then (after the chunk's 64) row masks.
      const int4* keys = reinterpret_cast<const int4*>(L::info(smem, stage)) + pass * kPass;
      const unsigned long long* members =
          reinterpret_cast<const unsigned long long*>(
              reinterpret_cast<const int4*>(L::info(smem, stage)) + 64) +
          pass * kPass;
      // The mask first (bit 4j + 2 half + e: row group + 8 half, key 8j + 2 quad + e), so that
      // n-tiles no row of the warp reads cost no mma.
      const uint32_t hits = row_hits<kPass / 8>(members, 1, warp * 16 + group, quad);
      const unsigned live = __reduce_or_sync(0xffffffffu, hits);
      float s[kPass / 8][4], dp[kPass / 8][4];
      warp_scores<T, D, kPass>(s, qs + warp * 16 * ld, ks, ld, lane, live);   // S = Q K^T
      warp_scores<T, D, kPass>(dp, gs + warp * 16 * ld, vs, ld, lane, live);  // dP = dO V^T
      // dS = P (dP - delta') where the window holds the key, else 0 (into s).
#pragma unroll
      for (int j = 0; j < kPass / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            float ds = 0.0f;
            if (hits >> (4 * j + 2 * half + e) & 1u) {
              float x = s[j][2 * half + e] * scale_log2;
              if constexpr (kBias) {
                const int4 key = keys[8 * j + 2 * quad + e];
                const int at[3] = {key.x, key.y, key.z};
                x += widen(rpb_head[bias_entry(row_at[half], at, w)]) * kLog2e;
              }
              ds = exp2f(x - lse2[half]) * (dp[j][2 * half + e] - delta[half]);
            }
            s[j][2 * half + e] = ds;
          }
        }
      }
      warp_accumulate<T, D, kPass>(acc, s, ks, ld, lane, live);  // dQ += dS K
    }
    __syncthreads();  // this stage is free for the chunk after next
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const long long flat = q_flat[warp * 16 + group + 8 * half];
    if (flat < 0) continue;
    T* out = g.dq + ((b * c.query_count() + flat) * c.heads + h) * c.dim + 2 * quad;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(out + 8 * n) =
          pack(scale * acc[n][2 * half], scale * acc[n][2 * half + 1], T{});
  }
#else
  __trap();
#endif
}

template <typename T, int D, bool kBias>
__global__ void __launch_bounds__(kMmaWarps* kWarp)
    mma_backward_key(NaCall c, NaTileShape tile, MaskTables m, MmaBackward<T> g) {
#if TESSERA_NA_MMA
  using L = MmaBackwardLayout<D>;
  constexpr int ld = L::ld;
  // Query columns per pass over a chunk: fewer for D = 128, whose two accumulators take 128
  // registers (more spill).
  constexpr int kPass = D == 128 ? 16 : D == 64 ? 32 : 64;
  TESSERA_NA_DYNAMIC_SHARED(smem);
  T* ks = L::template fixed<T>(smem, 0);
  T* vs = L::template fixed<T>(smem, 1);
  long long* key_flat = L::flat(smem);
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int group = lane / 4, quad = lane % 4;
  const int64_t h = blockIdx.y % c.heads, b = blockIdx.y / c.heads;
  const int64_t token_stride = c.heads * c.dim;

  // The key tile and the box of local queries that may read its keys, the membership tables;
  // this lane's key rows (global coordinates).
  unsigned long long* masks = reinterpret_cast<unsigned long long*>(smem + L::bytes);
  const TileBox t = setup_tile(c, tile, true, m, key_flat, masks);
  int key_at[2][3];  // for the bias
  long long row_flat[2];
  lane_rows(c, tile, t, warp * 16 + group, true, key_at, row_flat);
  const Windows w = windows_of(c);
  const T* rpb_head = kBias ? g.rpb + h * c.rpb_count() : nullptr;  // kBias: c.has_rpb
  const float scale = static_cast<float>(c.scale), scale_log2 = scale * kLog2e;
  __syncthreads();  // key_flat

  // K and V of the tile (zero rows past it).
  load_rows<T, D>(ks, g.k, vs, g.v, ld, [&](int r) -> int64_t {
    return key_flat[r] >= 0 ? ((b * c.tile_count() + key_flat[r]) * c.heads + h) * c.dim : -1;
  });
  // Chunk `chunk` of the query box into `stage`: Q, dO and each query's QueryInfo.
  auto load_chunk = [&](int64_t chunk, int stage) {
    const int64_t first_query = chunk * 64;
    T* qs = L::template streamed<T>(smem, stage, 0);
    T* gs = L::template streamed<T>(smem, stage, 1);
    // The local flat position of box query n (all of the box is inside the piece), its box
    // coordinates u and global coordinates i.
    auto flat_of = [&](int64_t n, int u[3], int64_t i[3]) {
      const NaFastDiv* divisors = box_divisors(masks, m);
      split_box(static_cast<uint32_t>(n), divisors[0], divisors[1], u);
      long long flat = 0;
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        i[a] = t.lo[a] + u[a];
        flat = flat * c.axes[a].queries + (i[a] - c.axes[a].query_offset);
      }
      return flat;
    };
    load_rows<T, D>(qs, g.q, gs, g.go, ld, [&](int row) -> int64_t {
      if (first_query + row >= t.volume) return -1;
      int u[3];
      int64_t i[3];
      return ((b * c.query_count() + flat_of(first_query + row, u, i)) * c.heads + h) * c.dim;
    });
    if (tid < 64) {
      QueryInfo info{};
      if (first_query + tid < t.volume) {
        int u[3];
        int64_t i[3];
        const long long flat = flat_of(first_query + tid, u, i);
        info.member = row_mask(masks, m, u, tile);
#pragma unroll
        for (int a = 0; a < 3; ++a) info.at[a] = static_cast<int>(i[a]);
        const int64_t stat = (b * c.query_count() + flat) * c.heads + h;
        info.lse2 = g.lse[stat] * kLog2e;
        info.delta = g.delta[stat];
      }
      reinterpret_cast<QueryInfo*>(L::info(smem, stage))[tid] = info;
    }
  };
  const int64_t chunks = (t.volume + 63) / 64;
  if (chunks > 0) load_chunk(0, 0);
  commit_async();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int stage = next_chunk(chunk, chunks, load_chunk);
    const QueryInfo* infos = reinterpret_cast<const QueryInfo*>(L::info(smem, stage));
#pragma unroll
    for (int pass = 0; pass < 64 / kPass; ++pass) {
      const T* qs = L::template streamed<T>(smem, stage, 0) + pass * kPass * ld;
      const T* gs = L::template streamed<T>(smem, stage, 1) + pass * kPass * ld;
      // The mask first (bit 4j + 2 half + e: key row group + 8 half, query 8j + 2 quad + e), so
      // that n-tiles of queries that read none of the warp's keys cost no mma.
      const uint32_t hits = row_hits<kPass / 8>(&infos[pass * kPass].member, sizeof(QueryInfo) / 8,
                                                warp * 16 + group, quad);
      const unsigned live = __reduce_or_sync(0xffffffffu, hits);
      float s[kPass / 8][4], dp[kPass / 8][4];
      warp_scores<T, D, kPass>(s, ks + warp * 16 * ld, qs, ld, lane, live);   // S^T = K Q^T
      warp_scores<T, D, kPass>(dp, vs + warp * 16 * ld, gs, ld, lane, live);  // dP^T = V dO^T
      // P^T (into s) and dS^T = P^T (dP^T - delta') (into dp) where the query's window holds the
      // key, else 0.
#pragma unroll
      for (int j = 0; j < kPass / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            float p = 0.0f, ds = 0.0f;
            if (hits >> (4 * j + 2 * half + e) & 1u) {
              const QueryInfo& info = infos[pass * kPass + 8 * j + 2 * quad + e];
              float x = s[j][2 * half + e] * scale_log2;
              if constexpr (kBias)
                x += widen(rpb_head[bias_entry(info.at, key_at[half], w)]) * kLog2e;
              p = exp2f(x - info.lse2);
              ds = p * (dp[j][2 * half + e] - info.delta);
            }
            s[j][2 * half + e] = p;
            dp[j][2 * half + e] = ds;
          }
        }
      }
      warp_accumulate<T, D, kPass>(dv, s, gs, ld, lane, live);   // dV += P^T dO
      warp_accumulate<T, D, kPass>(dk, dp, qs, ld, lane, live);  // dK += dS^T Q
    }
    __syncthreads();  // this stage is free for the chunk after next
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const long long flat = key_flat[warp * 16 + group + 8 * half];
    if (flat < 0) continue;
    const int64_t row = (b * c.tile_count() + flat) * token_stride + h * c.dim + 2 * quad;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<uint32_t*>(g.dk + row + 8 * n) =
          pack(scale * dk[n][2 * half], scale * dk[n][2 * half + 1], T{});
      *reinterpret_cast<uint32_t*>(g.dv + row + 8 * n) =
          pack(dv[n][2 * half], dv[n][2 * half + 1], T{});
    }
  }
#else
  __trap();
#endif
}

}  // namespace tessera::ops::kernels::mma_detail
