// Fast cpu neighborhood attention (see na_cpu.hpp).
//
// Layout: heads-last, so the D values of one (position, head) are contiguous and every inner
// loop runs over D with unit stride. Every call is seen as 3-d (na_problem.hpp).
//
// Query tiles (D of 32, 64 or 128, f32, and f64 with AVX2 or AVX-512): the forward and the
// backward's query pass take up to 4 queries at once that are neighbours along one axis in one
// dilation group. Their windows agree on the other axes and overlap on that one, so a k/v row is
// loaded once for every query of the tile that reads it: the logits of the tile's queries against
// a group of keys are register-wide partial sums (each query register meeting each key register)
// reduced together by one transpose-and-add tree, and p.v keeps a block of queries x registers
// of D in registers while the v rows stream past. Each query's softmax is done in passes over
// its window's logits (maximum, exponentials as one vector loop: f32 a polynomial exp of ~1 ulp,
// f64 std::exp; their sum). Other head sizes run the same per query: neighbours in blocks of one
// register's lanes, the query's dot products with the block reduced by the same tree.
//
// Key tiles: the backward's key pass (dk, dv) is the query pass of the mirrored problem (keys as
// queries, each key's inverse window as its window), so where the query pass is tiled up to 4
// keys that are neighbours along one axis share the q and grad_output rows they read.
//
// Threads: the forward and the query pass of the backward split the query tiles (or the
// (batch, query) rows); the key pass of the backward splits the key tiles (or the (batch, key)
// rows of the tile) and gathers, per key, the queries whose window holds it (the inverse window,
// an interval of each dilation group per axis because window starts and ends never decrease
// with the query). Each output row is written by exactly
// one thread; d rpb is summed in per-thread slots and reduced at the end.
//
// Instruction sets: the loop bodies are compiled three times (x86-64-v4 with 512-bit vectors,
// x86-64-v3, and the build's default target) and the best one the cpu supports is picked at run
// time, so a portable binary still uses AVX-512/AVX2 + FMA. Other compilers and architectures get
// the default build only.
#include "ops/attention/na_cpu.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/parallel_for.hpp"
#include "ops/attention/na_problem.hpp"
#include "ops/cpu_isa.hpp"
#include "ops/pointwise/vector_math.hpp"

#if TESSERA_MULTI_ISA
#define TESSERA_NA_INLINE [[gnu::always_inline]] inline
#else
#define TESSERA_NA_INLINE inline
#endif

