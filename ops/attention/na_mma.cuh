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

/// Shared memory of the forward for head dim D: the Q tile, kStages chunks of K and of V (rows
/// padded by 8 elements: 16-byte aligned rows whose ldmatrix phases hit 8 distinct 16-byte bank
/// groups), the chunks' keys (int4 global coordinates, -1 past the box; then each key's row mask)
/// and the tile's local flat query positions (-1: outside the piece). The membership tables
/// (MaskTables) follow at `bytes`.
template <int D>
struct MmaLayout {
  static constexpr int ld = D + 8;
  static constexpr size_t q_bytes = size_t(kFusedQueries) * ld * 2;
  static constexpr size_t kv_bytes = size_t(kMmaKeys) * ld * 2;
  static constexpr size_t key_bytes = size_t(kMmaKeys) * (16 + 8);
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

/// Splits item n of a key (query) box with extents (b0, b1, b2) into its box coordinates, in 32
/// bits and by multiplications (b1, b2 as NaFastDiv): the streaming loops run this for every row
/// of every chunk. Box volumes stay below 2^31 on this path (na_mma_boxes_fit).
__device__ __forceinline__ void split_box(uint32_t n, const NaFastDiv& b1, const NaFastDiv& b2,
                                          int out[3]) {
  const uint32_t n2 = na_divide(n, b2);
  out[2] = static_cast<int>(n - n2 * b2.divisor);
  out[0] = static_cast<int>(na_divide(n2, b1));
  out[1] = static_cast<int>(n2 - static_cast<uint32_t>(out[0]) * b1.divisor);
}

/// The call's window attributes as 32-bit values (global extents stay below 2^30 on this path),
/// for the bias.
struct Windows {
  int kernel[3], dilation[3];
};
__device__ __forceinline__ Windows windows_of(const NaCall& c) {
  Windows w;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    w.kernel[a] = static_cast<int>(c.axes[a].kernel);
    w.dilation[a] = static_cast<int>(c.axes[a].dilation);
  }
  return w;
}

/// A block's tile and the box it streams: the tile's corner among the local queries (a query
/// tile) or in the key tile (a key tile), and per axis the union [lo, lo + box) of the windows of
/// the tile's queries (of the inverse windows of its keys: the local queries that may read them);
/// volume keys (queries) in all.
struct TileBox {
  int64_t corner[3], lo[3], box[3], volume;
};

/// Along axis a, the local queries (keys: the key tile) that tiles cut.
__device__ __forceinline__ int64_t tiled_extent(const NaCall& c, int a, bool keys) {
  return keys ? c.axes[a].tile : c.axes[a].queries;
}

/// Block `block`'s query tile (keys false) or key tile (keys true) and its box.
__device__ __forceinline__ TileBox tile_box(const NaCall& c, const NaTileShape& tile, int64_t block,
                                            bool keys) {
  TileBox t;
  t.volume = 1;
  int64_t tiles[3], coords[3];
#pragma unroll
  for (int a = 0; a < 3; ++a)
    tiles[a] = (tiled_extent(c, a, keys) + tile.extent[a] - 1) / tile.extent[a];
  split_flat(block, tiles[0], tiles[1], tiles[2], coords);
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    t.corner[a] = coords[a] * tile.extent[a];
    const int64_t offset = keys ? c.axes[a].tile_offset : c.axes[a].query_offset;
    const int64_t first = offset + t.corner[a], end = offset + tiled_extent(c, a, keys);
    const int64_t last = first + tile.extent[a] < end ? first + tile.extent[a] : end;
    int64_t hi;
    if (keys)
      na_axis_query_range(c.axes[a], first, last, t.lo[a], hi);
    else
      na_axis_key_range(c.axes[a], first, last, t.lo[a], hi);
    t.box[a] = hi - t.lo[a];
    t.volume *= t.box[a];
  }
  return t;
}

