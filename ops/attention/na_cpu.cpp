// Fast cpu neighborhood attention (see na_cpu.hpp).
//
// Layout: heads-last, so the D values of one (position, head) are contiguous and every inner
// loop runs over D with unit stride. Every call is seen as 3-d (na_problem.hpp). Neighbours are
// taken in blocks of 16 (f64: 8): the dot products of one row (a query, or a key in the backward's
// key pass) with the block's rows are formed as register-wide partial sums and reduced together
// by one transpose-and-add tree, giving the block's logits in one vector. The forward's softmax
// streams over the blocks: the running maximum, the running denominator and the output row (in
// registers for D = 32, 64, 128) are rescaled once per block when the maximum grows, and the
// block's exponentials are one vector loop (f32: a polynomial exp, ~1 ulp; f64: std::exp).
//
// Threads: the forward and the query pass of the backward split the (batch, query) rows; the key
// pass of the backward splits the (batch, key) rows of the tile and gathers, per key, the queries
// whose window holds it (the inverse window, an interval of each dilation group per axis because
// window starts and ends never decrease with the query). Each output row is written by exactly
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
#include <utility>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/parallel_for.hpp"
#include "ops/attention/na_problem.hpp"
#include "ops/cpu_isa.hpp"

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

/// Asks for the cache lines of an output row ahead of writing it, so that fetching them (the
/// row is usually not cached) overlaps the computation of its values instead of stalling the
/// store.
template <typename T>
TESSERA_NA_INLINE void prefetch_for_write(const T* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(T)); offset += 64)
    __builtin_prefetch(bytes + offset, 1, 3);
}