namespace tessera::ops {

namespace {

using namespace na_detail;

// ---------------------------------------------------------------------------------------------
// Vector loops over D (Dim > 0: D known at compile time; 0: D read at run time). W is the width
// of one vector register in bytes: 64 with AVX-512, 32 with AVX2, 16 otherwise. Every loop keeps
// at most 16 vectors live, so that none spills on AVX2 (16 registers) and AVX-512 (32).

/// One register of T, W bytes wide, as a GCC/Clang vector type.
template <typename T, int W>
struct VecOf {
  typedef T type __attribute__((vector_size(W)));
};
template <typename T, int W>
using Vec = typename VecOf<T, W>::type;
/// Lanes of a register; also the rows per block of dot products (one lane of the result each).
template <typename T, int W>
constexpr int kLanes = W / static_cast<int>(sizeof(T));

template <int W, typename T>
TESSERA_NA_INLINE Vec<T, W> load(const T* p) {
  Vec<T, W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int W, typename T>
TESSERA_NA_INLINE void store(T* p, const Vec<T, W>& v) {
  std::memcpy(p, &v, sizeof v);
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define TESSERA_NA_HAVE_SHUFFLEVECTOR 1
#else
#define TESSERA_NA_HAVE_SHUFFLEVECTOR 0
#endif

/// Lane t of the result: the sum of the lanes of s[t] (t < L = lanes). s is overwritten.
#if TESSERA_NA_HAVE_SHUFFLEVECTOR
/// Lane p of the shuffles that add, pairwise, two registers holding L / M rows each (M lanes per
/// row, rows in order) into one holding 2L / M rows of M / 2 lanes: the low (Hi false) or high
/// half of the row's lanes in a (segments before L / M) or b (offset L).
template <int L, int M, bool Hi>
constexpr int merged_lane(int p) {
  const int half = M / 2, segment = p / half, offset = p % half, rows = L / M;
  const int base = segment < rows ? segment * M : L + (segment - rows) * M;
  return base + (Hi ? half : 0) + offset;
}

template <int M, typename V, size_t... P>
TESSERA_NA_INLINE V merge_rows(V a, V b, std::index_sequence<P...>) {
  constexpr int L = sizeof...(P);
  return __builtin_shufflevector(a, b, merged_lane<L, M, false>(P)...) +
         __builtin_shufflevector(a, b, merged_lane<L, M, true>(P)...);
}

/// The transpose-and-add tree: each level adds the two halves of two registers into one, L - 1
/// shuffle pairs for L rows instead of log2(L) per row.
template <int L, int M = L, typename V>
TESSERA_NA_INLINE V lane_sums(V* s) {
  if constexpr (M == 1) {
    return s[0];
  } else {
    for (int i = 0; i < M / 2; ++i)
      s[i] = merge_rows<M>(s[2 * i], s[2 * i + 1], std::make_index_sequence<L>{});
    return lane_sums<L, M / 2>(s);
  }
}
#else
template <int L, typename V>
TESSERA_NA_INLINE V lane_sums(V* s) {
  V result = {};
  for (int t = 0; t < L; ++t)
    for (int l = 0; l < L; ++l) result[t] += s[t][l];
  return result;
}
#endif

/// Lane t of the result is a . rows[t] for t < Rows (0 beyond), Rows <= lanes. The rows are
/// walked together, one register of D at a time, so a is loaded once per register and the
/// rows' partial sums are independent chains of fused multiply-adds.
template <int W, int Dim, int Rows, typename T>
TESSERA_NA_INLINE Vec<T, W> dots_rows(const T* a, const T* const* rows, int64_t dim) {
  constexpr int lanes = kLanes<T, W>;
  using V = Vec<T, W>;
  const int64_t n = Dim > 0 ? Dim : dim;
  V s[lanes];
  for (V& v : s) v = V{};
  int64_t e = 0;
  for (; e + lanes <= n; e += lanes) {
    const V av = load<W>(a + e);
    for (int t = 0; t < Rows; ++t) s[t] += av * load<W>(rows[t] + e);
  }
  if constexpr (Dim == 0 || Dim % lanes != 0) {
    for (int t = 0; t < Rows; ++t) {
      T tail = 0;
      for (int64_t f = e; f < n; ++f) tail += a[f] * rows[t][f];
      s[t][0] += tail;
    }
  }
  return lane_sums<lanes>(s);
}

/// Lane t of the result is a . rows[t] for t < count <= lanes (0 beyond). A block of few rows
/// (the last of a window, say 1 of 49) computes only the next power of two of them.
template <int W, int Dim, typename T, int Rows = kLanes<T, W>>
TESSERA_NA_INLINE Vec<T, W> dots_block(const T* a, const T* const* rows, int count, int64_t dim) {
  if constexpr (Rows > 1) {
    if (count <= Rows / 2) return dots_block<W, Dim, T, Rows / 2>(a, rows, count, dim);
  }
  const T* r[Rows];
  for (int t = 0; t < Rows; ++t) r[t] = rows[t < count ? t : 0];
  Vec<T, W> result = dots_rows<W, Dim, Rows>(a, r, dim);
  for (int t = count; t < Rows; ++t) result[t] = 0;
  return result;
}

/// acc[e] = (overwrite ? 0 : factor * acc[e]) + sum_{t < count} w[t] rows[t][e] for e < D. With D
/// a compile-time multiple of the register width, up to 8 registers of acc stay in registers
/// while the rows stream past, and with few registers per row (small D) consecutive rows go to
/// separate sums, so that there are always 8 independent chains of fused multiply-adds.
template <int W, int Dim, typename T>
TESSERA_NA_INLINE void accumulate_rows(T* acc, bool overwrite, T factor, const T* w,
                                       const T* const* rows, int count, int64_t dim) {
  constexpr int lanes = kLanes<T, W>;
  using V = Vec<T, W>;
  if constexpr (Dim > 0 && Dim % lanes == 0) {
    constexpr int vectors = Dim / lanes;
    constexpr int group = vectors < 8 ? vectors : 8;
    constexpr int streams = 8 / group;
    static_assert(vectors % group == 0, "D must be a power-of-two multiple of the width");
    for (int g = 0; g < vectors; g += group) {
      T* out = acc + g * lanes;
      V sums[streams][group];
      for (int i = 0; i < group; ++i) {
        sums[0][i] = overwrite ? V{} : load<W>(out + i * lanes) * factor;
        for (int s = 1; s < streams; ++s) sums[s][i] = V{};
      }
      int t = 0;
      for (; t + streams <= count; t += streams)
        for (int s = 0; s < streams; ++s) {
          const T weight = w[t + s];
          const T* row = rows[t + s] + g * lanes;
          for (int i = 0; i < group; ++i) sums[s][i] += weight * load<W>(row + i * lanes);
        }
      for (; t < count; ++t)
        for (int i = 0; i < group; ++i)
          sums[0][i] += w[t] * load<W>(rows[t] + g * lanes + i * lanes);
      for (int i = 0; i < group; ++i) {
        for (int s = 1; s < streams; ++s) sums[0][i] += sums[s][i];
        store<W>(out + i * lanes, sums[0][i]);
      }
    }
  } else {
    const int64_t n = Dim > 0 ? Dim : dim;
    T* __restrict out = acc;
    for (int64_t e = 0; e < n; ++e) out[e] = overwrite ? T(0) : out[e] * factor;
    for (int t = 0; t < count; ++t) {
      const T weight = w[t];
      const T* __restrict row = rows[t];
      for (int64_t e = 0; e < n; ++e) out[e] += weight * row[e];
    }
  }
}

/// out[e] = factor * acc[e] for e < n.
template <typename T>
TESSERA_NA_INLINE void store_scaled(T* __restrict out, const T* __restrict acc, T factor,
                                    int64_t n) {
  for (int64_t e = 0; e < n; ++e) out[e] = acc[e] * factor;
}

/// Asks for the cache lines of the `count` values of a row ahead of reading (Write = 0) or
/// writing (1) them, so that fetching them (the row is usually not cached) overlaps computation.
template <int Write, typename T>
TESSERA_NA_INLINE void prefetch_row(const T* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(T)); offset += 64)
    __builtin_prefetch(bytes + offset, Write, 3);
}

/// prefetch_row of an output row: its store then does not stall on the fetch.
template <typename T>
TESSERA_NA_INLINE void prefetch_for_write(const T* row, int64_t count) {
  prefetch_row<1>(row, count);
}

/// exp(x) on every lane of an f32 register for x in [-87, 88]: exp(x) = 2^n exp(r) with
/// n = round(x / ln 2), |r| <= ln(2) / 2, and a degree-6 polynomial for exp(r) (about 1 ulp), in
/// lane-wise vector operations.
template <int W>
TESSERA_NA_INLINE Vec<float, W> exp_in_range(Vec<float, W> x) {
  using V = Vec<float, W>;
  using I = Vec<int32_t, W>;
  const V shifter = V{} + 12582912.0f;
  const V shifted = x * 1.44269504088896341f + shifter;
  const V n = shifted - shifter;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // exp(r) = 1 + r + r^2 (c0 + c1 r + ... + c5 r^5), the bracket in Estrin's scheme (pairs, then
  // pairs of pairs): three multiply-adds deep rather than Horner's six, so more of the loop's
  // independent exponentials overlap.
  const V r2 = r * r;
  const V p01 = r * 1.6666665459e-1f + 5.0000001201e-1f;
  const V p23 = r * 8.3334519073e-3f + 4.1665795894e-2f;
  const V p45 = r * 1.9875691500e-4f + 1.3981999507e-3f;
  const V poly = (p01 + r2 * (p23 + r2 * p45)) * r2 + (r + 1.0f);
  const I exponent = (std::bit_cast<I>(shifted) - std::bit_cast<int32_t>(12582912.0f) + 127) << 23;
  return poly * std::bit_cast<V>(exponent);
}

/// exp(x) on every lane of an f32 register (softmax weights, x <= 0; exp_in_range with x clamped
/// to its range). Below -87 it returns 0 (the exact value is under 2e-38, nothing against a
/// softmax denominator >= 1).
template <int W>
TESSERA_NA_INLINE Vec<float, W> exp_lanes(Vec<float, W> x) {
  using V = Vec<float, W>;
  const V low = V{} - 87.0f, high = V{} + 88.0f;
  V clamped = x < low ? low : x;
  clamped = clamped > high ? high : clamped;
  return x < low ? V{} : exp_in_range<W>(clamped);
}

/// exp_lanes for the softmax of masked logits (x <= 0): x below -87 (masked lanes are -inf)
/// gives exp(-87), about 1.6e-38, rather than 0. Such a weight is never used, and its share of a
/// denominator >= 1 is below the last bit; exp_lanes' upper clamp and final blend, which this
/// leaves out, are a fifth of its work.
template <int W>
TESSERA_NA_INLINE Vec<float, W> exp_lanes_floored(Vec<float, W> x) {
  using V = Vec<float, W>;
  const V low = V{} - 87.0f;
  return exp_in_range<W>(low > x ? low : x);  // a NaN stays NaN
}

/// f64: std::exp per lane.
template <int W>
TESSERA_NA_INLINE Vec<double, W> exp_lanes(Vec<double, W> x) {
  for (int l = 0; l < kLanes<double, W>; ++l) x[l] = std::exp(x[l]);
  return x;
}

/// values[t] = exp(values[t] - shift) for t < count, 0 for count <= t < lanes (values holds one
/// whole register); returns their sum.
template <int W, typename T>
TESSERA_NA_INLINE T exp_block(T* values, int count, T shift) {
  using V = Vec<T, W>;
  V e = exp_lanes<W>(load<W>(values) - shift);
  for (int t = count; t < kLanes<T, W>; ++t) e[t] = 0;
  store<W>(values, e);
  T sum = 0;
  for (int t = 0; t < kLanes<T, W>; ++t) sum += e[t];
  return sum;
}

/// The largest of values[0, count); values has room for whole registers, and the lanes past
/// count are set to -inf.
template <int W, typename T>
TESSERA_NA_INLINE T max_of(T* values, int64_t count) {
  using V = Vec<T, W>;
  constexpr int lanes = kLanes<T, W>;
  const int64_t padded = (count + lanes - 1) / lanes * lanes;
  for (int64_t t = count; t < padded; ++t) values[t] = -std::numeric_limits<T>::infinity();
  V best = V{} - std::numeric_limits<T>::infinity();
  for (int64_t t = 0; t < padded; t += lanes) {
    const V v = load<W>(values + t);
    best = v > best ? v : best;
  }
  T result = best[0];
  for (int l = 1; l < lanes; ++l) result = std::max(result, best[l]);
  return result;
}

/// values[t] = exp(values[t] - shift) for t < count (lanes past count, -inf from max_of, become
/// 0); returns their sum. shift must be finite.
template <int W, typename T>
TESSERA_NA_INLINE T exp_sum(T* values, int64_t count, T shift) {
  using V = Vec<T, W>;
  constexpr int lanes = kLanes<T, W>;
  V sum = V{};
  for (int64_t t = 0; t < count; t += lanes) {
    const V e = exp_lanes<W>(load<W>(values + t) - shift);
    store<W>(values + t, e);
    sum += e;
  }
  T result = 0;
  for (int l = 0; l < lanes; ++l) result += sum[l];
  return result;
}

// ---------------------------------------------------------------------------------------------
// Windows and inverse windows.

/// The neighbours of local query (x, y, z) in window order: flat tile positions and flat bias
/// indices (of one head). Returns how many there are; a window row (innermost axis) holds
/// p.windows[2][z].count consecutive ones.
TESSERA_NA_INLINE int64_t neighbours_of(const Problem& p, int64_t x, int64_t y, int64_t z,
                                        int64_t* positions, int64_t* bias_indices) {
  const NaWindow& w0 = p.windows[0][x];
  const NaWindow& w1 = p.windows[1][y];
  const NaWindow& w2 = p.windows[2][z];
  const int64_t g0 = p.query_offset[0] + x, g1 = p.query_offset[1] + y;
  const int64_t g2 = p.query_offset[2] + z;
  int64_t count = 0;
  for (int64_t t0 = 0; t0 < w0.count; ++t0) {
    const int64_t j0 = w0.first + t0 * w0.step;
    const int64_t b0 = p.kernel[0] - 1 + (j0 - g0) / p.dilation[0];
    for (int64_t t1 = 0; t1 < w1.count; ++t1) {
      const int64_t j1 = w1.first + t1 * w1.step;
      const int64_t b1 = p.kernel[1] - 1 + (j1 - g1) / p.dilation[1];
      const int64_t row =
          ((j0 - p.tile_offset[0]) * p.tile[1] + (j1 - p.tile_offset[1])) * p.tile[2];
      for (int64_t t2 = 0; t2 < w2.count; ++t2, ++count) {
        const int64_t j2 = w2.first + t2 * w2.step;
        positions[count] = row + j2 - p.tile_offset[2];
        bias_indices[count] =
            (b0 * p.rpb[1] + b1) * p.rpb[2] + p.kernel[2] - 1 + (j2 - g2) / p.dilation[2];
      }
    }
  }
  return count;
}

/// Per axis and tile row: the local queries whose window holds that key, {first, count, step}
/// (count 0: none).
struct InverseWindows {
  std::array<std::vector<NaWindow>, kAxes> axis;
};

InverseWindows inverse_windows(const Problem& p) {
  InverseWindows inverse;
  for (int a = 0; a < kAxes; ++a) {
    std::vector<int64_t> lo(p.tile[a], std::numeric_limits<int64_t>::max()), hi(p.tile[a], -1);
    for (int64_t i = 0; i < p.queries[a]; ++i) {
      const NaWindow& w = p.windows[a][i];
      for (int64_t t = 0; t < w.count; ++t) {
        const int64_t key = w.first + t * w.step - p.tile_offset[a];
        lo[key] = std::min(lo[key], i);
        hi[key] = std::max(hi[key], i);
      }
    }
    inverse.axis[a].resize(p.tile[a]);
    for (int64_t j = 0; j < p.tile[a]; ++j)
      inverse.axis[a][j] =
          hi[j] < 0 ? NaWindow{0, 0, 1}
                    : NaWindow{lo[j], (hi[j] - lo[j]) / p.dilation[a] + 1, p.dilation[a]};
  }
  return inverse;
}

// ---------------------------------------------------------------------------------------------
// Query tiles: the forward and the backward's query pass take up to kTileQueries queries at once
// that are neighbours along one axis (the tile axis) in one dilation group. Their windows are the
// same on the other axes and, on the tile axis, overlap in all but a few key rows ("slabs": the
// keys of one index on the tile axis), so each k/v row loaded serves every query of the tile
// whose window holds it, from registers: per slab, the queries reading it are a contiguous run
// of the tile (window starts and ends never decrease with the query), and runs of slabs read by
// the same queries are handled as one segment of keys.

/// Queries per tile for registers of W bytes of T: 4, or the lanes if fewer (the logits of a
/// tile's queries against a group of keys fill one register, one lane per (query, key)).
template <int W, typename T>
constexpr int kTileQueries = kLanes<T, W> < 4 ? kLanes<T, W> : 4;

/// Queries per tile of the forward for small windows on the tile axis (kWideTileLimit keys or
/// fewer): 8 where a register holds 16 lanes (f32 on AVX-512). A 4-query tile of a k = 7 window
/// has 6 of its 10 key slabs at the ends, read by 1-3 queries; with 8 queries each slab serves 4
/// on average instead of 2.8, so there are fewer k/v loads, reduction trees and accumulator loads
/// per query. With 8 lanes (AVX2) a group of tile_dots would be 8 queries x 1 key, whose 8 query
/// and 8 sum registers do not fit the 16 registers: measured no faster than 4 queries there.
template <int W, typename T>
constexpr int kWideTileQueries = kLanes<T, W> < 16 ? kTileQueries<W, T> : 8;
constexpr int64_t kWideTileLimit = 9;

/// Whether the tiled kernels run for registers of W bytes of T and head size Dim: D known at
/// compile time and a multiple of the register, and at least 4 lanes (f64 without AVX uses the
/// per-query kernels).
template <int W, typename T, int Dim>
constexpr bool kTiled = Dim > 0 && Dim % kLanes<T, W> == 0 && kLanes<T, W> >= 4;

/// The tiles of the local queries along the tile axis: tile t holds `count[t]` queries from
/// local index `first[t]` with the axis' dilation as step, so that they share a dilation group.
struct QueryTiles {
  int axis = 2;
  std::vector<int64_t> first;
  std::vector<int> count;
};

/// The tile axis of a problem: the second-to-last spatial axis of 2-d and 3-d calls (the last
/// axis then varies fastest between consecutive tiles, which share most of their keys), the
/// only one of 1-d calls.
int tile_axis(const Problem& p) {
  return p.spatial >= 2 ? 1 : 2;
}

/// Tiles of up to `tile_queries` queries along `axis`, each within one dilation group.
QueryTiles query_tiles_on(const Problem& p, int axis, int tile_queries) {
  QueryTiles tiles;
  tiles.axis = axis;
  const int64_t n = p.queries[axis], step = p.dilation[axis];
  // Local indices r, r + d, r + 2d ... are one dilation group whatever the piece's offset.
  for (int64_t r = 0; r < std::min(n, step); ++r)
    for (int64_t i = r; i < n; i += tile_queries * step) {
      tiles.first.push_back(i);
      tiles.count.push_back(
          static_cast<int>(std::min<int64_t>(tile_queries, (n - 1 - i) / step + 1)));
    }
  return tiles;
}

QueryTiles query_tiles(const Problem& p, int tile_queries) {
  return query_tiles_on(p, tile_axis(p), tile_queries);
}

/// The axes other than the tile axis, outer first.
std::array<int, 2> other_axes(int axis) {
  return axis == 0   ? std::array<int, 2>{1, 2}
         : axis == 1 ? std::array<int, 2>{0, 2}
                     : std::array<int, 2>{0, 1};
}

/// Items of the tiled loops: (batch, outer axis query, tile, inner axis query), the inner axis
/// fastest.
int64_t tile_items(const Problem& p, const QueryTiles& tiles) {
  const auto [outer, inner] = other_axes(tiles.axis);
  return p.batch * p.queries[outer] * static_cast<int64_t>(tiles.first.size()) * p.queries[inner];
}

/// One segment of a tile: slabs [slab_begin, slab_end) of the union of the windows on the tile
/// axis, read by the tile's queries [query_begin, query_end).
struct Segment {
  int64_t slab_begin, slab_end;
  int query_begin, query_end;
};

/// The geometry of one tile: its queries, the keys of the union of their windows in slab order,
/// the segments, and where each query's window starts among the slabs.
struct TileKeys {
  int queries = 0;
  int64_t batch = 0;
  int64_t flat[8];                       // local flat query index of each query of the tile
  int64_t global_on_axis[8];             // global index on the tile axis of each query
  int64_t first_slab[8];                 // slab of the first key of each query's window
  int64_t slabs_of[8];                   // window keys on the tile axis of each query
  int64_t inner = 0;                     // keys per slab (the window on the other axes)
  std::vector<int64_t> positions;        // flat tile positions, slab-major: slab * inner + i
  std::vector<int64_t> inner_bias;       // the other axes' part of the bias index, per i
  std::vector<int64_t> inner_positions;  // the other axes' part of the flat position, per i
  int64_t first_key = 0;                 // global index on the tile axis of slab 0
  std::vector<Segment> segments;
};

/// Fills `keys` for tile item `item` (see tile_items).
TESSERA_NA_INLINE void tile_keys(const Problem& p, const QueryTiles& tiles, int64_t item,
                                 TileKeys& keys) {
  const int a = tiles.axis;
  const auto [outer, inner] = other_axes(a);
  const int64_t tile_count = static_cast<int64_t>(tiles.first.size());
  const int64_t inner_index = item % p.queries[inner];
  int64_t rest = item / p.queries[inner];
  const int64_t tile = rest % tile_count;
  rest /= tile_count;
  const int64_t outer_index = rest % p.queries[outer];
  keys.batch = rest / p.queries[outer];
  keys.queries = tiles.count[tile];
  const int64_t step = p.dilation[a];
  const std::array<int64_t, kAxes> stride{p.tile[1] * p.tile[2], p.tile[2], 1};
  const std::array<int64_t, kAxes> bias_stride{p.rpb[1] * p.rpb[2], p.rpb[2], 1};
  int64_t coord[kAxes];
  coord[outer] = outer_index;
  coord[inner] = inner_index;
  const NaWindow& first_window = p.windows[a][tiles.first[tile]];
  keys.first_key = first_window.first;
  int64_t last_key = first_window.first;
  for (int u = 0; u < keys.queries; ++u) {
    coord[a] = tiles.first[tile] + u * step;
    keys.flat[u] = (coord[0] * p.queries[1] + coord[1]) * p.queries[2] + coord[2];
    keys.global_on_axis[u] = p.query_offset[a] + coord[a];
    const NaWindow& w = p.windows[a][coord[a]];
    keys.first_slab[u] = (w.first - keys.first_key) / step;
    keys.slabs_of[u] = w.count;
    last_key = std::max(last_key, w.first + (w.count - 1) * step);
  }
  // The other axes' window, outer axis first (the reference's window order restricted to them).
  const NaWindow& wo = p.windows[outer][outer_index];
  const NaWindow& wi = p.windows[inner][inner_index];
  const int64_t go = p.query_offset[outer] + outer_index, gi = p.query_offset[inner] + inner_index;
  keys.inner = wo.count * wi.count;
  keys.inner_bias.resize(keys.inner);
  std::vector<int64_t>& inner_positions = keys.inner_positions;
  inner_positions.resize(keys.inner);
  int64_t i = 0;
  for (int64_t to = 0; to < wo.count; ++to) {
    const int64_t jo = wo.first + to * wo.step;
    for (int64_t ti = 0; ti < wi.count; ++ti, ++i) {
      const int64_t ji = wi.first + ti * wi.step;
      inner_positions[i] =
          (jo - p.tile_offset[outer]) * stride[outer] + (ji - p.tile_offset[inner]) * stride[inner];
      keys.inner_bias[i] =
          (p.kernel[outer] - 1 + (jo - go) / p.dilation[outer]) * bias_stride[outer] +
          (p.kernel[inner] - 1 + (ji - gi) / p.dilation[inner]) * bias_stride[inner];
    }
  }
  const int64_t slabs = (last_key - keys.first_key) / step + 1;
  keys.positions.resize(slabs * keys.inner);
  for (int64_t s = 0; s < slabs; ++s) {
    const int64_t slab_position = (keys.first_key + s * step - p.tile_offset[a]) * stride[a];
    for (int64_t n = 0; n < keys.inner; ++n)
      keys.positions[s * keys.inner + n] = slab_position + inner_positions[n];
  }
  // Segments: the queries reading slab s are a contiguous run (windows move monotonically).
  keys.segments.clear();
  for (int64_t s = 0; s < slabs; ++s) {
    int begin = keys.queries, end = 0;
    for (int u = 0; u < keys.queries; ++u)
      if (s >= keys.first_slab[u] && s < keys.first_slab[u] + keys.slabs_of[u]) {
        begin = std::min(begin, u);
        end = u + 1;
      }
    if (begin >= end) continue;
    if (!keys.segments.empty() && keys.segments.back().slab_end == s &&
        keys.segments.back().query_begin == begin && keys.segments.back().query_end == end)
      keys.segments.back().slab_end = s + 1;
    else
      keys.segments.push_back({s, s + 1, begin, end});
  }
}

/// The bias index of key n (slab-major, as keys.positions) of query u's window.
TESSERA_NA_INLINE int64_t tile_bias_index(const Problem& p, const TileKeys& keys, int a, int u,
                                          int64_t n) {
  const int64_t slab = keys.first_slab[u] + n / keys.inner;
  const int64_t key = keys.first_key + slab * p.dilation[a];
  const int64_t bias_stride = a == 0 ? p.rpb[1] * p.rpb[2] : a == 1 ? p.rpb[2] : 1;
  return (p.kernel[a] - 1 + (key - keys.global_on_axis[u]) / p.dilation[a]) * bias_stride +
         keys.inner_bias[n % keys.inner];
}

/// out[u][n] = factor * a[u] . (base + positions[n] * row_stride) for the N rows a[u] and the
/// `count` keys: the queries of one segment against its keys. Groups of R keys (R = lanes / N,
/// N rounded up to a power of two) are walked one register of D at a time, each query register
/// meeting each key register in its own chain, and the group's N x R dot products leave the
/// reduction tree together in one register.
template <int W, int Dim, int N, typename T>
TESSERA_NA_INLINE void tile_dots(const T* const* a, const T* base, const int64_t* positions,
                                 int64_t row_stride, int64_t count, T factor, T* const* out,
                                 const T* also = nullptr) {
  constexpr int lanes = kLanes<T, W>;
  constexpr int padded = std::bit_ceil(static_cast<unsigned>(N));
  constexpr int R = lanes / padded;
  static_assert(R >= 1 && Dim % lanes == 0, "tile_dots: N exceeds the lanes or D is not whole");
  using V = Vec<T, W>;
  alignas(64) T result[lanes];
  for (int64_t start = 0; start < count; start += R) {
    const int valid = static_cast<int>(std::min<int64_t>(R, count - start));
    const T* rows[R];
    for (int r = 0; r < R; ++r)
      rows[r] = base + positions[start + (r < valid ? r : 0)] * row_stride;
    // The rows at the same positions of `also` (the forward's v, read by p.v after the softmax)
    // are asked for now, so that their first read from memory overlaps these dot products.
    if (also != nullptr)
      for (int r = 0; r < valid; ++r)
        prefetch_row<0>(also + positions[start + r] * row_stride, Dim);
    V s[lanes];
    for (V& v : s) v = V{};
    for (int e = 0; e < Dim; e += lanes) {
      V av[N];
      for (int u = 0; u < N; ++u) av[u] = load<W>(a[u] + e);
      for (int r = 0; r < R; ++r) {
        const V kv = load<W>(rows[r] + e);
        for (int u = 0; u < N; ++u) s[u * R + r] += av[u] * kv;
      }
    }
    // Whole groups of R are written (a fixed-size copy, no loop over the valid count): what a
    // last group writes past the segment is overwritten by the query's next segment or lands in
    // the room its logits buffer has past the window.
    store<W>(result, lane_sums<lanes>(s) * factor);
    for (int u = 0; u < N; ++u) std::memcpy(out[u] + start, result + u * R, sizeof(T) * R);
  }
}

/// acc[u][e] += sum_n w[u][n] (base + positions[n] * row_stride)[e] for the N accumulators and
/// the `count` rows (p.v of a segment's queries): a block of N queries x C registers of D stays
/// in registers while the rows stream past, so each row register loaded serves N queries.
template <int W, int Dim, int N, typename T>
TESSERA_NA_INLINE void tile_accumulate(T* const* acc, const T* const* w, const T* base,
                                       const int64_t* positions, int64_t row_stride,
                                       int64_t count) {
  constexpr int lanes = kLanes<T, W>;
  constexpr int chunks = Dim / lanes;
  // Accumulator registers: 8 of AVX2's 16, 16 of AVX-512's 32 (the rest hold rows and weights).
  constexpr int budget = W >= 64 ? 16 : 8;
  constexpr int padded = std::bit_ceil(static_cast<unsigned>(N));
  constexpr int C = std::min(chunks, std::max(1, budget / padded));
  static_assert(chunks % C == 0, "tile_accumulate: D must be a power-of-two number of registers");
  using V = Vec<T, W>;
  for (int g = 0; g < chunks; g += C) {
    V sums[N][C];
    for (int u = 0; u < N; ++u)
      for (int c = 0; c < C; ++c) sums[u][c] = load<W>(acc[u] + (g + c) * lanes);
    for (int64_t n = 0; n < count; ++n) {
      const T* row = base + positions[n] * row_stride + g * lanes;
      V rv[C];
      for (int c = 0; c < C; ++c) rv[c] = load<W>(row + c * lanes);
      for (int u = 0; u < N; ++u) {
        const T weight = w[u][n];
        for (int c = 0; c < C; ++c) sums[u][c] += weight * rv[c];
      }
    }
    for (int u = 0; u < N; ++u)
      for (int c = 0; c < C; ++c) store<W>(acc[u] + (g + c) * lanes, sums[u][c]);
  }
}

/// tile_dots with N = n <= Max as a compile-time constant (a switch rather than a generic lambda,
/// whose body would not inherit the caller's target attribute).
template <int W, int Dim, int Max, typename T>
TESSERA_NA_INLINE void tile_dots_for(int n, const T* const* a, const T* base,
                                     const int64_t* positions, int64_t row_stride, int64_t count,
                                     T factor, T* const* out, const T* also = nullptr) {
  if constexpr (Max >= 1) {
    if (n == Max)
      return tile_dots<W, Dim, Max>(a, base, positions, row_stride, count, factor, out, also);
    tile_dots_for<W, Dim, Max - 1>(n, a, base, positions, row_stride, count, factor, out, also);
  }
}

/// tile_accumulate with N = n <= Max as a compile-time constant.
template <int W, int Dim, int Max, typename T>
TESSERA_NA_INLINE void tile_accumulate_for(int n, T* const* acc, const T* const* w, const T* base,
                                           const int64_t* positions, int64_t row_stride,
                                           int64_t count) {
  if constexpr (Max >= 1) {
    if (n == Max) return tile_accumulate<W, Dim, Max>(acc, w, base, positions, row_stride, count);
    tile_accumulate_for<W, Dim, Max - 1>(n, acc, w, base, positions, row_stride, count);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.

template <typename T>
struct ForwardJob {
  const Problem* problem;
  const QueryTiles* tiles;    // the tiled kernel's tiles (unused by forward_rows)
  const T *q, *k, *v, *bias;  // bias: [heads, rpb..] or nullptr
  T *output, *lse;
  bool wide = false;  // tiles of kWideTileQueries queries (else kTileQueries)
  // The key rows the owned pieces hold (NaOwnedKeys; own_k null: none): tile rows [own_lo,
  // own_hi) on axes 0 and 1, each whole on the innermost axis (read by the lane forward only).
  const T *own_k = nullptr, *own_v = nullptr;
  int64_t own_lo[2] = {0, 0}, own_hi[2] = {0, 0};

  /// k and v of the tile's key row (batch b, local z, y) at its first key: in the owned pieces
  /// where they hold it, else in the tile.
  std::pair<const T*, const T*> key_row(int64_t b, int64_t z, int64_t y) const {
    const Problem& p = *problem;
    const int64_t row = p.tile[2] * p.heads * p.dim;
    if (own_k && z >= own_lo[0] && z < own_hi[0] && y >= own_lo[1] && y < own_hi[1]) {
      const int64_t oz = own_hi[0] - own_lo[0], oy = own_hi[1] - own_lo[1];
      const int64_t at = ((b * oz + z - own_lo[0]) * oy + y - own_lo[1]) * row;
      return {own_k + at, own_v + at};
    }
    const int64_t at = ((b * p.tile[0] + z) * p.tile[1] + y) * row;
    return {k + at, v + at};
  }
};

/// Forward of the (batch, query) rows [begin, end). The window is small (k^d logits, in L1), so
/// it is done in passes rather than streamed: all logits, their maximum, the exponentials and
/// their sum as register-wide loops, then the output as one sum over the window's V rows.
template <int W, typename T, int Dim>
TESSERA_NA_INLINE void forward_rows(const ForwardJob<T>& job, int64_t begin, int64_t end) {
  const Problem& p = *job.problem;
  const int64_t dim = Dim > 0 ? Dim : p.dim, heads = p.heads, row = heads * dim;
  const int64_t queries = p.query_count(), plane = p.queries[1] * p.queries[2];
  const int64_t window = p.kernel[0] * p.kernel[1] * p.kernel[2];
  const T scale = static_cast<T>(p.scale);
  std::vector<int64_t> positions(window), bias_indices(window);
  constexpr int block = kLanes<T, W>;
  // Room for whole registers past the window.
  std::vector<T> weights(window + block);
  const T* rows[block];
  std::vector<T> acc(dim);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t batch = item / queries, flat = item % queries;
    const int64_t count = neighbours_of(p, flat / plane, (flat / p.queries[2]) % p.queries[1],
                                        flat % p.queries[2], positions.data(), bias_indices.data());
    const T* k_batch = job.k + batch * p.tile_count() * row;
    const T* v_batch = job.v + batch * p.tile_count() * row;
    for (int64_t h = 0; h < heads; ++h) {
      const T* q_row = job.q + (item * heads + h) * dim;
      const T* bias = job.bias ? job.bias + h * p.rpb_count() : nullptr;
      prefetch_for_write(job.output + (item * heads + h) * dim, dim);
      for (int64_t start = 0; start < count; start += block) {
        const int size = static_cast<int>(std::min<int64_t>(block, count - start));
        for (int t = 0; t < size; ++t) rows[t] = k_batch + positions[start + t] * row + h * dim;
        store<W>(weights.data() + start, dots_block<W, Dim>(q_row, rows, size, dim) * scale);
      }
      if (bias)
        for (int64_t n = 0; n < count; ++n) weights[n] += bias[bias_indices[n]];
      const T row_max = max_of<W>(weights.data(), count);
      const T sum = exp_sum<W>(weights.data(), count, row_max);
      for (int64_t start = 0; start < count; start += block) {
        const int size = static_cast<int>(std::min<int64_t>(block, count - start));
        for (int t = 0; t < size; ++t) rows[t] = v_batch + positions[start + t] * row + h * dim;
        accumulate_rows<W, Dim>(acc.data(), start == 0, T(1), weights.data() + start, rows, size,
                                dim);
      }
      store_scaled(job.output + (item * heads + h) * dim, acc.data(), T(1) / sum, dim);
      job.lse[item * heads + h] = row_max + std::log(sum);
    }
  }
}

/// Forward of the tile items [begin, end) (see tile_items): per head, the logits of every query
/// of the tile segment by segment, each query's softmax in passes as in forward_rows, then p.v
/// segment by segment into the queries' accumulators.
template <int W, typename T, int Dim, int Q>
TESSERA_NA_INLINE void forward_tiles(const ForwardJob<T>& job, int64_t begin, int64_t end) {
  const Problem& p = *job.problem;
  const QueryTiles& tiles = *job.tiles;
  constexpr int lanes = kLanes<T, W>;
  const int64_t heads = p.heads, row = heads * Dim, queries = p.query_count();
  const int64_t window = p.kernel[0] * p.kernel[1] * p.kernel[2];
  const int64_t room = (window + lanes + lanes - 1) / lanes * lanes;
  const int a = tiles.axis;
  const T scale = static_cast<T>(p.scale);
  // Items in groups, heads inside a group: the k/v rows one head of a tile reads (a few tens of
  // KiB) are mostly read again by the next tile, which then finds them in L1.
  constexpr int64_t group = 16;
  std::vector<TileKeys> group_keys(group);
  std::vector<T> logits(Q * room), acc(Q * Dim);
  T* logit_rows[Q];
  T* acc_rows[Q];
  for (int u = 0; u < Q; ++u) {
    logit_rows[u] = logits.data() + u * room;
    acc_rows[u] = acc.data() + u * Dim;
  }
  for (int64_t group_begin = begin; group_begin < end; group_begin += group) {
    const int64_t group_end = std::min(end, group_begin + group);
    for (int64_t item = group_begin; item < group_end; ++item)
      tile_keys(p, tiles, item, group_keys[item - group_begin]);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t item = group_begin; item < group_end; ++item) {
        const TileKeys& keys = group_keys[item - group_begin];
        const T* k_batch = job.k + keys.batch * p.tile_count() * row;
        const T* v_batch = job.v + keys.batch * p.tile_count() * row;
        const T* q_rows[Q];
        T sums[Q];
        for (int u = 0; u < keys.queries; ++u) {
          q_rows[u] = job.q + ((keys.batch * queries + keys.flat[u]) * heads + h) * Dim;
          prefetch_for_write(job.output + ((keys.batch * queries + keys.flat[u]) * heads + h) * Dim,
                             Dim);
        }
        for (const Segment& segment : keys.segments) {
          const T* segment_queries[Q];
          T* out[Q];
          for (int u = segment.query_begin; u < segment.query_end; ++u) {
            segment_queries[u - segment.query_begin] = q_rows[u];
            out[u - segment.query_begin] =
                logit_rows[u] + (segment.slab_begin - keys.first_slab[u]) * keys.inner;
          }
          const int64_t* positions = keys.positions.data() + segment.slab_begin * keys.inner;
          const int64_t count = (segment.slab_end - segment.slab_begin) * keys.inner;
          tile_dots_for<W, Dim, Q>(segment.query_end - segment.query_begin, segment_queries,
                                   k_batch + h * Dim, positions, row, count, scale, out,
                                   v_batch + h * Dim);
        }
        const T* bias = job.bias ? job.bias + h * p.rpb_count() : nullptr;
        T maxima[Q];
        for (int u = 0; u < keys.queries; ++u) {
          const int64_t count = keys.slabs_of[u] * keys.inner;
          if (bias)
            for (int64_t n = 0; n < count; ++n)
              logit_rows[u][n] += bias[tile_bias_index(p, keys, a, u, n)];
          maxima[u] = max_of<W>(logit_rows[u], count);
          sums[u] = exp_sum<W>(logit_rows[u], count, maxima[u]);
          std::fill_n(acc_rows[u], Dim, T(0));
        }
        for (const Segment& segment : keys.segments) {
          const T* weights[Q];
          T* sums_of[Q];
          for (int u = segment.query_begin; u < segment.query_end; ++u) {
            weights[u - segment.query_begin] =
                logit_rows[u] + (segment.slab_begin - keys.first_slab[u]) * keys.inner;
            sums_of[u - segment.query_begin] = acc_rows[u];
          }
          const int64_t* positions = keys.positions.data() + segment.slab_begin * keys.inner;
          const int64_t count = (segment.slab_end - segment.slab_begin) * keys.inner;
          tile_accumulate_for<W, Dim, Q>(segment.query_end - segment.query_begin, sums_of, weights,
                                         v_batch + h * Dim, positions, row, count);
        }
        for (int u = 0; u < keys.queries; ++u) {
          const int64_t query_head = (keys.batch * queries + keys.flat[u]) * heads + h;
          store_scaled(job.output + query_head * Dim, acc_rows[u], T(1) / sums[u], Dim);
          job.lse[query_head] = maxima[u] + std::log(sums[u]);
        }
      }
  }
}

// ---------------------------------------------------------------------------------------------
// Lane tiles (the f32 forward with AVX2 or AVX-512, D of 32, 64 or 128): the queries of a tile
// are the 8 lanes of one register, neighbours along the innermost axis in one dilation group,
// so that q.k is a small matrix product with no reduction tree. The tile's queries share their
// window on the other axes (its key rows); on the innermost axis lane i's window is the keys
// start_i .. start_i + count_i - 1 of the strip (the union of the tile's windows on that axis).
// Away from the axis' ends start_i = i + e for one e: key o of every lane's window is key
// i + e + o of the strip. With the strip's keys of each key row transposed (kt[d][key], the keys
// of one d contiguous), the 8 lanes' keys o are one unaligned load, and
//   s[row][o] (one register, a lane per query) = sum_d qt[d] * kt[row][d][e + o .. e + o + 8)
// with qt the tile's queries transposed (a register per d): k FMAs per key row and d, every lane
// useful. Near the axis' ends (and on causal axes) the offsets e_i = start_i - i differ; o then
// runs over the union of the lanes' [e_i, e_i + count_i), and the logits of a lane outside its
// window are masked. The softmax runs lane-wise (exp as a vector polynomial), and p.v runs per
// query with D in registers and the weights broadcast from s (key row by key row for windows
// whose v outgrows the L1: lane_values_by_rows).
//
// With AVX-512 a pass takes two query rows (pairs): the 8 lanes of the strip in each half of a
// 16-lane register, for two neighbouring rows of one dilation group on axis 1 (same z). Their
// windows share all key rows but one or two, so each transposed key load (8 keys, in both
// halves: vbroadcastf32x8) feeds a 512-bit multiply-add for 16 queries, a key row only one
// window holds is masked on the other half, and p.v takes a lane's two queries together, each v
// register loaded serving both. 16 lanes along the innermost axis instead (one row) would make
// the strip 22 keys for 16 queries of a k = 7 window, and 15 of 16 of its skewed loads would
// straddle two cache lines: measured slower. With pairs the weights off a lane's window are
// exactly 0, so a query's result does not depend on the row it ran with. Logits are masked by
// selecting -inf, not adding it, so a non-finite k off a window does not reach the query.
//
// Work items are (batch, strip, block of rows of the other two axes). A strip's tiles are walked
// row by row in dilation-group order, so consecutive tiles share all but one key row, and
// all heads of a row are done together. The k/v rows of a strip are copied, per key row and for
// every head, into a cache slot when a window first holds them and kept while later windows still
// do: v as [head][key of the strip][D], k transposed as [head][d][key]. Each k/v row is read from
// memory once per strip, sequentially, and the loops read every slot at fixed offsets. The slots,
// logits and masks start on a cache line: from the heap's 16-byte alignment half the 32-byte loads
// straddled two lines, which cost the transposed keys their gain (benchmarks.md). While a row
// computes, the k/v rows and queries the next row will copy are fetched into the L2 a few lines
// before each call (a burst at the row's start gains nothing), and q.k prefetches its transposed
// keys 6 values of d ahead into the L1 (they come from the L2: a window's k and v do not fit the
// L1 together, and prefetching v into it during q.k evicts the keys: slower).

/// Register width and lanes of one query row of the lane forward (8 f32 lanes; with AVX-512 two
/// rows share a 512-bit register).
constexpr int kLaneWidth = 32;
constexpr int kLaneQueries = 8;

/// Logits per key row one call of lane_logits computes at most: its 14 sums, the query register
/// and a loaded key register fill AVX2's 16 registers (AVX-512 keeps the same calls for its
/// 16-lane registers).
constexpr int kLaneKeys = 14;

/// Keys of a strip the lane forward takes at most (8 + k - 1 on the innermost axis: k <= 33).
constexpr int64_t kLaneMaxStrip = 40;

/// Bytes of the k (or v) cache of one thread the lane forward takes at most.
constexpr int64_t kLaneMaxCache = int64_t{4} << 20;

/// The strips of a problem and the blocks of rows its work items cover.
struct LanePlan {
  QueryTiles strips;                    // tiles of 8 queries on the innermost axis
  int64_t rows = 0;                     // rows of the other two axes (queries[0] * queries[1])
  int64_t blocks = 1;                   // row blocks per (batch, strip)
  int64_t max_strip = 0;                // the largest J of any strip (keys of a v slot per head)
  int64_t max_outputs = 0;              // the most logits per key row and lane of any strip
  int64_t columns = 0;                  // keys per d of a k slot (a multiple of 16)
  bool pairs = false;                   // two query rows a pass (lanes of 16, see forward_lanes)
  int64_t slot_rows = 0;                // slots per z: kernel[1], or kernel[1] + 1 with pairs
  int64_t slots = 0;                    // cache slots: kernel[0] * slot_rows
  std::vector<int64_t> order;           // rows (z * queries[1] + y) in dilation-group order
  std::vector<int64_t> slot_z, slot_y;  // cache slot of a key row: slot_z[local z] + slot_y[y]