/// Row r of the block's tile: its global coordinates `at` and its flat position among the local
/// queries (keys: in the key tile), -1 for a row past them.
__device__ __forceinline__ long long tile_row(const NaCall& c, const NaTileShape& tile,
                                              const TileBox& t, int r, bool keys, int64_t at[3]) {
  int64_t u[3];
  split_flat(r, tile.extent[0], tile.extent[1], tile.extent[2], u);
  bool valid = true;
  long long flat = 0;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    const int64_t extent = tiled_extent(c, a, keys), local = t.corner[a] + u[a];
    valid = valid && local < extent;
    at[a] = (keys ? c.axes[a].tile_offset : c.axes[a].query_offset) + local;
    flat = flat * extent + local;
  }
  return valid ? flat : -1;
}

/// The entry of one head's bias table for query `query` and key `key` of its window:
/// (k - 1) + (key - query) / dilation per axis, over extents 2k - 1.
__device__ __forceinline__ int bias_entry(const int query[3], const int key[3], const Windows& w) {
  int index = 0;
#pragma unroll
  for (int a = 0; a < 3; ++a)
    index = index * (2 * w.kernel[a] - 1) + w.kernel[a] - 1 + (key[a] - query[a]) / w.dilation[a];
  return index;
}

/// Whether n-tile j (8 columns) of a warp's 16 x N block has a live element: `live` is the or
/// over the warp of each lane's hit bits, bit 4j + 2 half + e for row group + 8 half and column
/// 8j + 2 quad + e.
__device__ __forceinline__ bool tile_live(unsigned live, int j) {
  return (live >> (4 * j) & 0xFu) != 0;
}

/// The global coordinates of a lane's two rows of the block's tile (tile rows row0 and row0 + 8:
/// queries of a query tile, keys of a key tile; for the bias) and their flat positions (-1: past
/// the local queries or the key tile).
__device__ __forceinline__ void lane_rows(const NaCall& c, const NaTileShape& tile,
                                          const TileBox& t, int row0, bool keys, int at[2][3],
                                          long long flat[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int64_t i[3];
    flat[half] = tile_row(c, tile, t, row0 + 8 * half, keys, i);
#pragma unroll
    for (int a = 0; a < 3; ++a) at[half][a] = static_cast<int>(i[a]);
  }
}

// --- Membership: which rows of a tile an item of the streamed box meets -----------------------
// The window test of a (query, key) pair is a product over the axes, and so is the set of a
// tile's rows that meet one item of its box (a key of a query tile's key box, or a query of a key
// tile's query box): the rows whose coordinate along each axis is in that item's per-axis set.
// A block tabulates the per-axis sets once (a 64-bit mask over the tile's coordinates along the
// axis, per box coordinate), each chunk combines them into one 64-bit mask over the tile's rows
// per item, and a lane's hit test is a shift: no window arithmetic per (row, item) pair.

/// Where a block keeps its per-axis tables: `capacity[a]` masks for axis a from mask `offset[a]`
/// on, in 64-bit words after the kernel's own shared memory; then, `divisors` bytes after the
/// first mask, the box's extents along axes 1 and 2 as NaFastDiv (split_box's divisors: in
/// shared memory rather than held in registers through the streaming loop).
struct MaskTables {
  int capacity[3], offset[3];
  int divisors;
  size_t bytes;
};
inline MaskTables mask_tables(const NaCall& c, const NaTileShape& tile) {
  MaskTables m{};
  int64_t words = 0;
  for (int a = 0; a < 3; ++a) {
    m.capacity[a] = static_cast<int>(na_box_capacity(c.axes[a], tile.extent[a]));
    m.offset[a] = static_cast<int>(words);
    words += m.capacity[a];
  }
  m.divisors = static_cast<int>(words * 8);
  m.bytes = static_cast<size_t>(words) * 8 + 2 * sizeof(NaFastDiv);
  return m;
}

/// The block's split_box divisors (box extents along axes 1 and 2), after its tables.
__device__ __forceinline__ NaFastDiv* box_divisors(unsigned long long* masks, const MaskTables& m) {
  return reinterpret_cast<NaFastDiv*>(reinterpret_cast<unsigned char*>(masks) + m.divisors);
}
__device__ __forceinline__ const NaFastDiv* box_divisors(const unsigned long long* masks,
                                                         const MaskTables& m) {
  return box_divisors(const_cast<unsigned long long*>(masks), m);
}