/// exp(x) on every lane of an f32 register (softmax weights, x <= 0): exp(x) = 2^n exp(r) with
/// n = round(x / ln 2), |r| <= ln(2) / 2, and a degree-6 polynomial for exp(r) (about 1 ulp), in
/// lane-wise vector operations. Below -87 it returns 0 (the exact value is under 2e-38, nothing
/// against a softmax denominator >= 1).
template <int W>
TESSERA_NA_INLINE Vec<float, W> exp_lanes(Vec<float, W> x) {
  using V = Vec<float, W>;
  using I = Vec<int32_t, W>;
  const V low = V{} - 87.0f, high = V{} + 88.0f, shifter = V{} + 12582912.0f;
  V clamped = x < low ? low : x;
  clamped = clamped > high ? high : clamped;
  const V shifted = clamped * 1.44269504088896341f + shifter;
  const V n = shifted - shifter;
  V r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V poly = V{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const I exponent = (std::bit_cast<I>(shifted) - std::bit_cast<int32_t>(12582912.0f) + 127) << 23;
  return x < low ? V{} : poly * std::bit_cast<V>(exponent);
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
// Forward.

template <typename T>
struct ForwardJob {
  const Problem* problem;
  const T *q, *k, *v, *bias;  // bias: [heads, rpb..] or nullptr
  T *output, *lse;
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

// ---------------------------------------------------------------------------------------------
// Backward.

template <typename T>
struct BackwardJob {
  const Problem* problem;
  const InverseWindows* inverse;
  const T *q, *k, *v, *bias, *grad_output, *grad_lse;
  T *dq, *dk, *dv;
  T* lse;         // per (batch, query, head): log of the softmax denominator (query pass output)
  T* shift;       // per (batch, query, head): delta - grad_lse, so that ds_j = p_j (dp_j - shift)
  T* bias_slots;  // threads x [heads, rpb..] partial sums of d rpb, or nullptr
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
  static void forward(const ForwardJob<T>& job, int64_t begin, int64_t end) {
    forward_rows<kDefaultWidth, T, Dim>(job, begin, end);
  }
  static void query_pass(const BackwardJob<T>& job, int64_t begin, int64_t end, int slot) {
    backward_query_rows<kDefaultWidth, T, Dim>(job, begin, end, slot);
  }
  static void key_pass(const BackwardJob<T>& job, int64_t begin, int64_t end) {
    backward_key_rows<kDefaultWidth, T, Dim>(job, begin, end);
  }
#if TESSERA_MULTI_ISA
  TESSERA_TARGET_V4 static void forward_v4(const ForwardJob<T>& job, int64_t begin, int64_t end) {
    forward_rows<64, T, Dim>(job, begin, end);
  }
  TESSERA_TARGET_V4 static void query_pass_v4(const BackwardJob<T>& job, int64_t begin, int64_t end,
                                              int slot) {
    backward_query_rows<64, T, Dim>(job, begin, end, slot);
  }
  TESSERA_TARGET_V4 static void key_pass_v4(const BackwardJob<T>& job, int64_t begin, int64_t end) {
    backward_key_rows<64, T, Dim>(job, begin, end);
  }
  TESSERA_TARGET_V3 static void forward_v3(const ForwardJob<T>& job, int64_t begin, int64_t end) {
    forward_rows<32, T, Dim>(job, begin, end);
  }
  TESSERA_TARGET_V3 static void query_pass_v3(const BackwardJob<T>& job, int64_t begin, int64_t end,
                                              int slot) {
    backward_query_rows<32, T, Dim>(job, begin, end, slot);
  }
  TESSERA_TARGET_V3 static void key_pass_v3(const BackwardJob<T>& job, int64_t begin, int64_t end) {
    backward_key_rows<32, T, Dim>(job, begin, end);
  }
#endif
};

template <typename T>
struct KernelSet {
  void (*forward)(const ForwardJob<T>&, int64_t, int64_t);
  void (*query_pass)(const BackwardJob<T>&, int64_t, int64_t, int);
  void (*key_pass)(const BackwardJob<T>&, int64_t, int64_t);
};

template <typename T, int Dim>
KernelSet<T> kernels_for_isa() {
  using K = Kernels<T, Dim>;
#if TESSERA_MULTI_ISA
  if (cpu_isa_level() == 4) return {&K::forward_v4, &K::query_pass_v4, &K::key_pass_v4};
  if (cpu_isa_level() == 3) return {&K::forward_v3, &K::query_pass_v3, &K::key_pass_v3};
#endif
  return {&K::forward, &K::query_pass, &K::key_pass};
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

template <typename T>
NaForward forward_in(const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor* rpb, int threads) {
  const DType dtype = compute_dtype(q.dtype());
  const Tensor qc = as_compute(q, dtype), kc = as_compute(k, dtype), vc = as_compute(v, dtype);
  const Tensor bias = rpb ? as_compute(*rpb, dtype) : Tensor();
  Shape lse_shape = q.shape();
  lse_shape.pop_back();
  Tensor output = Tensor::empty(q.shape(), dtype);
  Tensor lse = Tensor::empty(lse_shape, dtype);
  const ForwardJob<T> job{&p,
                          qc.data<T>(),
                          kc.data<T>(),
                          vc.data<T>(),
                          rpb ? bias.data<T>() : nullptr,
                          output.data<T>(),
                          lse.data<T>()};
  const auto forward = kernels<T>(p.dim).forward;
  parallel_for(p.batch * p.query_count(), threads,
               [&](int64_t begin, int64_t end, int) { forward(job, begin, end); });
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
  const BackwardJob<T> job{&p,
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
  const KernelSet<T> set = kernels<T>(p.dim);
  parallel_for(p.batch * p.query_count(), threads, [&](int64_t begin, int64_t end, int slot) {
    set.query_pass(job, begin, end, slot);
  });
  if (p.query_count() > 0)
    parallel_for(p.batch * p.tile_count(), threads,
                 [&](int64_t begin, int64_t end, int) { set.key_pass(job, begin, end); });
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
                         const NaGeometry& geometry, const NaPieces& pieces, int threads) {
  const Problem p = make_problem(q, k, v, rpb, geometry, pieces);
  threads = resolve_threads(threads);
  return q.dtype() == DType::f64 ? forward_in<double>(p, q, k, v, rpb, threads)
                                 : forward_in<float>(p, q, k, v, rpb, threads);
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