  int64_t items(const Problem& p) const {
    return p.batch * static_cast<int64_t>(strips.first.size()) * blocks;
  }
};

/// The rank-th index of [0, n) in dilation-group order: r, r + d, r + 2d ... for r = 0, 1 ...
int64_t group_order(int64_t rank, int64_t n, int64_t d) {
  for (int64_t r = 0; r < d; ++r) {
    const int64_t size = (n - r + d - 1) / d;
    if (rank < size) return r + rank * d;
    rank -= size;
  }
  return n - 1;  // not reached for rank < n
}

/// Strip `s` of the plan: each lane's local query index on the innermost axis (lanes past the
/// tile's queries repeat lane 0), the global index of the strip's first key, its J, where each
/// lane's window starts in it and how many keys it holds, and the skew of the logits: logit o of
/// lane i (o < outputs) is its key i + offset + o of the strip.
struct LaneStrip {
  int queries = 0;
  int64_t x[kLaneQueries];
  int64_t first_key = 0, keys = 0;
  int32_t start[kLaneQueries], count[kLaneQueries];
  int32_t offset = 0;   // the least start_i - i of the tile's queries
  int32_t outputs = 0;  // logits per key row: the union of the [start_i - i, + count_i)

  /// Columns of the transposed keys the logits read: the keys offset .. offset + columns - 1 of
  /// the strip, whole registers.
  int64_t columns() const { return (outputs + kLaneQueries - 1 + 7) / 8 * 8; }
};

TESSERA_NA_INLINE void lane_strip(const Problem& p, const QueryTiles& strips, int64_t s,
                                  LaneStrip& strip) {
  strip.queries = strips.count[s];
  const int64_t step = p.dilation[2];
  const NaWindow& w0 = p.windows[2][strips.first[s]];
  strip.first_key = w0.first;
  int64_t last = w0.first;
  int32_t low = std::numeric_limits<int32_t>::max(), high = std::numeric_limits<int32_t>::min();
  for (int i = 0; i < kLaneQueries; ++i) {
    strip.x[i] = strips.first[s] + (i < strip.queries ? i : 0) * step;
    const NaWindow& w = p.windows[2][strip.x[i]];
    strip.start[i] = static_cast<int32_t>((w.first - strip.first_key) / step);
    strip.count[i] = static_cast<int32_t>(w.count);
    last = std::max(last, w.first + (w.count - 1) * step);
    if (i < strip.queries) {
      low = std::min(low, strip.start[i] - i);
      high = std::max(high, strip.start[i] - i + strip.count[i]);
    }
  }
  strip.keys = (last - strip.first_key) / step + 1;
  strip.offset = low;
  strip.outputs = high - low;
}

/// The lane plan of a problem on `threads` threads, two query rows a pass where `pairs` and
/// there are two rows.
LanePlan lane_plan(const Problem& p, int threads, bool pairs) {
  LanePlan plan;
  plan.strips = query_tiles_on(p, 2, kLaneQueries);
  plan.rows = p.queries[0] * p.queries[1];
  plan.pairs = pairs && plan.rows >= 2;
  // Two neighbouring query rows of one dilation group read kernel[1] + 1 consecutive key rows
  // of it at most: one slot more per z keeps their slots distinct.
  plan.slot_rows = p.kernel[1] + (plan.pairs ? 1 : 0);
  plan.slots = p.kernel[0] * plan.slot_rows;
  LaneStrip strip;
  for (size_t s = 0; s < plan.strips.first.size(); ++s) {
    lane_strip(p, plan.strips, static_cast<int64_t>(s), strip);
    plan.max_strip = std::max(plan.max_strip, strip.keys);
    plan.max_outputs = std::max<int64_t>(plan.max_outputs, strip.outputs);
    plan.columns = std::max(plan.columns, (strip.columns() + 15) / 16 * 16);
  }
  for (int64_t rank = 0; rank < plan.rows; ++rank)
    plan.order.push_back(group_order(rank / p.queries[1], p.queries[0], p.dilation[0]) *
                             p.queries[1] +
                         group_order(rank % p.queries[1], p.queries[1], p.dilation[1]));
  // The key rows of one window are consecutive in their dilation group on each axis, so their
  // slots differ (taken from the global index: the same whatever the tile's offset).
  for (int64_t z = 0; z < p.tile[0]; ++z)
    plan.slot_z.push_back((p.tile_offset[0] + z) / p.dilation[0] % p.kernel[0] * plan.slot_rows);
  for (int64_t y = 0; y < p.tile[1]; ++y)
    plan.slot_y.push_back((p.tile_offset[1] + y) / p.dilation[1] % plan.slot_rows);
  // Enough items for every thread (4 each), but blocks of at least twice a window's key rows:
  // a block copies its first window's key rows again.
  const int64_t base = p.batch * static_cast<int64_t>(plan.strips.first.size());
  if (base > 0 && plan.rows > 0)
    plan.blocks = std::clamp<int64_t>((4 * threads + base - 1) / base, 1,
                                      std::max<int64_t>(1, plan.rows / (2 * plan.slots)));
  return plan;
}

/// Whether the lane forward can take a problem: strips of at most kLaneMaxStrip keys and
/// caches of at most kLaneMaxCache bytes (the caller checks dtype, D and instruction set).
bool lane_forward_fits(const Problem& p) {
  if (p.kernel[2] - 1 + kLaneQueries > kLaneMaxStrip) return false;
  // A strip's logits per key row are at most k + 7 (the lanes' windows start at most 7 keys
  // apart relative to their queries), so a k slot has at most 48 keys per d; with pairs a z
  // has kernel[1] + 1 slots.
  const int64_t columns = (p.kernel[2] + 2 * (kLaneQueries - 1) + 15) / 16 * 16;
  return p.kernel[0] * (p.kernel[1] + 1) * p.heads * std::max(kLaneMaxStrip, columns) * p.dim *
             static_cast<int64_t>(sizeof(float)) <=
         kLaneMaxCache;
}

/// Whether the lane forward is the faster one: its tiles fill at least 3/4 of the lanes on
/// average (a short innermost axis leaves lanes empty; the query tiles then run).
bool lane_forward_pays(const Problem& p) {
  const int64_t n = p.queries[2], step = p.dilation[2];
  int64_t lanes = 0;
  for (int64_t r = 0; r < std::min(n, step); ++r)
    lanes += ((n - r + step - 1) / step + kLaneQueries - 1) / kLaneQueries * kLaneQueries;
  return 4 * n >= 3 * lanes;
}

/// The 8 keys of a lane tile's row from `at` (kLaneQueries floats) in a register of W bytes:
/// once (W = kLaneWidth), or in both halves of a 16-lane register, whose two halves are two
/// query rows' tiles reading the same key row.
template <int W>
TESSERA_NA_INLINE Vec<float, W> load_lane_keys(const float* at) {
  if constexpr (W == kLaneWidth) {
    return load<W>(at);
  } else {
    static_assert(W == 2 * kLaneWidth, "lane forward: one or two query rows a register");
#if TESSERA_MULTI_ISA
    // One load (vbroadcastf32x8), not the load and shuffle the compiler makes of the generic
    // form: the shuffle takes the port of AVX-512's second FMA unit. (Only the AVX-512 entry
    // instantiates this; an intrinsic could not be inlined through the untargeted templates.)
    Vec<float, W> both;
    __asm__("vbroadcastf32x8 %1, %0" : "=v"(both) : "m"(*reinterpret_cast<const float(*)[8]>(at)));
    return both;
#else
    const Vec<float, kLaneWidth> keys = load<kLaneWidth>(at);
#if TESSERA_NA_HAVE_SHUFFLEVECTOR
    return __builtin_shufflevector(keys, keys, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
#else
    Vec<float, W> both;
    for (int i = 0; i < 2 * kLaneQueries; ++i) both[i] = keys[i % kLaneQueries];
    return both;
#endif
#endif
  }
}

/// For each of R key rows r: out[r][o] = sum_d qt[d] * kt[r][d * columns + o ...], or -inf where
/// mask[o] + row_mask[r] is, for o < OB (out[r] is out + r * out_rows). These are registers of L
/// lanes: lane i of out[r][o] is the query of lane i against the key in column i % 8 + o of kt[r]
/// (the 8 columns from o, one unaligned load, in each half of a 16-lane register); mask[o] is 0 on
/// the lanes whose window holds that key on the innermost axis, -inf on the others, and row_mask[r]
/// (16 lanes only) is 0 on the half whose query row's window holds key row r, -inf on the other.
/// best = the lane-wise maximum of best and the out[r][o]. Two key rows at once (R = 2, OB <= 7)
/// share the query register's load and give 14 independent sums.
template <int W, int Dim, int R, int OB>
TESSERA_NA_INLINE void lane_logits(const float* __restrict qt, const float* const* kt,
                                   int64_t columns, const float* __restrict mask,
                                   const float* const* row_mask, float* __restrict out,
                                   int64_t out_rows, Vec<float, W>& best) {
  using V = Vec<float, W>;
  constexpr int L = kLanes<float, W>;
  static_assert(R * OB <= kLaneKeys, "lane_logits: more sums than registers");
  V acc[R][OB];
  for (auto& row : acc)
    for (V& a : row) a = V{};
  const float* at[R];
  for (int r = 0; r < R; ++r) at[r] = kt[r];
  for (int d = 0; d < Dim; ++d) {
    const V qv = load<W>(qt + d * L);
    for (int r = 0; r < R; ++r) {
      // The line 6 d ahead: the L1 gets each key row's columns in time (they come from the L2).
      __builtin_prefetch(at[r] + 6 * columns, 0, 3);
      for (int o = 0; o < OB; ++o) acc[r][o] += qv * load_lane_keys<W>(at[r] + o);
      at[r] += columns;
    }
  }
  for (int r = 0; r < R; ++r) {
    V row_add = V{};
    if constexpr (W != kLaneWidth) row_add = load<W>(row_mask[r]);
    for (int o = 0; o < OB; ++o) {
      // Selected, not added: a key off the window whose k is not finite gives -inf, not NaN.
      V masked = load<W>(mask + o * L);
      if constexpr (W != kLaneWidth) masked += row_add;
      const V value = masked == 0.0f ? acc[r][o] : masked;
      store<W>(out + r * out_rows + o * L, value);
      best = value > best ? value : best;
    }
  }
}

/// lane_logits for n <= Max logits per key row (n a compile-time constant in each branch).
template <int W, int Dim, int R, int Max>
TESSERA_NA_INLINE void lane_logits_for(int n, const float* qt, const float* const* kt,
                                       int64_t columns, const float* mask,
                                       const float* const* row_mask, float* out, int64_t out_rows,
                                       Vec<float, W>& best) {
  if constexpr (Max >= 1) {
    if (n == Max)
      return lane_logits<W, Dim, R, Max>(qt, kt, columns, mask, row_mask, out, out_rows, best);
    lane_logits_for<W, Dim, R, Max - 1>(n, qt, kt, columns, mask, row_mask, out, out_rows, best);
  }
}

/// L registers of L lanes transposed in place (row i, lane j to row j, lane i): log2(L) stages,
/// stage B swapping bit B of the row and the lane index.
template <int W, int B = kLanes<float, W> / 2>
TESSERA_NA_INLINE void transpose_lanes(Vec<float, W>* rows) {
  constexpr int L = kLanes<float, W>;
#if !TESSERA_NA_HAVE_SHUFFLEVECTOR
  if constexpr (B == L / 2) {
    for (int i = 0; i < L; ++i)
      for (int j = i + 1; j < L; ++j) std::swap(rows[i][j], rows[j][i]);
  }
#else
  if constexpr (B >= 1) {
    constexpr auto lo = [](int p) { return (p & B) == 0 ? p : L + p - B; };
    constexpr auto hi = [](int p) { return (p & B) == 0 ? p + B : L + p; };
    const auto shuffle = [&]<size_t... P>(std::index_sequence<P...>, auto index, Vec<float, W> a,
                                          Vec<float, W> c) {
      return __builtin_shufflevector(a, c, index(static_cast<int>(P))...);
    };
    for (int i = 0; i < L; ++i)
      if ((i & B) == 0) {
        const Vec<float, W> a = rows[i], c = rows[i + B];
        rows[i] = shuffle(std::make_index_sequence<L>{}, lo, a, c);
        rows[i + B] = shuffle(std::make_index_sequence<L>{}, hi, a, c);
      }
    transpose_lanes<W, B / 2>(rows);
  }
#endif
}

/// The keys of one key row of a strip, every head, transposed into a k slot: column c of
/// kt[head][d] (`columns` floats per d) holds d of key c + offset of the strip, 0 where that key
/// is outside [0, keys); columns [0, used) are written. Key j of the strip is at src + j * step
/// ([head][D] each).
template <int W, int Dim>
TESSERA_NA_INLINE void transpose_keys(const float* src, int64_t step, int64_t keys, int64_t offset,
                                      int64_t used, int64_t heads, int64_t columns, float* kt) {
  using V = Vec<float, W>;
  constexpr int L = kLanes<float, W>;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < used; c += L)
      for (int g = 0; g < Dim; g += L) {
        V block[L];
        for (int t = 0; t < L; ++t) {
          const int64_t j = c + t + offset;
          block[t] = j >= 0 && j < keys ? load<W>(src + j * step + h * Dim + g) : V{};
        }
        transpose_lanes<W>(block);
#pragma GCC unroll 16
        for (int t = 0; t < L; ++t) store<W>(kt + (h * Dim + g + t) * columns + c, block[t]);
      }
}

/// p.v of one query of a lane tile: out = factor * the sum over the key rows and the keys
/// [first, first + count) of the strip of weight * v. The weight of the o-th of those keys in
/// key row kr is weights[kr * weight_rows + o * L]; v_rows[kr] + head_offset is the v slot of
/// key row kr ([key of the strip][D]). 8 registers of D stay in registers while the v rows
/// stream past.
template <int W, int Dim>
TESSERA_NA_INLINE void lane_values(const float* const* v_rows, int64_t key_rows,
                                   int64_t head_offset, int first, int count, const float* weights,
                                   int64_t weight_rows, float* out, float factor) {
  using V = Vec<float, W>;
  constexpr int L = kLanes<float, W>, chunks = Dim / L, C = std::min(chunks, 8);
  static_assert(chunks % C == 0, "lane forward: D must be a power-of-two of registers");
  for (int g = 0; g < chunks; g += C) {
    V acc[C];
    for (V& a : acc) a = V{};
    for (int64_t kr = 0; kr < key_rows; ++kr) {
      const float* vr = v_rows[kr] + head_offset + first * Dim + g * L;
      const float* wr = weights + kr * weight_rows;
      for (int o = 0; o < count; ++o) {
        const float weight = wr[o * L];
        for (int c = 0; c < C; ++c) acc[c] += weight * load<W>(vr + o * Dim + c * L);
      }
    }
    for (int c = 0; c < C; ++c) store<W>(out + g * L + c * L, acc[c] * factor);
  }
}

/// lane_values for lane i of both halves of a 16-lane tile (two query rows, one strip): the two
/// queries' keys on the innermost axis are the same, so each v register loaded from a key row
/// both windows hold serves both sums (8 independent chains at D = 64). member[kr] says which
/// windows hold key row kr (bit 0: the first row's, bit 1: the second's); weights as
/// lane_values' for the first row's query, the second's 8 floats further. out[1] null (a row
/// that ran alone): only the first half is written.
template <int Dim>
TESSERA_NA_INLINE void lane_values_pair(const float* const* v_rows, const uint8_t* member,
                                        int64_t key_rows, int64_t head_offset, int first, int count,
                                        const float* weights, int64_t weight_rows,
                                        float* const* out, const float* factor) {
  constexpr int W = 2 * kLaneWidth;
  using V = Vec<float, W>;
  constexpr int L = kLanes<float, W>, chunks = Dim / L, C = std::min(chunks, 8);
  static_assert(Dim % L == 0 && chunks % C == 0, "lane forward: D must be whole registers");
  for (int g = 0; g < chunks; g += C) {
    V acc[2][C];
    for (auto& half : acc)
      for (V& a : half) a = V{};
    for (int64_t kr = 0; kr < key_rows; ++kr) {
      const float* vr = v_rows[kr] + head_offset + first * Dim + g * L;
      const float* wr = weights + kr * weight_rows;
      if (member[kr] == 3) {
        for (int o = 0; o < count; ++o) {
          const float w0 = wr[o * L], w1 = wr[o * L + kLaneQueries];
          for (int c = 0; c < C; ++c) {
            V value = load<W>(vr + o * Dim + c * L);
            // In a register: the compiler would otherwise load it again as each sum's operand.
            __asm__("" : "+v"(value));
            acc[0][c] += w0 * value;
            acc[1][c] += w1 * value;
          }
        }
      } else if (member[kr] == 1) {  // (the halves by constant index: sums stay in registers)
        for (int o = 0; o < count; ++o) {
          const float w = wr[o * L];
          for (int c = 0; c < C; ++c) acc[0][c] += w * load<W>(vr + o * Dim + c * L);
        }
      } else {
        for (int o = 0; o < count; ++o) {
          const float w = wr[o * L + kLaneQueries];
          for (int c = 0; c < C; ++c) acc[1][c] += w * load<W>(vr + o * Dim + c * L);
        }
      }
    }
    for (int c = 0; c < C; ++c) store<W>(out[0] + (g + c) * L, acc[0][c] * factor[0]);
    if (out[1])
      for (int c = 0; c < C; ++c) store<W>(out[1] + (g + c) * L, acc[1][c] * factor[1]);
  }
}

/// One term of lane_values_strip: lane I of both halves (the queries of lane I in the pass's two
/// rows) takes strip key J + offset, its key O = J - I, where that is in its window.
template <int K, int M, int J, int I>
TESSERA_NA_INLINE void strip_term(Vec<float, 2 * kLaneWidth> (&acc)[2][kLaneQueries],
                                  const float* __restrict w, const Vec<float, 2 * kLaneWidth>& v) {
  constexpr int O = J - I, L = 2 * kLaneQueries;
  if constexpr (O >= 0 && O < K) {
    if constexpr ((M & 1) != 0) acc[0][I] += w[O * L + I] * v;
    if constexpr ((M & 2) != 0) acc[1][I] += w[O * L + kLaneQueries + I] * v;
  }
}

template <int K, int M, int J, int... I>
TESSERA_NA_INLINE void strip_key(Vec<float, 2 * kLaneWidth> (&acc)[2][kLaneQueries],
                                 const float*& v, int64_t stride, const float* __restrict w,
                                 std::integer_sequence<int, I...>) {
  Vec<float, 2 * kLaneWidth> value = load<2 * kLaneWidth>(v);
  // In a register: the compiler would otherwise load it again as each sum's operand.
  __asm__("" : "+v"(value));
  v += stride;
  (strip_term<K, M, J, I>(acc, w, value), ...);
}

template <int K, int M, int... J>
TESSERA_NA_INLINE void strip_keys(Vec<float, 2 * kLaneWidth> (&acc)[2][kLaneQueries],
                                  const float* v, int64_t stride, const float* w,
                                  std::integer_sequence<int, J...>) {
  (strip_key<K, M, J>(acc, v, stride, w, std::make_integer_sequence<int, kLaneQueries>{}), ...);
}

/// p.v of a whole 16-lane tile (two query rows, one strip) for register g of D, where every
/// lane's window on the innermost axis is its K keys from i + offset of the strip (a uniform
/// strip: away from the axis' ends, not causal on it). Key J + offset of a key row is in the
/// windows of lanes J - K + 1 .. J of both halves, so each v register is loaded once and serves
/// up to 2K sums from registers (the 16 lanes' sums of register g stay in 16 registers), the
/// weights broadcast from the logits: the same products as lane_values_pair, each v register read
/// once instead of once per lane, and a key row's v read once per register of D. Sums taken in
/// the same order as lane_values_pair's (key row by key row, keys in order), so the results are
/// the same bits. member, weights (the logits of the key rows, `weight_rows` floats apart),
/// out and factor as lane_values_pair's, for the 8 lanes (out[1][i] null: the first half only).
// Compiled apart from forward_lanes (only its AVX-512 body runs it): inlined there, the 16 sums
// competed with the pass's live registers and half of them went to the stack.
template <int Dim, int K>
[[gnu::noinline]] TESSERA_TARGET_V4 void lane_values_strip(
    const float* const* v_rows, const uint8_t* member, int64_t key_rows, int64_t head_offset,
    int offset, int g, const float* weights, int64_t weight_rows, float* const (*out)[kLaneQueries],
    const Vec<float, 2 * kLaneWidth>& factor) {
  constexpr int W = 2 * kLaneWidth, L = kLanes<float, W>, Q = kLaneQueries;
  using V = Vec<float, W>;
  static_assert(Dim % L == 0, "lane forward: D must be whole registers");
  constexpr auto keys = std::make_integer_sequence<int, K + Q - 1>{};
  // Every index of acc a constant (the loops unrolled), so that its 16 sums live in registers.
  V acc[2][Q];
#pragma GCC unroll 2
  for (int hf = 0; hf < 2; ++hf)
#pragma GCC unroll 8
    for (int i = 0; i < Q; ++i) acc[hf][i] = V{};
  for (int64_t kr = 0; kr < key_rows; ++kr) {
    const float* v = v_rows[kr] + head_offset + offset * Dim + g * L;
    const float* w = weights + kr * weight_rows;
    if (member[kr] == 3)
      strip_keys<K, 3>(acc, v, Dim, w, keys);
    else if (member[kr] == 1)
      strip_keys<K, 1>(acc, v, Dim, w, keys);
    else
      strip_keys<K, 2>(acc, v, Dim, w, keys);
  }
#pragma GCC unroll 2
  for (int hf = 0; hf < 2; ++hf)
#pragma GCC unroll 8
    for (int i = 0; i < Q; ++i)
      if (out[hf][i]) store<W>(out[hf][i] + g * L, acc[hf][i] * factor[hf * Q + i]);
}

/// The most keys a window may have on the innermost axis for lane_values_strip.
constexpr int kStripMaxKeys = 16;

/// lane_values_strip with K = n <= Max a compile-time constant (false for n > Max: the caller
/// runs lane_values_pair).
template <int Dim, int Max = kStripMaxKeys>
TESSERA_NA_INLINE bool lane_values_strip_for(int n, const float* const* v_rows,
                                             const uint8_t* member, int64_t key_rows,
                                             int64_t head_offset, int offset, int g,
                                             const float* weights, int64_t weight_rows,
                                             float* const (*out)[kLaneQueries],
                                             const Vec<float, 2 * kLaneWidth>& factor) {
  if constexpr (Max >= 1) {
    if (n == Max) {
      lane_values_strip<Dim, Max>(v_rows, member, key_rows, head_offset, offset, g, weights,
                                  weight_rows, out, factor);
      return true;
    }
    return lane_values_strip_for<Dim, Max - 1>(n, v_rows, member, key_rows, head_offset, offset, g,
                                               weights, weight_rows, out, factor);
  } else {
    return false;
  }
}

/// p.v of the queries of a lane tile key row by key row, for windows whose v does not fit the L1
/// for one query: per key row, each query's sums (D, kept in sums[i]) take that row's keys of
/// its window, so a key row's v slot (the strip's keys) stays in the L1 across the queries.
/// weights[i] as lane_values' weights for query i; out[i] = lane i of factor * the sums.
template <int W, int Dim>
TESSERA_NA_INLINE void lane_values_by_rows(const float* const* v_rows, int64_t key_rows,
                                           int64_t head_offset, int queries, const int32_t* first,
                                           const int32_t* count, const float* const* weights,
                                           int64_t weight_rows, float* sums, float* const* out,
                                           Vec<float, W> factor) {
  using V = Vec<float, W>;
  constexpr int L = kLanes<float, W>, chunks = Dim / L, C = std::min(chunks, 8);
  for (int64_t kr = 0; kr < key_rows; ++kr)
    for (int i = 0; i < queries; ++i) {
      const float* vr = v_rows[kr] + head_offset + first[i] * Dim;
      const float* wr = weights[i] + kr * weight_rows;
      float* own = sums + i * Dim;
      for (int g = 0; g < chunks; g += C) {
        V acc[C];
        for (int c = 0; c < C; ++c) acc[c] = kr == 0 ? V{} : load<W>(own + (g + c) * L);
        for (int o = 0; o < count[i]; ++o) {
          const float weight = wr[o * L];
          for (int c = 0; c < C; ++c) acc[c] += weight * load<W>(vr + o * Dim + (g + c) * L);
        }
        // One store site (sums, or the output scaled: x 1 is exact), so that the compiler keeps
        // the sums in registers through the loop (with two it kept them on the stack as well).
        const bool last = kr + 1 == key_rows;
        float* const to = last ? out[i] : own;
        const float scale = last ? factor[i] : 1.0f;
        for (int c = 0; c < C; ++c) store<W>(to + (g + c) * L, acc[c] * scale);
      }
    }
}

/// Lines of memory brought into the L2 a few at a time while other work runs (the next row's
/// k/v rows and queries, fetched during this row's compute rather than all at once).
struct LineFetch {
  struct Range {
    const float* at;
    int64_t count;
  };
  std::vector<Range> ranges;
  size_t range = 0;
  int64_t offset = 0, lines = 0;