/// Bits origin + t (t < extent) of a span's members, as bit t.
__device__ __forceinline__ unsigned long long span_bits(const NaSpan& span, int64_t origin,
                                                        int64_t extent) {
  if (span.count == 0 || extent <= 0) return 0;
  if (span.step == 1) {
    const int64_t lo = span.first - origin > 0 ? span.first - origin : 0;
    const int64_t hi = span.end() - origin < extent ? span.end() - origin : extent;
    if (hi <= lo) return 0;
    const unsigned long long width = hi - lo == 64 ? ~0ull : (1ull << (hi - lo)) - 1;
    return width << lo;
  }
  unsigned long long bits = 0;
  for (int64_t t = 0; t < extent; ++t)
    if (span.holds(origin + t)) bits |= 1ull << t;
  return bits;
}

/// Fills the block's per-axis tables (all threads; the caller synchronizes before use). For a
/// query tile (keys false): bit t of entry u along axis a says the tile's query at coordinate t
/// (inside the piece) has a window that holds key lo + u there (the key's inverse window). For a
/// key tile: that the window of query lo + u holds the tile's key at coordinate t (inside the
/// tile).
__device__ __forceinline__ void build_masks(const NaCall& c, const NaTileShape& tile,
                                            const TileBox& t, bool keys, const MaskTables& m,
                                            unsigned long long* masks) {
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    if (t.box[a] > m.capacity[a]) __trap();  // na_box_capacity is a bound (NaCudaPlan test)
    const int64_t rest = tiled_extent(c, a, keys) - t.corner[a];
    const int64_t extent = rest < tile.extent[a] ? rest : tile.extent[a];
    const int64_t origin = (keys ? c.axes[a].tile_offset : c.axes[a].query_offset) + t.corner[a];
    for (int64_t u = threadIdx.x; u < t.box[a]; u += kMmaWarps * kWarp) {
      const NaSpan span = keys ? na_axis_window(c.axes[a], t.lo[a] + u)
                               : na_axis_inverse_window(c.axes[a], t.lo[a] + u);
      masks[m.offset[a] + u] = span_bits(span, origin, extent);
    }
  }
}

/// A block's setup, the same in every kernel: its tile (keys: of the key tile) and the box it
/// streams, the flat positions of the tile's 64 rows into `flat` (threads 0..63), the
/// membership tables and split_box's divisors into `masks`. The caller synchronizes before
/// reading any of them.
__device__ __forceinline__ TileBox setup_tile(const NaCall& c, const NaTileShape& tile, bool keys,
                                              const MaskTables& m, long long* flat,
                                              unsigned long long* masks) {
  const TileBox t = tile_box(c, tile, blockIdx.x, keys);
  if (threadIdx.x < 64) {
    int64_t at[3];
    flat[threadIdx.x] = tile_row(c, tile, t, threadIdx.x, keys, at);
  }
  build_masks(c, tile, t, keys, m, masks);
  if (threadIdx.x == 0) {  // an empty box (an extent 0) splits nothing: its divisors stay 1
    NaFastDiv* divisors = box_divisors(masks, m);
    divisors[0] = na_fast_div(t.box[1] > 0 ? static_cast<uint32_t>(t.box[1]) : 1u);
    divisors[1] = na_fast_div(t.box[2] > 0 ? static_cast<uint32_t>(t.box[2]) : 1u);
  }
  return t;
}

