// The register-tiled forward kernel of neighborhood attention (see na_cuda_mma.cu for what it
// does and na_mma.cuh for its building blocks). A header so that the unit tests can run the same
// source on the cpu under tests/emu/'s emulation of the primitives (TESSERA_NA_EMULATE).
#pragma once

#include <cstdint>

#include "ops/attention/na_mma.cuh"

namespace tessera::ops::kernels::mma_detail {

/// kBlocks: the blocks per SM the launch bounds ask for (1: the compiler's allocation decides; 4:
/// at most 128 registers a thread, Q's A fragments re-read from shared memory per n-tile rather
/// than held across the chunk loop).
template <typename T, int D, bool kBias, int kBlocks = 1>
__global__ void __launch_bounds__(kMmaWarps* kWarp, kBlocks)
    mma_forward(NaCall c, NaTileShape tile, MaskTables m, const T* q, const T* k, const T* v,
                const T* rpb, T* o, float* lse) {
#if TESSERA_NA_MMA
  using L = MmaLayout<D>;
  TESSERA_NA_DYNAMIC_SHARED(smem);
  T* qs = reinterpret_cast<T*>(smem);
  long long* q_flat = reinterpret_cast<long long*>(smem + L::flat_at);
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int group = lane / 4, quad = lane % 4;  // the mma fragments' row group and column pair
  const int64_t h = blockIdx.y % c.heads, b = blockIdx.y / c.heads;

  // The tile and its key box (the union of its queries' windows); this lane's two query rows.
  unsigned long long* masks = reinterpret_cast<unsigned long long*>(smem + L::bytes);
  const TileBox t = setup_tile(c, tile, false, m, q_flat, masks);
  int row_at[2][3];
  long long row_flat[2];
  lane_rows(c, tile, t, warp * 16 + group, false, row_at, row_flat);
  const Windows w = windows_of(c);
  const T* rpb_head = kBias ? rpb + h * c.rpb_count() : nullptr;  // kBias: c.has_rpb
  const float scale_log2 = static_cast<float>(c.scale) * kLog2e;
  // This lane's row of Q's A fragments: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15) of rows
  // warp*16.., columns 16s.. at q_row + 16s.
  const T* q_row = qs + (warp * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * L::ld + 8 * (lane / 16);
  __syncthreads();  // q_flat, the tables

  // The Q tile (zero rows outside the piece): the first group of copies.
  load_rows<T, D>(qs, q, nullptr, nullptr, L::ld, [&](int r) -> int64_t {
    return q_flat[r] >= 0 ? ((b * c.query_count() + q_flat[r]) * c.heads + h) * c.dim : -1;
  });
  // Chunk `chunk` of the key box (keys chunk * 64 ..) into stage `stage`.
  auto load_chunk = [&](int64_t chunk, int stage) {
    unsigned char* keys = smem + L::key_at + stage * L::key_bytes;
    load_key_chunk<T, D>(c, tile, t, m, masks, b, h, chunk, k, v,
                         reinterpret_cast<T*>(smem + L::k_at + stage * L::kv_bytes),
                         reinterpret_cast<T*>(smem + L::v_at + stage * L::kv_bytes),
                         reinterpret_cast<int4*>(keys),
                         reinterpret_cast<unsigned long long*>(keys + kMmaKeys * 16), L::ld);
  };

  const int64_t chunks = (t.volume + kMmaKeys - 1) / kMmaKeys;
  if (chunks > 0) load_chunk(0, 0);
  commit_async();

  constexpr bool kQInRegisters = kBlocks < 4;
  // Q's A fragments, one per 16 elements of the head dim (held across the chunks unless kBlocks
  // asks for 4 blocks per SM).
  uint32_t qf[kQInRegisters ? D / 16 : 1][4];
  float acc[D / 8][4];  // O: 8 columns of the head dim per accumulator
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};  // log2 domain; this lane's sum

  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int stage = next_chunk(chunk, chunks, load_chunk);
    if constexpr (kQInRegisters) {
      if (chunk == 0) {
#pragma unroll
        for (int s = 0; s < D / 16; ++s) load_matrices(qf[s], q_row + 16 * s);
      }
    }
    const T* ks = reinterpret_cast<const T*>(smem + L::k_at + stage * L::kv_bytes);
    const T* vs = reinterpret_cast<const T*>(smem + L::v_at + stage * L::kv_bytes);
    const int4* keys = reinterpret_cast<const int4*>(smem + L::key_at + stage * L::key_bytes);
    const unsigned long long* members =
        reinterpret_cast<const unsigned long long*>(keys + kMmaKeys);

    // The mask first: bit 4j + 2 half + e of `hits` says whether the window of row group + 8 half
    // holds key 8j + 2 quad + e. An n-tile of 8 keys that no row of the warp reads (a key box
    // row far from the warp's queries, a chunk's end) costs no mma: `live` is the warp's union.
    const uint32_t hits = row_hits<kMmaKeys / 8>(members, 1, warp * 16 + group, quad);
    const unsigned live = __reduce_or_sync(0xffffffffu, hits);

    // S = Q K^T: n-tile j holds keys 8j..8j+7; B fragments of two k-steps per ldmatrix.x4
    // (matrix m: keys 8j + 0..7, head-dim columns 32p + 8m ..).
    float s[kMmaKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kMmaKeys / 8; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
      if (!tile_live(live, j)) continue;
#pragma unroll
      for (int p = 0; p < D / 32; ++p) {
        uint32_t kf[4];
        load_matrices(kf, ks + (8 * j + lane % 8) * L::ld + 32 * p + 8 * (lane / 8));
        if constexpr (kQInRegisters) {
          mma(s[j], qf[2 * p], kf[0], kf[1], T{});
          mma(s[j], qf[2 * p + 1], kf[2], kf[3], T{});
        } else {
          uint32_t qa[4], qb[4];
          load_matrices(qa, q_row + 32 * p);
          load_matrices(qb, q_row + 32 * p + 16);
          mma(s[j], qa, kf[0], kf[1], T{});
          mma(s[j], qb, kf[2], kf[3], T{});
        }
      }
    }

    // Scale and bias where the window holds the key, -inf elsewhere: s[j][2 * half + e] is row
    // group + 8 * half, key 8j + 2 quad + e.
    float chunk_max[2] = {-kInf, -kInf};
#pragma unroll
    for (int j = 0; j < kMmaKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float x = -kInf;
          if (hits >> (4 * j + 2 * half + e) & 1u) {
            x = s[j][2 * half + e] * scale_log2;
            if constexpr (kBias) {
              const int4 key = keys[8 * j + 2 * quad + e];
              const int at[3] = {key.x, key.y, key.z};
              x += widen(rpb_head[bias_entry(row_at[half], at, w)]) * kLog2e;
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
      float peak = chunk_max[half];
      peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, 1));
      peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, 2));
      next_max[half] = fmaxf(row_max[half], peak);
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

    warp_accumulate<T, D, kMmaKeys>(acc, s, vs, L::ld, lane, live);  // O += P V
    __syncthreads();  // this stage is free for the chunk after next
  }

  // o = O / l and lse = m ln 2 + ln l for the rows inside the piece.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    // From shared memory, not row_flat: holding that through the loop costs registers (spills).
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

}  // namespace tessera::ops::kernels::mma_detail