  void clear() {
    ranges.clear();
    range = 0;
    offset = lines = 0;
  }
  void add(const float* at, int64_t count) {
    ranges.push_back({at, count});
    lines += (count + 15) / 16;
  }
  /// Prefetches the next `n` lines.
  void issue(int64_t n) {
    for (; n > 0 && range < ranges.size(); --n) {
      __builtin_prefetch(ranges[range].at + offset, 0, 2);
      offset += 16;
      if (offset >= ranges[range].count) {
        ++range;
        offset = 0;
      }
    }
  }
};

/// An uninitialised f32 buffer starting on a cache line: 32-byte loads at multiples of 32 bytes
/// from its start never straddle two lines (the heap aligns large blocks to 16 bytes only).
struct AlignedDelete {
  void operator()(float* p) const { ::operator delete[](p, std::align_val_t{64}); }
};
using AlignedFloats = std::unique_ptr<float[], AlignedDelete>;
AlignedFloats aligned_floats(int64_t count) {
  return AlignedFloats(static_cast<float*>(
      ::operator new[](static_cast<size_t>(count) * sizeof(float), std::align_val_t{64})));
}

/// A key row of a query row's window: its local indices on the first two axes, its cache slot
/// and its row of the tile.
struct LaneKeyRow {
  int64_t z, y, slot, local;
};

/// The key rows of query row (z, y)'s window, in order, into `out`; returns their count.
int64_t lane_window(const Problem& p, const LanePlan& plan, int64_t z, int64_t y, LaneKeyRow* out) {
  const NaWindow& wz = p.windows[0][z];
  const NaWindow& wy = p.windows[1][y];
  int64_t count = 0;
  for (int64_t iz = 0; iz < wz.count; ++iz) {
    const int64_t lz = wz.first + iz * wz.step - p.tile_offset[0];
    for (int64_t iy = 0; iy < wy.count; ++iy) {
      const int64_t ly = wy.first + iy * wy.step - p.tile_offset[1];
      out[count++] = {lz, ly, plan.slot_z[lz] + plan.slot_y[ly], lz * p.tile[1] + ly};
    }
  }
  return count;
}

/// Forward of the lane work items [begin, end): (batch, strip, block of rows), see LanePlan, P
/// query rows a pass. With P = 2 (plan.pairs, AVX-512) the registers hold 16 lanes: the strip's
/// 8 queries of two neighbouring rows of one dilation group on axis 1 (same z), whose windows
/// share all key rows but one or two. Each key register loaded then serves both rows' queries
/// (the 8 keys in both halves) and each v register both rows' sums, so q.k and p.v run at twice
/// the width for the same loads. A key row only one of the windows holds is masked on the other
/// half. A rank whose next one is not its row's neighbour runs alone (its second half repeats
/// it and is not written).
template <int Dim, int P>
TESSERA_NA_INLINE void forward_lanes(const ForwardJob<float>& job, const LanePlan& plan,
                                     int64_t begin, int64_t end) {
  constexpr int Q = kLaneQueries, W = kLaneWidth * P, L = Q * P, JB = kLaneKeys;
  using V = Vec<float, W>;
  using VQ = Vec<float, kLaneWidth>;
  static_assert(kLanes<float, W> == L, "lane forward: one lane per query");
  constexpr int chunks = Dim / Q;
  static_assert(Dim % Q == 0, "lane forward: D must be whole registers");
  const Problem& p = *job.problem;
  const int64_t heads = p.heads, row = heads * Dim;
  const float scale = static_cast<float>(p.scale);
  const int64_t strip_count = static_cast<int64_t>(plan.strips.first.size());
  const int64_t jcap = plan.max_strip, ocap = plan.max_outputs, columns = plan.columns;
  const int64_t slots = plan.slots;
  const int64_t k_slot = heads * Dim * columns;  // [head][d][column]
  const int64_t v_slot = heads * jcap * Dim;     // [head][key of the strip][D]
  // Not zeroed: a slot's columns and keys are written before any is read (up to 4 MiB each).
  const auto k_cache = aligned_floats(slots * k_slot);
  const auto v_cache = aligned_floats(slots * v_slot);
  std::vector<int64_t> tags(slots);
  alignas(64) float qt[Dim * L];
  const auto logits_buffer = aligned_floats(slots * ocap * L);
  const auto mask_buffer = aligned_floats(ocap * L);
  const auto row_mask_buffer = aligned_floats(slots * L);
  float* const logits = logits_buffer.get();
  float* const mask = mask_buffer.get();
  float* const row_mask = row_mask_buffer.get();
  std::vector<const float*> k_rows(slots), v_rows(slots);
  std::vector<int64_t> bias_rows(P * slots);
  std::vector<uint8_t> holds(slots);
  const int64_t rows_per_block = (plan.rows + plan.blocks - 1) / plan.blocks;
  const int64_t qy = p.queries[1], qx = p.queries[2];
  LaneStrip strip;
  LineFetch fetch;
  alignas(64) float sums[Q * Dim];  // lane_values_by_rows' per-query sums
  // p.v key row by key row where one query's window of v for one pass of lane_values (key rows x
  // keys x at most 8 registers of D) exceeds a 32 KiB L1: k = 13 at D = 64 and 128 (43 KiB),
  // 1.1x faster there; level at k = 11 (31 KiB), slower at k = 7 (36 against 29 ms).
  const bool by_rows =
      p.kernel[0] * p.kernel[1] * p.kernel[2] * std::min(Dim, 8 * Q) * int64_t{sizeof(float)} >
      (32 << 10);
  std::vector<LaneKeyRow> window(slots), first_rows(slots), second_rows(slots);
  std::vector<uint8_t> next_holds(slots);
  // Query rows of the pass from `rank` (of a block ending at `last`): two where the next rank is
  // the next row of the same dilation group on axis 1 with the same z.
  const auto pass_rows = [&](int64_t rank, int64_t last) -> int {
    if (P == 1 || rank + 1 >= last) return 1;
    const int64_t a = plan.order[rank], c = plan.order[rank + 1];
    return a / qy == c / qy && c % qy == a % qy + p.dilation[1] ? 2 : 1;
  };
  // The key rows of the pass's windows (their union, in order) into `out`, and which windows
  // hold each (bit 0: the first row's, bit 1: the second's); returns their count.
  const auto pass_window = [&](int64_t rank, int rows, LaneKeyRow* out, uint8_t* held) {
    const int64_t a = plan.order[rank];
    if (rows == 1) {
      const int64_t n = lane_window(p, plan, a / qy, a % qy, out);
      std::fill(held, held + n, uint8_t{1});
      return n;
    }
    const int64_t c = plan.order[rank + 1];
    const int64_t n0 = lane_window(p, plan, a / qy, a % qy, first_rows.data());
    const int64_t n1 = lane_window(p, plan, c / qy, c % qy, second_rows.data());
    int64_t i = 0, j = 0, n = 0;
    while (i < n0 || j < n1) {
      if (j == n1 || (i < n0 && first_rows[i].local < second_rows[j].local)) {
        out[n] = first_rows[i++];
        held[n++] = 1;
      } else if (i == n0 || second_rows[j].local < first_rows[i].local) {
        out[n] = second_rows[j++];
        held[n++] = 2;
      } else {
        out[n] = first_rows[i++];
        ++j;
        held[n++] = 3;
      }
    }
    return n;
  };
  std::vector<LaneKeyRow> next_window(slots);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t block = item % plan.blocks;
    const int64_t s = (item / plan.blocks) % strip_count;
    const int64_t b = item / plan.blocks / strip_count;
    lane_strip(p, plan.strips, s, strip);
    const int64_t jn = strip.keys, on = strip.outputs, x0 = strip.first_key - p.tile_offset[2];
    const int64_t used = strip.columns(), key_step = p.dilation[2] * row;
    std::fill(tags.begin(), tags.end(), -1);
    // Every lane a query whose window holds its keys i + offset .. i + offset + outputs - 1 of
    // the strip (away from the axis' ends, not causal on it): p.v by lane_values_strip.
    bool uniform = P == 2 && strip.queries == Q && on <= kStripMaxKeys;
    for (int i = 0; i < Q && uniform; ++i)
      uniform = strip.start[i] - i == strip.offset && strip.count[i] == on;
    // Lane masks: logit o of lane i is its key i + offset + o of the strip, in its window when
    // start[i] <= i + offset + o < start[i] + count[i] (0 there, -inf elsewhere; lanes past the
    // tile's queries are left unmasked); the same in both halves.
    for (int64_t o = 0; o < on; ++o)
      for (int lane = 0; lane < L; ++lane) {
        const int i = lane % Q;
        const int64_t j = i + strip.offset + o;
        mask[o * L + lane] =
            i >= strip.queries || (j >= strip.start[i] && j < strip.start[i] + strip.count[i])
                ? 0.0f
                : -std::numeric_limits<float>::infinity();
      }
    // Logits per call of lane_logits: the key row's in equal parts of at most JB (20 as 10 + 10
    // rather than 14 + 6, whose 6 sums would wait on the loads).
    const int64_t per_call = (on + (on + JB - 1) / JB - 1) / ((on + JB - 1) / JB);
    const int64_t row_begin = block * rows_per_block;
    const int64_t row_end = std::min(plan.rows, row_begin + rows_per_block);
    int rows = 1;
    for (int64_t rank = row_begin; rank < row_end; rank += rows) {
      rows = pass_rows(rank, row_end);
      // The pass's query rows (a lone row fills both halves).
      int64_t query_rows[P], zs[P], ys[P];
      for (int hf = 0; hf < P; ++hf) {
        const int64_t zy = plan.order[rank + std::min(hf, rows - 1)];
        zs[hf] = zy / qy;
        ys[hf] = zy % qy;
        query_rows[hf] = (b * p.queries[0] + zs[hf]) * qy + ys[hf];
      }
      // The windows' key rows, each in its cache slot (copied, all heads, when not there).
      const int64_t key_rows = pass_window(rank, rows, window.data(), holds.data());
      for (int64_t kr = 0; kr < key_rows; ++kr) {
        const auto [lz, ly, slot, local] = window[kr];
        float* kc = k_cache.get() + slot * k_slot;
        float* vc = v_cache.get() + slot * v_slot;
        if (tags[slot] != local) {
          tags[slot] = local;
          const auto [k_row, v_row] = job.key_row(b, lz, ly);
          transpose_keys<kLaneWidth, Dim>(k_row + x0 * row, key_step, jn, strip.offset, used, heads,
                                          columns, kc);
          for (int64_t j = 0; j < jn; ++j) {
            const float* v_at = v_row + x0 * row + j * key_step;
            for (int64_t h = 0; h < heads; ++h)
              for (int c = 0; c < chunks; ++c)
                store<kLaneWidth>(vc + (h * jcap + j) * Dim + c * Q,
                                  load<kLaneWidth>(v_at + h * Dim + c * Q));
          }
        }
        k_rows[kr] = kc;
        v_rows[kr] = vc;
        for (int hf = 0; hf < P; ++hf)
          if (job.bias && (holds[kr] >> hf & 1) != 0)
            bias_rows[hf * slots + kr] =
                (p.kernel[0] - 1 +
                 (lz + p.tile_offset[0] - p.query_offset[0] - zs[hf]) / p.dilation[0]) *
                    p.rpb[1] * p.rpb[2] +
                (p.kernel[1] - 1 +
                 (ly + p.tile_offset[1] - p.query_offset[1] - ys[hf]) / p.dilation[1]) *
                    p.rpb[2];
        if constexpr (P == 2) {
          // A lone row's second half repeats it: unmasked, so that its logits stay finite.
          const uint8_t seen = rows == 1 ? uint8_t{3} : holds[kr];
          for (int lane = 0; lane < L; ++lane)
            row_mask[kr * L + lane] =
                (seen >> (lane / Q) & 1) != 0 ? 0.0f : -std::numeric_limits<float>::infinity();
        }
      }
      // The next pass's key rows not cached yet and its queries, fetched a few lines per call.
      fetch.clear();
      if (rank + rows < row_end) {
        const int next_count = pass_rows(rank + rows, row_end);
        const int64_t next_rows =
            pass_window(rank + rows, next_count, next_window.data(), next_holds.data());
        for (int64_t kr = 0; kr < next_rows; ++kr) {
          if (tags[next_window[kr].slot] == next_window[kr].local) continue;
          const auto [k_row, v_row] = job.key_row(b, next_window[kr].z, next_window[kr].y);
          for (int64_t j = 0; j < jn; ++j) {
            fetch.add(k_row + x0 * row + j * key_step, row);
            fetch.add(v_row + x0 * row + j * key_step, row);
          }
        }
        for (int hf = 0; hf < next_count; ++hf) {
          const int64_t zy = plan.order[rank + rows + hf];
          const int64_t next_row = (b * p.queries[0] + zy / qy) * qy + zy % qy;
          for (int i = 0; i < strip.queries; ++i)
            fetch.add(job.q + (next_row * qx + strip.x[i]) * row, row);
        }
      }
      const int64_t fetch_calls = heads * ((key_rows + 1) / 2 + strip.queries);
      const int64_t per_fetch = (fetch.lines + fetch_calls - 1) / fetch_calls;
      for (int64_t h = 0; h < heads; ++h) {
        // The tile's queries of head h, scaled and transposed (lanes past the tile: lane 0), the
        // pass's rows in the halves.
        for (int hf = 0; hf < P; ++hf)
          for (int g = 0; g < chunks; ++g) {
            VQ block_rows[Q];
            for (int i = 0; i < Q; ++i)
              block_rows[i] = load<kLaneWidth>(job.q + (query_rows[hf] * qx + strip.x[i]) * row +
                                               h * Dim + g * Q) *
                              scale;
            transpose_lanes<kLaneWidth>(block_rows);
#pragma GCC unroll 16
            for (int i = 0; i < Q; ++i)
              store<kLaneWidth>(qt + (g * Q + i) * L + hf * Q, block_rows[i]);
          }
        // The logits of every lane, key row by key row, masked, and their lane-wise maximum.
        const V minus_infinity = V{} - std::numeric_limits<float>::infinity();
        V best = minus_infinity;
        const int64_t head_column = h * Dim * columns;
        for (int64_t kr = 0; kr < key_rows;) {
          // Two key rows a call while their logits fit 14 registers, else one.
          const int two = per_call <= JB / 2 && kr + 1 < key_rows ? 2 : 1;
          fetch.issue(per_fetch);
          const float* row_masks[2] = {row_mask + kr * L, row_mask + (kr + two - 1) * L};
          for (int64_t o = 0; o < on; o += per_call) {
            const int n = static_cast<int>(std::min<int64_t>(per_call, on - o));
            const float* kt[2] = {k_rows[kr] + head_column + o,
                                  k_rows[kr + two - 1] + head_column + o};
            float* out = logits + (kr * ocap + o) * L;
            if (two == 2)
              lane_logits_for<W, Dim, 2, JB / 2>(n, qt, kt, columns, mask + o * L, row_masks, out,
                                                 ocap * L, best);
            else
              lane_logits_for<W, Dim, 1, JB>(n, qt, kt, columns, mask + o * L, row_masks, out,
                                             ocap * L, best);
          }
          kr += two;
        }
        if (job.bias) {
          const float* bias = job.bias + h * p.rpb_count();
          for (int hf = 0; hf < rows; ++hf)
            for (int i = 0; i < strip.queries; ++i) {
              const int64_t gx = p.query_offset[2] + strip.x[i];
              const int64_t skew = strip.start[i] - i - strip.offset;
              for (int64_t kr = 0; kr < key_rows; ++kr) {
                if ((holds[kr] >> hf & 1) == 0) continue;
                for (int o = 0; o < strip.count[i]; ++o) {
                  const int64_t kx = strip.first_key + (strip.start[i] + o) * p.dilation[2];
                  logits[(kr * ocap + skew + o) * L + hf * Q + i] +=
                      bias[bias_rows[hf * slots + kr] + p.kernel[2] - 1 +
                           (kx - gx) / p.dilation[2]];
                }
              }
            }
          best = minus_infinity;
          for (int64_t kr = 0; kr < key_rows; ++kr)
            for (int64_t o = 0; o < on; ++o) {
              const V value = load<W>(logits + (kr * ocap + o) * L);
              best = value > best ? value : best;
            }
        }
        // Lane-wise softmax: the logits' exponentials (off the windows about 1e-38, never used,
        // or with pairs 0) and their sum.
        V sum = V{};
        for (int64_t kr = 0; kr < key_rows; ++kr) {
          float* at = logits + kr * ocap * L;
          for (int64_t o = 0; o < on; ++o) {
            const V logit = load<W>(at + o * L);
            V e = exp_lanes_floored<W>(logit - best);
            // With pairs, exactly 0 off the windows: a query's sum then does not depend on the
            // row it was paired with (or whether it ran alone), to the last bit.
            if constexpr (P == 2) e = logit == minus_infinity ? V{} : e;
            store<W>(at + o * L, e);
            sum += e;
          }
        }
        const V inverse = 1.0f / sum;
        // p.v: per query with D in registers (8 at a time) and the weights broadcast from the
        // logits; key row by key row where one query's window of v outgrows the L1 (by_rows).
        // With pairs, the two rows' queries of a lane together.
        const float* weights[Q];
        float* outs[P][Q];
        for (int hf = 0; hf < rows; ++hf)
          for (int i = 0; i < strip.queries; ++i) {
            const int64_t query_head = (query_rows[hf] * qx + strip.x[i]) * heads + h;
            weights[i] = logits + (strip.start[i] - i - strip.offset) * L + i;
            outs[hf][i] = job.output + query_head * Dim;
            job.lse[query_head] = best[hf * Q + i] + vm::log_f32(sum[hf * Q + i]);
          }
        if constexpr (P == 2) {
          if (uniform) {
            // Each v register of a key row loaded once for the whole tile (lane_values_strip).
            float* strip_outs[2][Q];
            for (int i = 0; i < Q; ++i) {
              strip_outs[0][i] = outs[0][i];
              strip_outs[1][i] = rows == 2 ? outs[1][i] : nullptr;
            }
            for (int g = 0; g < Dim / L; ++g) {
              fetch.issue((per_fetch * Q * L + Dim - 1) / Dim);
              lane_values_strip_for<Dim>(static_cast<int>(on), v_rows.data(), holds.data(),
                                         key_rows, h * jcap * Dim, strip.offset, g, logits,
                                         ocap * L, strip_outs, inverse);
            }
          } else {
            for (int i = 0; i < strip.queries; ++i) {
              fetch.issue(per_fetch);
              float* pair_outs[2] = {outs[0][i], rows == 2 ? outs[1][i] : nullptr};
              const float factors[2] = {inverse[i], inverse[Q + i]};
              lane_values_pair<Dim>(v_rows.data(), holds.data(), key_rows, h * jcap * Dim,
                                    strip.start[i], strip.count[i], weights[i], ocap * L, pair_outs,
                                    factors);
            }
          }
        } else if (by_rows) {
          fetch.issue(per_fetch * strip.queries);
          lane_values_by_rows<W, Dim>(v_rows.data(), key_rows, h * jcap * Dim, strip.queries,
                                      strip.start, strip.count, weights, ocap * L, sums, outs[0],
                                      inverse);
        } else {
          for (int i = 0; i < strip.queries; ++i) {
            fetch.issue(per_fetch);
            lane_values<W, Dim>(v_rows.data(), key_rows, h * jcap * Dim, strip.start[i],
                                strip.count[i], weights[i], ocap * L, outs[0][i], inverse[i]);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward.

template <typename T>
struct BackwardJob {
  const Problem* problem;
  const QueryTiles* tiles;  // the tiled query pass's tiles (unused by backward_query_rows)
  const InverseWindows* inverse;
  const T *q, *k, *v, *bias, *grad_output, *grad_lse;
  T *dq, *dk, *dv;
  T* lse;         // per (batch, query, head): log of the softmax denominator (query pass output)
  T* shift;       // per (batch, query, head): delta - grad_lse, so that ds_j = p_j (dp_j - shift)
  T* bias_slots;  // threads x [heads, rpb..] partial sums of d rpb, or nullptr
  // The tiled key pass: the mirrored problem, its tiles and bias table (mirror_problem).
  const Problem* mirror = nullptr;
  const QueryTiles* key_tiles = nullptr;
  const T* mirrored_bias = nullptr;
};

/// Query pass of the (batch, query) rows [begin, end): dq, lse, shift, d rpb into `slot`.
template <int W, typename T, int Dim>
TESSERA_NA_INLINE void backward_query_rows(const BackwardJob<T>& job, int64_t begin, int64_t end,
                                           int slot) {
  const Problem& p = *job.problem;
  const int64_t dim = Dim > 0 ? Dim : p.dim, heads = p.heads, row = heads * dim;
  const int64_t queries = p.query_count(), plane = p.queries[1] * p.queries[2];
  const int64_t window = p.kernel[0] * p.kernel[1] * p.kernel[2];
  const T scale = static_cast<T>(p.scale);
  std::vector<int64_t> positions(window), bias_indices(window);
  constexpr int block = kLanes<T, W>;
  const T* rows[block];
  // Room for whole blocks: dots_block results are stored a register at a time.
  std::vector<T> probs(window + block), grads(window + block), acc(dim);
  T* bias_grad = job.bias_slots ? job.bias_slots + slot * heads * p.rpb_count() : nullptr;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t batch = item / queries, flat = item % queries;
    const int64_t count = neighbours_of(p, flat / plane, (flat / p.queries[2]) % p.queries[1],
                                        flat % p.queries[2], positions.data(), bias_indices.data());
    const T* k_batch = job.k + batch * p.tile_count() * row;
    const T* v_batch = job.v + batch * p.tile_count() * row;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t query_head = item * heads + h;
      const T* q_row = job.q + query_head * dim;
      const T* go_row = job.grad_output + query_head * dim;
      const T* bias = job.bias ? job.bias + h * p.rpb_count() : nullptr;
      prefetch_for_write(job.dq + query_head * dim, dim);
      // Logits s_j and dp_j = go . v_j, a block of neighbours at a time.
      for (int64_t start = 0; start < count; start += block) {
        const int size = static_cast<int>(std::min<int64_t>(block, count - start));
        for (int t = 0; t < size; ++t) rows[t] = k_batch + positions[start + t] * row + h * dim;
        store<W>(probs.data() + start, dots_block<W, Dim>(q_row, rows, size, dim) * scale);
        for (int t = 0; t < size; ++t) rows[t] = v_batch + positions[start + t] * row + h * dim;
        store<W>(grads.data() + start, dots_block<W, Dim>(go_row, rows, size, dim));
      }
      if (bias)
        for (int64_t n = 0; n < count; ++n) probs[n] += bias[bias_indices[n]];
      const T row_max = max_of<W>(probs.data(), count);
      const T sum = exp_sum<W>(probs.data(), count, row_max);
      const T inverse_sum = T(1) / sum;
      // p_j and delta = sum_j p_j dp_j.
      T delta = 0;
      for (int64_t n = 0; n < count; ++n) {
        probs[n] *= inverse_sum;
        delta += probs[n] * grads[n];
      }
      const T shift = delta - (job.grad_lse ? job.grad_lse[query_head] : T(0));
      // ds_j = p_j (dp_j - shift) (into grads), and dq = scale * sum_j ds_j k_j.
      for (int64_t n = 0; n < count; ++n) {
        grads[n] = probs[n] * (grads[n] - shift);
        if (bias_grad) bias_grad[h * p.rpb_count() + bias_indices[n]] += grads[n];
      }
      for (int64_t start = 0; start < count; start += block) {
        const int size = static_cast<int>(std::min<int64_t>(block, count - start));
        for (int t = 0; t < size; ++t) rows[t] = k_batch + positions[start + t] * row + h * dim;
        accumulate_rows<W, Dim>(acc.data(), start == 0, T(1), grads.data() + start, rows, size,
                                dim);
      }
      store_scaled(job.dq + query_head * dim, acc.data(), scale, dim);
      job.lse[query_head] = row_max + std::log(sum);
      job.shift[query_head] = shift;
    }
  }
}

/// Query pass of the tile items [begin, end) (see tile_items), as backward_query_rows with the
/// tile's queries sharing each k/v row they read: logits and dp_j = go . v_j segment by segment,
/// each query's softmax, delta and ds, then dq segment by segment.
template <int W, typename T, int Dim>
TESSERA_NA_INLINE void backward_query_tiles(const BackwardJob<T>& job, int64_t begin, int64_t end,
                                            int slot) {
  const Problem& p = *job.problem;
  const QueryTiles& tiles = *job.tiles;
  constexpr int Q = kTileQueries<W, T>, lanes = kLanes<T, W>;
  const int64_t heads = p.heads, row = heads * Dim, queries = p.query_count();
  const int64_t window = p.kernel[0] * p.kernel[1] * p.kernel[2];
  const int64_t room = (window + lanes + lanes - 1) / lanes * lanes;
  const int a = tiles.axis;
  const T scale = static_cast<T>(p.scale);
  // Items in groups, heads inside a group: the k/v rows one head of a tile reads (a few tens of
  // KiB) are mostly read again by the next tile, which then finds them in L1.
  constexpr int64_t group = 16;
  std::vector<TileKeys> group_keys(group);
  std::vector<T> probs(Q * room), grads(Q * room), acc(Q * Dim);
  T* prob_rows[Q];
  T* grad_rows[Q];
  T* acc_rows[Q];
  for (int u = 0; u < Q; ++u) {
    prob_rows[u] = probs.data() + u * room;
    grad_rows[u] = grads.data() + u * room;
    acc_rows[u] = acc.data() + u * Dim;
  }
  T* bias_grad = job.bias_slots ? job.bias_slots + slot * heads * p.rpb_count() : nullptr;
  for (int64_t group_begin = begin; group_begin < end; group_begin += group) {
    const int64_t group_end = std::min(end, group_begin + group);
    for (int64_t item = group_begin; item < group_end; ++item)
      tile_keys(p, tiles, item, group_keys[item - group_begin]);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t item = group_begin; item < group_end; ++item) {
        const TileKeys& keys = group_keys[item - group_begin];
        const T* k_batch = job.k + keys.batch * p.tile_count() * row;
        const T* v_batch = job.v + keys.batch * p.tile_count() * row;
        int64_t query_heads[Q];
        for (int u = 0; u < keys.queries; ++u) {
          query_heads[u] = (keys.batch * queries + keys.flat[u]) * heads + h;
          prefetch_for_write(job.dq + query_heads[u] * Dim, Dim);
        }
        for (const Segment& segment : keys.segments) {
          const T* segment_queries[Q];
          const T* segment_grads[Q];
          T* logits_out[Q];
          T* grads_out[Q];
          for (int u = segment.query_begin; u < segment.query_end; ++u) {
            const int t = u - segment.query_begin;
            const int64_t offset = (segment.slab_begin - keys.first_slab[u]) * keys.inner;
            segment_queries[t] = job.q + query_heads[u] * Dim;
            segment_grads[t] = job.grad_output + query_heads[u] * Dim;
            logits_out[t] = prob_rows[u] + offset;
            grads_out[t] = grad_rows[u] + offset;
          }
          const int64_t* positions = keys.positions.data() + segment.slab_begin * keys.inner;
          const int64_t count = (segment.slab_end - segment.slab_begin) * keys.inner;
          const int n = segment.query_end - segment.query_begin;
          tile_dots_for<W, Dim, Q>(n, segment_queries, k_batch + h * Dim, positions, row, count,
                                   scale, logits_out);
          tile_dots_for<W, Dim, Q>(n, segment_grads, v_batch + h * Dim, positions, row, count, T(1),
                                   grads_out);
        }
        const T* bias = job.bias ? job.bias + h * p.rpb_count() : nullptr;
        for (int u = 0; u < keys.queries; ++u) {
          T* prob = prob_rows[u];
          T* grad = grad_rows[u];
          const int64_t count = keys.slabs_of[u] * keys.inner;
          if (bias)
            for (int64_t n = 0; n < count; ++n) prob[n] += bias[tile_bias_index(p, keys, a, u, n)];
          const T row_max = max_of<W>(prob, count);
          const T sum = exp_sum<W>(prob, count, row_max);
          const T inverse_sum = T(1) / sum;
          T delta = 0;
          for (int64_t n = 0; n < count; ++n) {
            prob[n] *= inverse_sum;
            delta += prob[n] * grad[n];
          }
          const T shift = delta - (job.grad_lse ? job.grad_lse[query_heads[u]] : T(0));
          for (int64_t n = 0; n < count; ++n) grad[n] = prob[n] * (grad[n] - shift);
          if (bias_grad)
            for (int64_t n = 0; n < count; ++n)
              bias_grad[h * p.rpb_count() + tile_bias_index(p, keys, a, u, n)] += grad[n];
          job.lse[query_heads[u]] = row_max + std::log(sum);
          job.shift[query_heads[u]] = shift;
          std::fill_n(acc_rows[u], Dim, T(0));
        }
        for (const Segment& segment : keys.segments) {
          const T* weights[Q];
          T* sums_of[Q];
          for (int u = segment.query_begin; u < segment.query_end; ++u) {
            weights[u - segment.query_begin] =
                grad_rows[u] + (segment.slab_begin - keys.first_slab[u]) * keys.inner;
            sums_of[u - segment.query_begin] = acc_rows[u];
          }
          const int64_t* positions = keys.positions.data() + segment.slab_begin * keys.inner;
          const int64_t count = (segment.slab_end - segment.slab_begin) * keys.inner;
          tile_accumulate_for<W, Dim, Q>(segment.query_end - segment.query_begin, sums_of, weights,
                                         k_batch + h * Dim, positions, row, count);
        }
        for (int u = 0; u < keys.queries; ++u)
          store_scaled(job.dq + query_heads[u] * Dim, acc_rows[u], scale, Dim);
      }
  }
}

/// Key pass of the (batch, tile position) rows [begin, end): dk and dv of those keys, from the
/// queries whose window holds them (their p and ds recomputed from lse and shift).
template <int W, typename T, int Dim>
TESSERA_NA_INLINE void backward_key_rows(const BackwardJob<T>& job, int64_t begin, int64_t end) {
  const Problem& p = *job.problem;
  const InverseWindows& inverse = *job.inverse;
  const int64_t dim = Dim > 0 ? Dim : p.dim, heads = p.heads, row = heads * dim;
  const int64_t queries = p.query_count(), tile = p.tile_count();
  const int64_t tile_plane = p.tile[1] * p.tile[2];
  const T scale = static_cast<T>(p.scale);
  std::vector<int64_t> query_rows, bias_indices;
  constexpr int block = kLanes<T, W>;
  alignas(64) T probs[block], grad_probs[block];
  const T* rows[block];
  const T* go_rows[block];
  std::vector<T> dk_acc(dim), dv_acc(dim);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t batch = item / tile, position = item % tile;
    const int64_t key[kAxes] = {position / tile_plane, (position / p.tile[2]) % p.tile[1],
                                position % p.tile[2]};
    const NaWindow& i0 = inverse.axis[0][key[0]];
    const NaWindow& i1 = inverse.axis[1][key[1]];
    const NaWindow& i2 = inverse.axis[2][key[2]];
    if (i0.count == 0 || i1.count == 0 || i2.count == 0) {
      // No local query reads this key.
      std::fill_n(job.dk + item * row, row, T(0));
      std::fill_n(job.dv + item * row, row, T(0));
      continue;
    }
    // The queries reading this key, as rows of q (batch included), with their bias indices.
    query_rows.clear();
    bias_indices.clear();
    int64_t global_key[kAxes];
    for (int a = 0; a < kAxes; ++a) global_key[a] = p.tile_offset[a] + key[a];
    for (int64_t t0 = 0; t0 < i0.count; ++t0) {
      const int64_t x = i0.first + t0 * i0.step;
      const int64_t b0 = p.kernel[0] - 1 + (global_key[0] - p.query_offset[0] - x) / p.dilation[0];
      for (int64_t t1 = 0; t1 < i1.count; ++t1) {
        const int64_t y = i1.first + t1 * i1.step;
        const int64_t b1 =
            p.kernel[1] - 1 + (global_key[1] - p.query_offset[1] - y) / p.dilation[1];
        for (int64_t t2 = 0; t2 < i2.count; ++t2) {
          const int64_t z = i2.first + t2 * i2.step;
          const int64_t b2 =
              p.kernel[2] - 1 + (global_key[2] - p.query_offset[2] - z) / p.dilation[2];
          query_rows.push_back(batch * queries + (x * p.queries[1] + y) * p.queries[2] + z);
          bias_indices.push_back((b0 * p.rpb[1] + b1) * p.rpb[2] + b2);
        }
      }
    }
    const int64_t count = static_cast<int64_t>(query_rows.size());
    for (int64_t h = 0; h < heads; ++h) {
      const T* k_row = job.k + item * row + h * dim;
      const T* v_row = job.v + item * row + h * dim;
      const T* bias = job.bias ? job.bias + h * p.rpb_count() : nullptr;
      prefetch_for_write(job.dk + item * row + h * dim, dim);
      prefetch_for_write(job.dv + item * row + h * dim, dim);
      // Blocks of up to `block` queries: p = exp(s - lse), dp = go . v, ds = p (dp - shift).
      for (int64_t start = 0; start < count; start += block) {
        const int size = static_cast<int>(std::min<int64_t>(block, count - start));
        for (int t = 0; t < size; ++t) {
          const int64_t query_head = query_rows[start + t] * heads + h;
          rows[t] = job.q + query_head * dim;
          go_rows[t] = job.grad_output + query_head * dim;
        }
        store<W>(probs, dots_block<W, Dim>(k_row, rows, size, dim) * scale);
        store<W>(grad_probs, dots_block<W, Dim>(v_row, go_rows, size, dim));
        for (int t = 0; t < size; ++t) {
          if (bias) probs[t] += bias[bias_indices[start + t]];
          probs[t] -= job.lse[query_rows[start + t] * heads + h];
        }
        exp_block<W>(probs, size, T(0));
        for (int t = 0; t < size; ++t)
          grad_probs[t] = probs[t] * (grad_probs[t] - job.shift[query_rows[start + t] * heads + h]);
        accumulate_rows<W, Dim>(dk_acc.data(), start == 0, T(1), grad_probs, rows, size, dim);
        accumulate_rows<W, Dim>(dv_acc.data(), start == 0, T(1), probs, go_rows, size, dim);
      }
      store_scaled(job.dk + item * row + h * dim, dk_acc.data(), scale, dim);
      store_scaled(job.dv + item * row + h * dim, dv_acc.data(), T(1), dim);
    }
  }
}

/// The key pass seen as a query pass: the problem with queries and keys swapped (the keys of the
/// tile as queries, each with its inverse window, an interval of one dilation group per axis
/// that never moves backwards, as a window over the query piece). Its tiles (query_tiles) are
/// keys that are neighbours along one axis, and tile_keys gives the union of the queries they
/// read with the segments of keys sharing them, so each q and grad_output row loaded meets every
/// key of the tile that it reaches from registers. Its bias indices are the original ones
/// mirrored on every axis (key - query instead of query - key): see mirrored_bias.
Problem mirror_problem(const Problem& p, const InverseWindows& inverse) {
  Problem m = p;
  m.queries = p.tile;
  m.query_offset = p.tile_offset;
  m.tile = p.queries;
  m.tile_offset = p.query_offset;
  for (int a = 0; a < kAxes; ++a) {
    m.windows[a].resize(p.tile[a]);
    for (int64_t j = 0; j < p.tile[a]; ++j) {
      const NaWindow& w = inverse.axis[a][j];
      m.windows[a][j] =
          w.count == 0 ? NaWindow{0, 0, 1} : NaWindow{p.query_offset[a] + w.first, w.count, w.step};
    }
  }
  return m;
}

/// The bias table [heads, rpb..] reversed on every spatial axis, for the mirrored problem.
template <typename T>
std::vector<T> mirrored_bias(const Problem& p, const T* bias) {
  const int64_t count = p.rpb_count();
  std::vector<T> mirrored(p.heads * count);
  for (int64_t h = 0; h < p.heads; ++h)
    for (int64_t i0 = 0; i0 < p.rpb[0]; ++i0)
      for (int64_t i1 = 0; i1 < p.rpb[1]; ++i1)
        for (int64_t i2 = 0; i2 < p.rpb[2]; ++i2)
          mirrored[h * count + (i0 * p.rpb[1] + i1) * p.rpb[2] + i2] =
              bias[h * count + ((p.rpb[0] - 1 - i0) * p.rpb[1] + p.rpb[1] - 1 - i1) * p.rpb[2] +
                   p.rpb[2] - 1 - i2];
  return mirrored;
}

/// Key pass of the mirrored problem's tile items [begin, end) (see tile_items): per head, the
/// logits and dp = go . v of every key of the tile against the queries reading it, segment by
/// segment, then p = exp(s - lse) and ds = p (dp - shift) per key, then dk and dv segment by
/// segment into the keys' accumulators. A tile with a key that no query reads (on some axis)
/// runs its keys through backward_key_rows, which writes their zeros.
template <int W, typename T, int Dim>
TESSERA_NA_INLINE void backward_key_tiles(const BackwardJob<T>& job, int64_t begin, int64_t end) {
  const Problem& p = *job.problem;
  const Problem& m = *job.mirror;
  const QueryTiles& tiles = *job.key_tiles;
  constexpr int Q = kTileQueries<W, T>, lanes = kLanes<T, W>;
  const int64_t heads = p.heads, row = heads * Dim, queries = p.query_count();
  const int64_t tile = p.tile_count();
  const int a = tiles.axis;
  const auto [outer, inner] = other_axes(a);
  const int64_t tile_count = static_cast<int64_t>(tiles.first.size());
  int64_t window = 1;
  for (int axis = 0; axis < kAxes; ++axis) {
    int64_t widest = 0;
    for (const NaWindow& w : m.windows[axis]) widest = std::max(widest, w.count);
    window *= widest;
  }
  const int64_t room = (window + lanes + lanes - 1) / lanes * lanes;
  const T scale = static_cast<T>(p.scale);
  TileKeys keys;
  std::vector<T> probs(Q * room), grads(Q * room), acc(2 * Q * Dim);
  T* prob_rows[Q];
  T* grad_rows[Q];
  T* dk_rows[Q];
  T* dv_rows[Q];
  for (int u = 0; u < Q; ++u) {
    prob_rows[u] = probs.data() + u * room;
    grad_rows[u] = grads.data() + u * room;
    dk_rows[u] = acc.data() + u * Dim;
    dv_rows[u] = acc.data() + (Q + u) * Dim;
  }
  for (int64_t item = begin; item < end; ++item) {
    // The tile's keys (as in tile_keys) and whether every one is read by some query.
    const int64_t inner_index = item % m.queries[inner];
    int64_t rest = item / m.queries[inner];
    const int64_t t = rest % tile_count;
    rest /= tile_count;
    const int64_t outer_index = rest % m.queries[outer], batch = rest / m.queries[outer];
    bool empty =
        m.windows[outer][outer_index].count == 0 || m.windows[inner][inner_index].count == 0;
    for (int u = 0; u < tiles.count[t]; ++u)
      empty = empty || m.windows[a][tiles.first[t] + u * p.dilation[a]].count == 0;
    if (empty) {
      int64_t coord[kAxes];
      coord[outer] = outer_index;
      coord[inner] = inner_index;
      for (int u = 0; u < tiles.count[t]; ++u) {
        coord[a] = tiles.first[t] + u * p.dilation[a];
        const int64_t key_item =
            batch * tile + (coord[0] * p.tile[1] + coord[1]) * p.tile[2] + coord[2];
        backward_key_rows<W, T, Dim>(job, key_item, key_item + 1);
      }
      continue;
    }
    tile_keys(m, tiles, item, keys);
    const T* q_batch = job.q + batch * queries * row;
    const T* go_batch = job.grad_output + batch * queries * row;
    const T* lse = job.lse + batch * queries * heads;
    const T* shift = job.shift + batch * queries * heads;
    for (int64_t h = 0; h < heads; ++h) {
      int64_t key_heads[Q];
      for (int u = 0; u < keys.queries; ++u) {
        key_heads[u] = (batch * tile + keys.flat[u]) * heads + h;
        prefetch_for_write(job.dk + key_heads[u] * Dim, Dim);
        prefetch_for_write(job.dv + key_heads[u] * Dim, Dim);
      }
      for (const Segment& segment : keys.segments) {
        const T* segment_keys[Q];
        const T* segment_values[Q];
        T* logits_out[Q];
        T* grads_out[Q];
        for (int u = segment.query_begin; u < segment.query_end; ++u) {
          const int s = u - segment.query_begin;
          const int64_t offset = (segment.slab_begin - keys.first_slab[u]) * keys.inner;
          segment_keys[s] = job.k + key_heads[u] * Dim;
          segment_values[s] = job.v + key_heads[u] * Dim;
          logits_out[s] = prob_rows[u] + offset;
          grads_out[s] = grad_rows[u] + offset;
        }
        const int64_t* positions = keys.positions.data() + segment.slab_begin * keys.inner;
        const int64_t count = (segment.slab_end - segment.slab_begin) * keys.inner;
        const int n = segment.query_end - segment.query_begin;
        tile_dots_for<W, Dim, Q>(n, segment_keys, q_batch + h * Dim, positions, row, count, scale,
                                 logits_out);
        tile_dots_for<W, Dim, Q>(n, segment_values, go_batch + h * Dim, positions, row, count, T(1),
                                 grads_out);
      }
      const T* bias = job.mirrored_bias ? job.mirrored_bias + h * p.rpb_count() : nullptr;
      for (int u = 0; u < keys.queries; ++u) {
        T* prob = prob_rows[u];
        T* grad = grad_rows[u];
        const int64_t count = keys.slabs_of[u] * keys.inner;
        const int64_t* reading = keys.positions.data() + keys.first_slab[u] * keys.inner;
        for (int64_t n = 0; n < count; ++n) {
          const T s = bias ? prob[n] + bias[tile_bias_index(m, keys, a, u, n)] : prob[n];
          prob[n] = s - lse[reading[n] * heads + h];
        }
        const int64_t padded = (count + lanes - 1) / lanes * lanes;
        for (int64_t n = count; n < padded; ++n) prob[n] = -std::numeric_limits<T>::infinity();
        for (int64_t n = 0; n < padded; n += lanes)
          store<W>(prob + n, exp_lanes<W>(load<W>(prob + n)));
        for (int64_t n = 0; n < count; ++n)
          grad[n] = prob[n] * (grad[n] - shift[reading[n] * heads + h]);
        std::fill_n(dk_rows[u], Dim, T(0));
        std::fill_n(dv_rows[u], Dim, T(0));
      }
      for (const Segment& segment : keys.segments) {
        const T* ds_weights[Q];
        const T* p_weights[Q];
        T* dk_of[Q];
        T* dv_of[Q];
        for (int u = segment.query_begin; u < segment.query_end; ++u) {
          const int s = u - segment.query_begin;
          const int64_t offset = (segment.slab_begin - keys.first_slab[u]) * keys.inner;
          ds_weights[s] = grad_rows[u] + offset;
          p_weights[s] = prob_rows[u] + offset;
          dk_of[s] = dk_rows[u];
          dv_of[s] = dv_rows[u];
        }
        const int64_t* positions = keys.positions.data() + segment.slab_begin * keys.inner;
        const int64_t count = (segment.slab_end - segment.slab_begin) * keys.inner;
        const int n = segment.query_end - segment.query_begin;
        tile_accumulate_for<W, Dim, Q>(n, dk_of, ds_weights, q_batch + h * Dim, positions, row,
                                       count);
        tile_accumulate_for<W, Dim, Q>(n, dv_of, p_weights, go_batch + h * Dim, positions, row,
                                       count);
      }
      for (int u = 0; u < keys.queries; ++u) {
        store_scaled(job.dk + key_heads[u] * Dim, dk_rows[u], scale, Dim);
        store_scaled(job.dv + key_heads[u] * Dim, dv_rows[u], T(1), Dim);
      }
    }
  }
}

/// The forward body for registers of W bytes: tiled where kTiled, per query otherwise.
template <int W, typename T, int Dim>
TESSERA_NA_INLINE void forward_body(const ForwardJob<T>& job, int64_t begin, int64_t end) {
  if constexpr (kTiled<W, T, Dim>) {
    if constexpr (kWideTileQueries<W, T> != kTileQueries<W, T>)
      if (job.wide) return forward_tiles<W, T, Dim, kWideTileQueries<W, T>>(job, begin, end);
    forward_tiles<W, T, Dim, kTileQueries<W, T>>(job, begin, end);
  } else
    forward_rows<W, T, Dim>(job, begin, end);
}

/// The query pass for registers of W bytes: tiled where kTiled, per query otherwise.
template <int W, typename T, int Dim>
TESSERA_NA_INLINE void query_pass_body(const BackwardJob<T>& job, int64_t begin, int64_t end,
                                       int slot) {
  if constexpr (kTiled<W, T, Dim>)
    backward_query_tiles<W, T, Dim>(job, begin, end, slot);
  else
    backward_query_rows<W, T, Dim>(job, begin, end, slot);
}

/// The key pass for registers of W bytes: the mirrored problem's tiles where kTiled, per key
/// otherwise (items as the kernel set's key_items).
template <int W, typename T, int Dim>
TESSERA_NA_INLINE void key_pass_body(const BackwardJob<T>& job, int64_t begin, int64_t end) {
  if constexpr (kTiled<W, T, Dim>)
    backward_key_tiles<W, T, Dim>(job, begin, end);
  else
    backward_key_rows<W, T, Dim>(job, begin, end);
}

// ---------------------------------------------------------------------------------------------
// One entry per instruction set (the bodies above are inlined into each), picked at run time.

/// The register width of the build's default target (the entry used without multi-ISA
/// dispatch, or on an x86-64 cpu without AVX2).
#if defined(__AVX512F__)
constexpr int kDefaultWidth = 64;
#elif defined(__AVX2__)
constexpr int kDefaultWidth = 32;
#else
constexpr int kDefaultWidth = 16;
#endif

template <typename T, int Dim>
struct Kernels {
  /// Whether the lane forward exists for T and D (f32, D a compile-time multiple of 8).
  static constexpr bool kHasLanes = std::is_same_v<T, float> && Dim > 0 && Dim % kLaneQueries == 0;
  static void forward(const ForwardJob<T>& job, int64_t begin, int64_t end) {
    forward_body<kDefaultWidth, T, Dim>(job, begin, end);
  }
  static void lanes(const ForwardJob<T>& job, const LanePlan& plan, int64_t begin, int64_t end) {
    if constexpr (kHasLanes) forward_lanes<Dim, 1>(job, plan, begin, end);
  }
  static void query_pass(const BackwardJob<T>& job, int64_t begin, int64_t end, int slot) {
    query_pass_body<kDefaultWidth, T, Dim>(job, begin, end, slot);
  }
  static void key_pass(const BackwardJob<T>& job, int64_t begin, int64_t end) {
    key_pass_body<kDefaultWidth, T, Dim>(job, begin, end);
  }
#if TESSERA_MULTI_ISA
  TESSERA_TARGET_V4 static void forward_v4(const ForwardJob<T>& job, int64_t begin, int64_t end) {
    forward_body<64, T, Dim>(job, begin, end);
  }
  TESSERA_TARGET_V4 static void lanes_v4(const ForwardJob<T>& job, const LanePlan& plan,
                                         int64_t begin, int64_t end) {
    if constexpr (kHasLanes) {
      if (plan.pairs)
        forward_lanes<Dim, 2>(job, plan, begin, end);
      else
        forward_lanes<Dim, 1>(job, plan, begin, end);
    }
  }
  TESSERA_TARGET_V3 static void lanes_v3(const ForwardJob<T>& job, const LanePlan& plan,
                                         int64_t begin, int64_t end) {
    if constexpr (kHasLanes) forward_lanes<Dim, 1>(job, plan, begin, end);
  }
  TESSERA_TARGET_V4 static void query_pass_v4(const BackwardJob<T>& job, int64_t begin, int64_t end,
                                              int slot) {
    query_pass_body<64, T, Dim>(job, begin, end, slot);
  }
  TESSERA_TARGET_V4 static void key_pass_v4(const BackwardJob<T>& job, int64_t begin, int64_t end) {
    key_pass_body<64, T, Dim>(job, begin, end);
  }
  TESSERA_TARGET_V3 static void forward_v3(const ForwardJob<T>& job, int64_t begin, int64_t end) {
    forward_body<32, T, Dim>(job, begin, end);
  }
  TESSERA_TARGET_V3 static void query_pass_v3(const BackwardJob<T>& job, int64_t begin, int64_t end,
                                              int slot) {
    query_pass_body<32, T, Dim>(job, begin, end, slot);
  }
  TESSERA_TARGET_V3 static void key_pass_v3(const BackwardJob<T>& job, int64_t begin, int64_t end) {
    key_pass_body<32, T, Dim>(job, begin, end);
  }
#endif
};

template <typename T>
struct KernelSet {
  void (*forward)(const ForwardJob<T>&, int64_t, int64_t);
  void (*query_pass)(const BackwardJob<T>&, int64_t, int64_t, int);
  void (*key_pass)(const BackwardJob<T>&, int64_t, int64_t);
  int tile_queries;       // queries per tile of the tiled forward and query pass; 0: per query
  int wide_tile_queries;  // queries per tile of the forward for small windows (kWideTileLimit)
  // The lane forward (f32, D of 32, 64, 128, AVX2 or AVX-512), or nullptr.
  void (*lanes)(const ForwardJob<T>&, const LanePlan&, int64_t, int64_t) = nullptr;
  // Whether the lane forward takes two query rows a pass (16 lanes: AVX-512).
  bool lane_pairs = false;
};

template <int W, typename T, int Dim>
constexpr int tile_queries_for() {
  if constexpr (kTiled<W, T, Dim>)
    return kTileQueries<W, T>;
  else
    return 0;
}

template <int W, typename T, int Dim>
constexpr int wide_tile_queries_for() {
  if constexpr (kTiled<W, T, Dim>)
    return kWideTileQueries<W, T>;
  else
    return 0;
}

template <typename T, int Dim>
KernelSet<T> kernels_for_isa() {
  using K = Kernels<T, Dim>;
#if TESSERA_MULTI_ISA
  if (cpu_isa_level() == 4)
    return {&K::forward_v4,
            &K::query_pass_v4,
            &K::key_pass_v4,
            tile_queries_for<64, T, Dim>(),
            wide_tile_queries_for<64, T, Dim>(),
            K::kHasLanes ? &K::lanes_v4 : nullptr,
            true};
  if (cpu_isa_level() == 3)
    return {&K::forward_v3,
            &K::query_pass_v3,
            &K::key_pass_v3,
            tile_queries_for<32, T, Dim>(),
            wide_tile_queries_for<32, T, Dim>(),
            K::kHasLanes ? &K::lanes_v3 : nullptr};
#endif
  return {&K::forward,
          &K::query_pass,
          &K::key_pass,
          tile_queries_for<kDefaultWidth, T, Dim>(),
          wide_tile_queries_for<kDefaultWidth, T, Dim>(),
          K::kHasLanes && kDefaultWidth >= kLaneWidth ? &K::lanes : nullptr};
}

/// The kernels for D (specialised for the common head sizes).
template <typename T>
KernelSet<T> kernels(int64_t dim) {
  switch (dim) {
    case 32: return kernels_for_isa<T, 32>();
    case 64: return kernels_for_isa<T, 64>();
    case 128: return kernels_for_isa<T, 128>();
    default: return kernels_for_isa<T, 0>();
  }
}

int resolve_threads(int threads) {
  return threads > 0 ? threads : compute_threads();
}

/// The compute dtype of inputs of `dtype`.
DType compute_dtype(DType dtype) {
  return dtype == DType::f64 ? DType::f64 : DType::f32;
}

Tensor as_compute(const Tensor& t, DType dtype) {
  return t.to_dtype(dtype).contiguous();
}

/// Whether the forward of `p` runs the lane tiles when `kernel` is asked for.
template <typename T>
bool runs_lanes(const KernelSet<T>& set, const Problem& p, NaCpuForward kernel) {
  return set.lanes != nullptr && kernel != NaCpuForward::query_tiles && lane_forward_fits(p) &&
         (kernel == NaCpuForward::lanes || lane_forward_pays(p));
}

/// The forward kernel of `p` for inputs of `dtype` when `kernel` is asked for.
NaCpuForward forward_kernel_of(const Problem& p, DType dtype, NaCpuForward kernel) {
  const bool lanes =
      compute_dtype(dtype) == DType::f32 && runs_lanes(kernels<float>(p.dim), p, kernel);
  return lanes ? NaCpuForward::lanes : NaCpuForward::query_tiles;
}

/// The tile box the owned pieces of `owned` cover, in the problem's axes, checked against the
/// tile `k`.
struct OwnedBox {
  Axes lo{0, 0, 0}, hi{1, 1, 1};
};

OwnedBox owned_box(const Problem& p, const Tensor& k, const NaOwnedKeys& owned) {
  const Shape& tile = k.shape();
  const Shape& piece = owned.k.shape();
  check_arg(owned.v.shape() == piece && owned.k.dtype() == k.dtype() &&
                owned.v.dtype() == k.dtype() && owned.k.is_contiguous() &&
                owned.v.is_contiguous() && owned.k.device() == k.device() &&
                owned.v.device() == k.device(),
            "na", "owned k {} and v {} ({}, {}): both contiguous, of k's dtype {} and device",
            piece, owned.v.shape(), dtype_name(owned.k.dtype()), dtype_name(owned.v.dtype()),
            dtype_name(k.dtype()));
  check_arg(piece.size() == tile.size() && owned.offset.size() == static_cast<size_t>(p.spatial) &&
                piece.front() == tile.front() && piece[piece.size() - 2] == tile[tile.size() - 2] &&
                piece.back() == tile.back(),
            "na", "owned pieces of shape {} at {} do not fit the k/v tile of shape {}", piece,
            owned.offset, tile);
  OwnedBox box;
  for (int a = 0; a < p.spatial; ++a) {
    const int64_t lo = owned.offset[a], hi = lo + piece[1 + a];
    check_arg(lo >= 0 && hi <= tile[1 + a], "na",
              "owned pieces of shape {} at {} reach past the k/v tile of shape {}", piece,
              owned.offset, tile);
    box.lo[kAxes - p.spatial + a] = lo;
    box.hi[kAxes - p.spatial + a] = hi;
  }
  return box;
}

/// Whether the forward reads owned pieces covering `box` in place: the lane forward (f32 inputs,
/// so the tile is not converted) and pieces whole on the innermost axis.
bool reads_owned(const Problem& p, DType dtype, NaCpuForward kernel, const OwnedBox& box) {
  return dtype == DType::f32 && forward_kernel_of(p, dtype, kernel) == NaCpuForward::lanes &&
         box.lo[2] == 0 && box.hi[2] == p.tile[2];
}

template <typename T>
NaForward forward_in(const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor* rpb, int threads, NaCpuForward kernel,
                     const NaOwnedKeys* owned = nullptr, const OwnedBox& box = {}) {
  const DType dtype = compute_dtype(q.dtype());
  const Tensor qc = as_compute(q, dtype), kc = as_compute(k, dtype), vc = as_compute(v, dtype);
  const Tensor bias = rpb ? as_compute(*rpb, dtype) : Tensor();
  Shape lse_shape = q.shape();
  lse_shape.pop_back();
  Tensor output = Tensor::empty(q.shape(), dtype);
  Tensor lse = Tensor::empty(lse_shape, dtype);
  const KernelSet<T> set = kernels<T>(p.dim);
  ForwardJob<T> job{&p,
                    nullptr,
                    qc.data<T>(),
                    kc.data<T>(),
                    vc.data<T>(),
                    rpb ? bias.data<T>() : nullptr,
                    output.data<T>(),
                    lse.data<T>()};
  if (owned) {  // f32 and the lane forward (reads_owned)
    job.own_k = owned->k.data<T>();
    job.own_v = owned->v.data<T>();
    for (int a = 0; a < 2; ++a) {
      job.own_lo[a] = box.lo[a];
      job.own_hi[a] = box.hi[a];
    }
  }
  if (runs_lanes(set, p, kernel)) {
    const LanePlan plan = lane_plan(p, threads, set.lane_pairs);
    parallel_for(plan.items(p), threads,
                 [&](int64_t begin, int64_t end, int) { set.lanes(job, plan, begin, end); });
  } else {
    job.wide = set.wide_tile_queries > set.tile_queries && p.kernel[tile_axis(p)] <= kWideTileLimit;
    const int tile_queries = job.wide ? set.wide_tile_queries : set.tile_queries;
    const QueryTiles tiles = tile_queries > 0 ? query_tiles(p, tile_queries) : QueryTiles{};
    job.tiles = &tiles;
    const int64_t items = tile_queries > 0 ? tile_items(p, tiles) : p.batch * p.query_count();
    parallel_for(items, threads,
                 [&](int64_t begin, int64_t end, int) { set.forward(job, begin, end); });
  }
  return NaForward{output.to_dtype(q.dtype()), lse.to_dtype(lse_dtype(q.dtype()))};
}

template <typename T>
NaGradients backward_in(const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor* rpb, const Tensor& grad_output, const Tensor* grad_lse,
                        int threads) {
  const DType dtype = compute_dtype(q.dtype());
  const Tensor qc = as_compute(q, dtype), kc = as_compute(k, dtype), vc = as_compute(v, dtype);
  const Tensor goc = as_compute(grad_output, dtype);
  const Tensor bias = rpb ? as_compute(*rpb, dtype) : Tensor();
  const Tensor glse = grad_lse ? as_compute(*grad_lse, dtype) : Tensor();
  // Every row of dq, dk and dv is written by the passes below (dk, dv: zero for keys no query
  // reads; without queries the key pass does not run and they start as zeros).
  const bool no_queries = p.query_count() == 0;
  Tensor dq = Tensor::empty(q.shape(), dtype);
  Tensor dk = no_queries ? Tensor::zeros(k.shape(), dtype) : Tensor::empty(k.shape(), dtype);
  Tensor dv = no_queries ? Tensor::zeros(v.shape(), dtype) : Tensor::empty(v.shape(), dtype);
  const int64_t query_heads = p.batch * p.query_count() * p.heads;
  std::vector<T> lse(query_heads), shift(query_heads);
  const int64_t bias_size = p.heads * p.rpb_count();
  std::vector<T> bias_slots(rpb ? static_cast<size_t>(threads) * bias_size : 0);
  // Without queries the windows were not checked against the tile; dk and dv are zero anyway.
  const InverseWindows inverse = p.query_count() > 0 ? inverse_windows(p) : InverseWindows{};
  const KernelSet<T> set = kernels<T>(p.dim);
  const QueryTiles tiles = set.tile_queries > 0 ? query_tiles(p, set.tile_queries) : QueryTiles{};
  BackwardJob<T> job{&p,
                     &tiles,
                     &inverse,
                     qc.data<T>(),
                     kc.data<T>(),
                     vc.data<T>(),
                     rpb ? bias.data<T>() : nullptr,
                     goc.data<T>(),
                     grad_lse ? glse.data<T>() : nullptr,
                     dq.data<T>(),
                     dk.data<T>(),
                     dv.data<T>(),
                     lse.data(),
                     shift.data(),
                     rpb ? bias_slots.data() : nullptr};
  const int64_t query_items =
      set.tile_queries > 0 ? tile_items(p, tiles) : p.batch * p.query_count();
  parallel_for(query_items, threads, [&](int64_t begin, int64_t end, int slot) {
    set.query_pass(job, begin, end, slot);
  });
  if (p.query_count() > 0) {
    // The tiled key pass (where the query pass is tiled) runs the mirrored problem's tiles.
    const bool key_tiles = set.tile_queries > 0;
    const Problem mirror = key_tiles ? mirror_problem(p, inverse) : Problem{};
    const QueryTiles mirror_tiles =
        key_tiles ? query_tiles(mirror, set.tile_queries) : QueryTiles{};
    const std::vector<T> mirrored =
        key_tiles && rpb ? mirrored_bias(p, bias.data<T>()) : std::vector<T>{};
    job.mirror = &mirror;
    job.key_tiles = &mirror_tiles;
    job.mirrored_bias = rpb && key_tiles ? mirrored.data() : nullptr;
    const int64_t key_items =
        key_tiles ? tile_items(mirror, mirror_tiles) : p.batch * p.tile_count();
    parallel_for(key_items, threads,
                 [&](int64_t begin, int64_t end, int) { set.key_pass(job, begin, end); });
  }
  NaGradients grads{dq.to_dtype(q.dtype()), dk.to_dtype(k.dtype()), dv.to_dtype(v.dtype()),
                    Tensor()};
  if (rpb) {
    Tensor drpb = Tensor::zeros(rpb->shape(), dtype);
    T* out = drpb.data<T>();
    for (int slot = 0; slot < threads; ++slot)
      for (int64_t i = 0; i < bias_size; ++i) out[i] += bias_slots[slot * bias_size + i];
    grads.drpb = drpb.to_dtype(rpb->dtype());
  }
  return grads;
}

}  // namespace

NaForward na_cpu_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                         const NaGeometry& geometry, const NaPieces& pieces, int threads,
                         NaCpuForward kernel, const NaOwnedKeys* owned) {
  const Problem p = make_problem(q, k, v, rpb, geometry, pieces);
  threads = resolve_threads(threads);
  if (owned) {
    const OwnedBox box = owned_box(p, k, *owned);
    check_arg(reads_owned(p, q.dtype(), kernel, box), "na",
              "owned keys are read in place only by the f32 lane forward, from pieces whole on "
              "the innermost spatial axis: fill the k/v tile instead");
    return forward_in<float>(p, q, k, v, rpb, threads, kernel, owned, box);
  }
  return q.dtype() == DType::f64 ? forward_in<double>(p, q, k, v, rpb, threads, kernel)
                                 : forward_in<float>(p, q, k, v, rpb, threads, kernel);
}

bool na_cpu_forward_reads_owned(const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor* rpb, const NaGeometry& geometry,
                                const NaPieces& pieces, const NaOwnedKeys& owned,
                                NaCpuForward kernel) {
  const Problem p = make_problem(q, k, v, rpb, geometry, pieces);
  return reads_owned(p, q.dtype(), kernel, owned_box(p, k, owned));
}

NaCpuForward na_cpu_forward_kernel(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor* rpb, const NaGeometry& geometry,
                                   const NaPieces& pieces, NaCpuForward kernel) {
  return forward_kernel_of(make_problem(q, k, v, rpb, geometry, pieces), q.dtype(), kernel);
}

NaGradients na_cpu_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                            const Tensor& grad_output, const Tensor* grad_lse,
                            const NaGeometry& geometry, const NaPieces& pieces, int threads) {
  const Problem p = make_problem(q, k, v, rpb, geometry, pieces);
  check_backward_grads(q, grad_output, grad_lse);
  // Estimate mode: shape-only gradients, no kernel (the forward is skipped by apply_op).
  if (estimate::active())
    return NaGradients{Tensor::empty(q.shape(), q.dtype()), Tensor::empty(k.shape(), k.dtype()),
                       Tensor::empty(v.shape(), v.dtype()),
                       rpb ? Tensor::empty(rpb->shape(), rpb->dtype()) : Tensor()};
  threads = resolve_threads(threads);
  return q.dtype() == DType::f64
             ? backward_in<double>(p, q, k, v, rpb, grad_output, grad_lse, threads)
             : backward_in<float>(p, q, k, v, rpb, grad_output, grad_lse, threads);
}

}  // namespace tessera::ops