/// The rows of the tile (row (t0 E1 + t1) E2 + t2 for tile extents E) that meet the box item at
/// box coordinates u: the product of the per-axis sets.
__device__ __forceinline__ unsigned long long row_mask(const unsigned long long* masks,
                                                       const MaskTables& m, const int u[3],
                                                       const NaTileShape& tile) {
  const unsigned long long m0 = masks[m.offset[0] + u[0]], m1 = masks[m.offset[1] + u[1]],
                           m2 = masks[m.offset[2] + u[2]];
  const int e1 = static_cast<int>(tile.extent[1]), e2 = static_cast<int>(tile.extent[2]);
  unsigned long long rows = 0;
  for (int t0 = 0; t0 < tile.extent[0]; ++t0)
    if (m0 >> t0 & 1)
      for (int t1 = 0; t1 < e1; ++t1)
        if (m1 >> t1 & 1) rows |= m2 << ((t0 * e1 + t1) * e2);
  return rows;
}

/// The hit bits of a lane's two rows (row0, row0 + 8 of the tile) against n-tiles [0, kTiles) of
/// a chunk's items (each item's row mask at `members`, stride `stride` words): bit 4j + 2 half + e
/// for row half and item 8j + 2 quad + e.
template <int kTiles>
__device__ __forceinline__ uint32_t row_hits(const unsigned long long* members, int stride,
                                             int row0, int quad) {
  uint32_t hits = 0;
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const unsigned long long rows = members[(8 * j + 2 * quad + e) * stride] >> row0;
      hits |= static_cast<uint32_t>(rows & 1) << (4 * j + e);
      hits |= static_cast<uint32_t>(rows >> 8 & 1) << (4 * j + 2 + e);
    }
  }
  return hits;
}

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

/// 64 rows of D elements into shared tiles (leading dimension ld) with cp.async, each thread of
/// the block taking its share: row r of `a` (and of `b` when given) from source + at(r) (element
/// offsets of the row's start), zeros where at(r) < 0.
template <typename T, int D, typename At>
__device__ __forceinline__ void load_rows(T* a, const T* a_source, T* b, const T* b_source, int ld,
                                          At&& at) {
  constexpr int kVector = 8, kRowVectors = D / kVector;
  for (int index = threadIdx.x; index < 64 * kRowVectors; index += kMmaWarps * kWarp) {
    const int row = index / kRowVectors, col = index % kRowVectors * kVector;
    const int64_t start = at(row);
    const int64_t offset = start >= 0 ? start + col : 0;
    copy_async(a + row * ld + col, a_source + offset, start >= 0);
    if (b != nullptr) copy_async(b + row * ld + col, b_source + offset, start >= 0);
  }
}

/// One step of a two-stage pipeline over `chunks` chunks: issues chunk + 1 into the other stage
/// (load(chunk + 1, stage)) when there is one, then waits until chunk `chunk` has landed for the
/// whole block. Returns chunk's stage.
template <typename Load>
__device__ __forceinline__ int next_chunk(int64_t chunk, int64_t chunks, Load&& load) {
  const int stage = static_cast<int>(chunk % kStages);
  if (chunk + 1 < chunks) {
    load(chunk + 1, (stage + 1) % kStages);
    commit_async();
    wait_async<1>();
  } else {
    wait_async<0>();
  }
  __syncthreads();
  return stage;
}

/// Chunk `chunk` (64 keys) of a query tile's key box `t` for (batch b, head h): K and V rows
/// into ks and vs (leading dimension ld; cp.async, zeros past the box), the keys' global
/// coordinates into `keys` (-1 past the box) and the rows of the tile each key meets into
/// `members` (from the block's tables `masks`; 0 past the box), each thread of the block taking
/// its share.
template <typename T, int D>
__device__ __forceinline__ void load_key_chunk(const NaCall& c, const NaTileShape& tile,
                                               const TileBox& t, const MaskTables& m,
                                               const unsigned long long* masks, int64_t b,
                                               int64_t h, int64_t chunk, const T* k, const T* v,
                                               T* ks, T* vs, int4* keys,
                                               unsigned long long* members, int ld) {
  const int tid = threadIdx.x;
  const int64_t first_key = chunk * 64;
  const NaFastDiv* divisors = box_divisors(masks, m);
  load_rows<T, D>(ks, k, vs, v, ld, [&](int row) -> int64_t {
    if (first_key + row >= t.volume) return -1;
    int j[3];
    split_box(static_cast<uint32_t>(first_key + row), divisors[0], divisors[1], j);
    int64_t position = 0;
#pragma unroll
    for (int a = 0; a < 3; ++a)
      position = position * c.axes[a].tile + (t.lo[a] + j[a] - c.axes[a].tile_offset);
    return ((b * c.tile_count() + position) * c.heads + h) * c.dim;
  });
  if (tid < 64) {
    int4 key = make_int4(-1, -1, -1, 0);
    unsigned long long rows = 0;
    if (first_key + tid < t.volume) {
      int j[3];
      split_box(static_cast<uint32_t>(first_key + tid), divisors[0], divisors[1], j);
      key = make_int4(static_cast<int>(t.lo[0] + j[0]), static_cast<int>(t.lo[1] + j[1]),
                      static_cast<int>(t.lo[2] + j[2]), 0);
      rows = row_mask(masks, m, j, tile);
    }
    keys[tid] = key;
    members[tid] = rows;
  }
}

#if TESSERA_NA_MMA
/// s = A B^T for one warp: A the 16 rows at `a` (D elements each, leading dimension ld), B the N
/// rows at `b`; n-tile j of s holds columns 8j..8j+7 (rows of B), computed only where
/// tile_live(live, j) (0 elsewhere). A's fragments through ldmatrix
/// (matrices: rows 0-7 | 8-15 x columns 0-7 | 8-15 of each 16-column step), B's through
/// ldmatrix of two 16-column steps at once (matrix m: rows 8j + 0..7, columns 32p + 8m ..).
template <typename T, int D, int N>
__device__ __forceinline__ void warp_scores(float s[N / 8][4], const T* a, const T* b, int ld,
                                            int lane, unsigned live) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
  for (int p = 0; p < D / 32; ++p) {
    uint32_t a0[4], a1[4];
    const T* a_row = a + (lane % 8 + 8 * ((lane / 8) % 2)) * ld + 32 * p + 8 * (lane / 16);
    load_matrices(a0, a_row);
    load_matrices(a1, a_row + 16);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      if (!tile_live(live, j)) continue;
      uint32_t bf[4];
      load_matrices(bf, b + (8 * j + lane % 8) * ld + 32 * p + 8 * (lane / 8));
      mma(s[j], a0, bf[0], bf[1], T{});
      mma(s[j], a1, bf[2], bf[3], T{});
    }
  }
}

/// acc += P B for one warp: P (16 x N) the values in s's accumulator layout, rounded to T (an
/// n-tile pair of accumulators is one 16-column A fragment), B the N rows at `b` (D elements,
/// leading dimension ld) through ldmatrix.trans (matrix m: rows 16t + 8 (m % 2) + 0..7,
/// columns 8n + 8 (m / 2) ..). 16-column steps with no live n-tile are skipped (P is 0 there).
template <typename T, int D, int N>
__device__ __forceinline__ void warp_accumulate(float acc[D / 8][4], const float s[N / 8][4],
                                                const T* b, int ld, int lane, unsigned live) {
#pragma unroll
  for (int t = 0; t < N / 16; ++t) {
    if (!tile_live(live, 2 * t) && !tile_live(live, 2 * t + 1)) continue;
    uint32_t pf[4];
    pf[0] = pack(s[2 * t][0], s[2 * t][1], T{});
    pf[1] = pack(s[2 * t][2], s[2 * t][3], T{});
    pf[2] = pack(s[2 * t + 1][0], s[2 * t + 1][1], T{});
    pf[3] = pack(s[2 * t + 1][2], s[2 * t + 1][3], T{});
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      uint32_t bf[4];
      load_matrices_transposed(
          bf, b + (16 * t + lane % 8 + 8 * ((lane / 8) % 2)) * ld + 8 * n + 8 * (lane / 16));
      mma(acc[n], pf, bf[0], bf[1], T{});
      mma(acc[n + 1], pf, bf[2], bf[3], T{});
    }
  }
}
#endif

}  // namespace tessera::ops::kernels::mma_detail
