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
#include <vector>

#include "core/compute_threads.hpp"
#include "core/parallel_for.hpp"
#include "ops/attention/na_problem.hpp"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TESSERA_NA_MULTI_ISA 1
#define TESSERA_NA_INLINE [[gnu::always_inline]] inline
#define TESSERA_NA_TARGET_V4 __attribute__((target("arch=x86-64-v4,prefer-vector-width=512")))
#define TESSERA_NA_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#else
#define TESSERA_NA_MULTI_ISA 0
#define TESSERA_NA_INLINE inline
#define TESSERA_NA_TARGET_V4
#define TESSERA_NA_TARGET_V3
#endif

namespace tessera::ops {

namespace {

using namespace na_detail;

// ---------------------------------------------------------------------------------------------
// Vector loops over D (Dim > 0: D known at compile time; 0: D read at run time).

/// One 512-bit register of T as a GCC/Clang vector type (split into narrower registers when
/// the target has none that wide).
template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(64)));
};
template <typename T>
using Vec = typename VecOf<T>::type;
template <typename T>
constexpr int kWidth = 64 / sizeof(T);

template <typename T>
TESSERA_NA_INLINE Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// Register-wide partial sums of a . b over D (their lanes add up to the dot product).
template <int Dim, typename T>
TESSERA_NA_INLINE Vec<T> dot_partial(const T* a, const T* b, int64_t dim) {
  const int64_t n = Dim > 0 ? Dim : dim;
  constexpr int width = kWidth<T>;
  Vec<T> sum0 = {}, sum1 = {};
  int64_t e = 0;
  for (; e + 2 * width <= n; e += 2 * width) {
    sum0 += load(a + e) * load(b + e);
    sum1 += load(a + e + width) * load(b + e + width);
  }
  if (e + width <= n) {
    sum0 += load(a + e) * load(b + e);
    e += width;
  }
  if constexpr (Dim == 0 || Dim % width != 0) {
    T tail = 0;
    for (; e < n; ++e) tail += a[e] * b[e];
    sum0[0] += tail;
  }
  return sum0 + sum1;
}

/// Rows per dots_block call: one lane of the result each.
template <typename T>
constexpr int kBlock = kWidth<T>;

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define TESSERA_NA_HAVE_SHUFFLEVECTOR 1
#else
#define TESSERA_NA_HAVE_SHUFFLEVECTOR 0
#endif

#if !TESSERA_NA_HAVE_SHUFFLEVECTOR
/// Compilers without __builtin_shufflevector: one lane sum per row.
template <int Dim, typename T>
TESSERA_NA_INLINE Vec<T> dots_block(const T* a, const T* const* rows, int count, int64_t dim) {
  Vec<T> result = {};
  for (int t = 0; t < count; ++t) {
    const Vec<T> partial = dot_partial<Dim>(a, rows[t], dim);
    T sum = 0;
    for (int l = 0; l < kWidth<T>; ++l) sum += partial[l];
    result[t] = sum;
  }
  return result;
}
#else
/// Lane t of the result is a . rows[t] for t < count <= 16 (0 beyond). The partial sums of all
/// rows are reduced together by a transpose-and-add tree: each level adds the two halves of two
/// vectors into one, 15 shuffle pairs for 16 rows instead of 4 per row.
template <int Dim>
TESSERA_NA_INLINE Vec<float> dots_block(const float* a, const float* const* rows, int count,
                                        int64_t dim) {
  Vec<float> s[16];
  for (int t = 0; t < 16; ++t) s[t] = t < count ? dot_partial<Dim>(a, rows[t], dim) : Vec<float>{};
  Vec<float> u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: row 2i, 8-15: row 2i+1
    u[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(s[2 * i], s[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                   27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // four lanes per row
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                   24, 25, 26, 27) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // two lanes per row
    x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21,
                                   24, 25, 28, 29) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                 30) +
         __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                 31);
}

/// The f64 version: 8 rows.
template <int Dim>
TESSERA_NA_INLINE Vec<double> dots_block(const double* a, const double* const* rows, int count,
                                         int64_t dim) {
  Vec<double> s[8];
  for (int t = 0; t < 8; ++t) s[t] = t < count ? dot_partial<Dim>(a, rows[t], dim) : Vec<double>{};
  Vec<double> u[4], w[2];
  for (int i = 0; i < 4; ++i)
    u[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(s[2 * i], s[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/// Asks for the cache lines of an output row ahead of writing it, so that fetching them (the
/// row is usually not cached) overlaps the computation of its values instead of stalling the
/// store.
template <typename T>
TESSERA_NA_INLINE void prefetch_for_write(const T* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(T)); offset += 64)
    __builtin_prefetch(bytes + offset, 1, 3);
}

/// D values being accumulated (an output row of one head): in registers when D is a
/// compile-time multiple of the vector width, so that successive updates do not go through
/// memory; in a buffer otherwise.
template <typename T, int Dim, bool InRegisters = (Dim > 0 && Dim % kWidth<T> == 0)>
struct RowAccumulator {
  static constexpr int kVectors = Dim / kWidth<T>;
  Vec<T> values[kVectors];
  explicit RowAccumulator(int64_t) {}
  TESSERA_NA_INLINE void zero() {
    for (Vec<T>& v : values) v = Vec<T>{};
  }
  TESSERA_NA_INLINE void scale(T factor) {
    for (Vec<T>& v : values) v *= factor;
  }
  /// values += a * row.
  TESSERA_NA_INLINE void add(T a, const T* row) {
    for (int i = 0; i < kVectors; ++i) values[i] += a * load(row + i * kWidth<T>);
  }
  /// out = factor * values.
  TESSERA_NA_INLINE void store(T* out, T factor) const {
    for (int i = 0; i < kVectors; ++i) {
      const Vec<T> scaled = values[i] * factor;
      std::memcpy(out + i * kWidth<T>, &scaled, sizeof scaled);
    }
  }
};

template <typename T, int Dim>
struct RowAccumulator<T, Dim, false> {
  std::vector<T> values;
  explicit RowAccumulator(int64_t dim) : values(Dim > 0 ? Dim : dim) {}
  TESSERA_NA_INLINE void zero() { std::fill(values.begin(), values.end(), T(0)); }
  TESSERA_NA_INLINE void scale(T factor) {
    for (T& v : values) v *= factor;
  }
  TESSERA_NA_INLINE void add(T a, const T* __restrict row) {
    T* __restrict out = values.data();
    const int64_t n = static_cast<int64_t>(values.size());
    for (int64_t e = 0; e < n; ++e) out[e] += a * row[e];
  }
  TESSERA_NA_INLINE void store(T* out, T factor) const {
    for (size_t e = 0; e < values.size(); ++e) out[e] = values[e] * factor;
  }
};

/// exp(x) for x <= 88 in f32: exp(x) = 2^n exp(r) with n = round(x / ln 2), |r| <= ln(2) / 2, and
/// Cephes' degree-6 polynomial for exp(r) (about 1 ulp). Below -87 it returns 0 (the exact value
/// is under 2e-38, nothing against a softmax denominator >= 1). Written without calls or
/// branches so that a loop over it vectorises.
TESSERA_NA_INLINE float exp_f32(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.0f);
  constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = clamped * 1.44269504088896341f + kShifter;
  const float n = shifted - kShifter;
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const int32_t exponent = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kShifter) + 127;
  const float power = std::bit_cast<float>(exponent << 23);
  return x < -87.0f ? 0.0f : poly * power;
}

TESSERA_NA_INLINE float exp_of(float x) {
  return exp_f32(x);
}
TESSERA_NA_INLINE double exp_of(double x) {
  return std::exp(x);
}

/// values[t] = exp(values[t] - shift) for t < count; returns their sum.
template <typename T>
TESSERA_NA_INLINE T exp_shifted(T* values, int64_t count, T shift) {
  for (int64_t t = 0; t < count; ++t) values[t] = exp_of(values[t] - shift);
  T sum = 0;
  for (int64_t t = 0; t < count; ++t) sum += values[t];
  return sum;
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

/// Forward of the (batch, query) rows [begin, end).
template <typename T, int Dim>
TESSERA_NA_INLINE void forward_rows(const ForwardJob<T>& job, int64_t begin, int64_t end) {
  const Problem& p = *job.problem;
  const int64_t dim = Dim > 0 ? Dim : p.dim, heads = p.heads, row = heads * dim;
  const int64_t queries = p.query_count(), plane = p.queries[1] * p.queries[2];
  const int64_t window = p.kernel[0] * p.kernel[1] * p.kernel[2];
  const T scale = static_cast<T>(p.scale);
  std::vector<int64_t> positions(window), bias_indices(window);
  constexpr int block = kBlock<T>;
  alignas(64) T weights[block];
  const T* rows[block];
  RowAccumulator<T, Dim> acc(dim);
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
      T running_max = -std::numeric_limits<T>::infinity(), sum = 0;
      acc.zero();
      // Blocks of up to `block` neighbours: their logits, then the streaming softmax update.
      for (int64_t start = 0; start < count; start += block) {
        const int size = static_cast<int>(std::min<int64_t>(block, count - start));
        for (int t = 0; t < size; ++t) rows[t] = k_batch + positions[start + t] * row + h * dim;
        const Vec<T> logits = dots_block<Dim>(q_row, rows, size, dim) * scale;
        std::memcpy(weights, &logits, sizeof logits);
        T block_max = -std::numeric_limits<T>::infinity();
        for (int t = 0; t < size; ++t) {
          if (bias) weights[t] += bias[bias_indices[start + t]];
          block_max = std::max(block_max, weights[t]);
        }
        if (block_max > running_max) {
          // Rescale what was accumulated under the old maximum (nothing on the first block).
          const T correction = start == 0 ? T(0) : exp_of(running_max - block_max);
          sum *= correction;
          acc.scale(correction);
          running_max = block_max;
        }
        sum += exp_shifted(weights, size, running_max);
        for (int t = 0; t < size; ++t)
          acc.add(weights[t], v_batch + positions[start + t] * row + h * dim);
      }
      acc.store(job.output + (item * heads + h) * dim, T(1) / sum);
      job.lse[item * heads + h] = running_max + std::log(sum);
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
template <typename T, int Dim>
TESSERA_NA_INLINE void backward_query_rows(const BackwardJob<T>& job, int64_t begin, int64_t end,
                                           int slot) {
  const Problem& p = *job.problem;
  const int64_t dim = Dim > 0 ? Dim : p.dim, heads = p.heads, row = heads * dim;
  const int64_t queries = p.query_count(), plane = p.queries[1] * p.queries[2];
  const int64_t window = p.kernel[0] * p.kernel[1] * p.kernel[2];
  const T scale = static_cast<T>(p.scale);
  std::vector<int64_t> positions(window), bias_indices(window);
  constexpr int block = kBlock<T>;
  const T* rows[block];
  // Room for whole blocks: dots_block results are stored a register at a time.
  std::vector<T> probs(window + block), grads(window + block);
  RowAccumulator<T, Dim> dq_sum(dim);
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
        const Vec<T> logits = dots_block<Dim>(q_row, rows, size, dim) * scale;
        std::memcpy(probs.data() + start, &logits, sizeof logits);
        for (int t = 0; t < size; ++t) rows[t] = v_batch + positions[start + t] * row + h * dim;
        const Vec<T> dp = dots_block<Dim>(go_row, rows, size, dim);
        std::memcpy(grads.data() + start, &dp, sizeof dp);
      }
      T row_max = -std::numeric_limits<T>::infinity();
      for (int64_t n = 0; n < count; ++n) {
        if (bias) probs[n] += bias[bias_indices[n]];
        row_max = std::max(row_max, probs[n]);
      }
      const T sum = exp_shifted(probs.data(), count, row_max);
      const T inverse_sum = T(1) / sum;
      // p_j and delta = sum_j p_j dp_j.
      T delta = 0;
      for (int64_t n = 0; n < count; ++n) {
        probs[n] *= inverse_sum;
        delta += probs[n] * grads[n];
      }
      const T shift = delta - (job.grad_lse ? job.grad_lse[query_head] : T(0));
      dq_sum.zero();
      for (int64_t n = 0; n < count; ++n) {
        const T grad_logit = probs[n] * (grads[n] - shift);
        dq_sum.add(grad_logit, k_batch + positions[n] * row + h * dim);
        if (bias_grad) bias_grad[h * p.rpb_count() + bias_indices[n]] += grad_logit;
      }
      dq_sum.store(job.dq + query_head * dim, scale);
      job.lse[query_head] = row_max + std::log(sum);
      job.shift[query_head] = shift;
    }
  }
}

/// Key pass of the (batch, tile position) rows [begin, end): dk and dv of those keys, from the
/// queries whose window holds them (their p and ds recomputed from lse and shift).
template <typename T, int Dim>
TESSERA_NA_INLINE void backward_key_rows(const BackwardJob<T>& job, int64_t begin, int64_t end) {
  const Problem& p = *job.problem;
  const InverseWindows& inverse = *job.inverse;
  const int64_t dim = Dim > 0 ? Dim : p.dim, heads = p.heads, row = heads * dim;
  const int64_t queries = p.query_count(), tile = p.tile_count();
  const int64_t tile_plane = p.tile[1] * p.tile[2];
  const T scale = static_cast<T>(p.scale);
  std::vector<int64_t> query_rows, bias_indices;
  constexpr int block = kBlock<T>;
  alignas(64) T probs[block], grad_probs[block];
  const T* rows[block];
  RowAccumulator<T, Dim> dk_sum(dim), dv_sum(dim);
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
      dk_sum.zero();
      dv_sum.zero();
      // Blocks of up to `block` queries: p = exp(s - lse), dp = go . v, ds = p (dp - shift).
      for (int64_t start = 0; start < count; start += block) {
        const int size = static_cast<int>(std::min<int64_t>(block, count - start));
        for (int t = 0; t < size; ++t) rows[t] = job.q + (query_rows[start + t] * heads + h) * dim;
        const Vec<T> logits = dots_block<Dim>(k_row, rows, size, dim) * scale;
        std::memcpy(probs, &logits, sizeof logits);
        for (int t = 0; t < size; ++t)
          rows[t] = job.grad_output + (query_rows[start + t] * heads + h) * dim;
        const Vec<T> dp = dots_block<Dim>(v_row, rows, size, dim);
        std::memcpy(grad_probs, &dp, sizeof dp);
        for (int t = 0; t < size; ++t) {
          if (bias) probs[t] += bias[bias_indices[start + t]];
          probs[t] -= job.lse[query_rows[start + t] * heads + h];
        }
        exp_shifted(probs, size, T(0));
        for (int t = 0; t < size; ++t) {
          const int64_t query_head = query_rows[start + t] * heads + h;
          const T grad_logit = probs[t] * (grad_probs[t] - job.shift[query_head]);
          dk_sum.add(grad_logit, job.q + query_head * dim);
          dv_sum.add(probs[t], job.grad_output + query_head * dim);
        }
      }
      dk_sum.store(job.dk + item * row + h * dim, scale);
      dv_sum.store(job.dv + item * row + h * dim, T(1));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One entry per instruction set (the bodies above are inlined into each), picked at run time.

template <typename T, int Dim>
struct Kernels {
  static void forward(const ForwardJob<T>& job, int64_t begin, int64_t end) {
    forward_rows<T, Dim>(job, begin, end);
  }
  static void query_pass(const BackwardJob<T>& job, int64_t begin, int64_t end, int slot) {
    backward_query_rows<T, Dim>(job, begin, end, slot);
  }
  static void key_pass(const BackwardJob<T>& job, int64_t begin, int64_t end) {
    backward_key_rows<T, Dim>(job, begin, end);
  }
#if TESSERA_NA_MULTI_ISA
  TESSERA_NA_TARGET_V4 static void forward_v4(const ForwardJob<T>& job, int64_t begin,
                                              int64_t end) {
    forward_rows<T, Dim>(job, begin, end);
  }
  TESSERA_NA_TARGET_V4 static void query_pass_v4(const BackwardJob<T>& job, int64_t begin,
                                                 int64_t end, int slot) {
    backward_query_rows<T, Dim>(job, begin, end, slot);
  }
  TESSERA_NA_TARGET_V4 static void key_pass_v4(const BackwardJob<T>& job, int64_t begin,
                                               int64_t end) {
    backward_key_rows<T, Dim>(job, begin, end);
  }
  TESSERA_NA_TARGET_V3 static void forward_v3(const ForwardJob<T>& job, int64_t begin,
                                              int64_t end) {
    forward_rows<T, Dim>(job, begin, end);
  }
  TESSERA_NA_TARGET_V3 static void query_pass_v3(const BackwardJob<T>& job, int64_t begin,
                                                 int64_t end, int slot) {
    backward_query_rows<T, Dim>(job, begin, end, slot);
  }
  TESSERA_NA_TARGET_V3 static void key_pass_v3(const BackwardJob<T>& job, int64_t begin,
                                               int64_t end) {
    backward_key_rows<T, Dim>(job, begin, end);
  }
#endif
};

template <typename T>
struct KernelSet {
  void (*forward)(const ForwardJob<T>&, int64_t, int64_t);
  void (*query_pass)(const BackwardJob<T>&, int64_t, int64_t, int);
  void (*key_pass)(const BackwardJob<T>&, int64_t, int64_t);
};

/// The instruction set the kernels use on this cpu: 4 (x86-64-v4), 3 (x86-64-v3) or 0.
int isa_level() {
#if TESSERA_NA_MULTI_ISA
  static const int level = [] {
    __builtin_cpu_init();
    const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                    __builtin_cpu_supports("avx512cd");
    return v4 ? 4 : v3 ? 3 : 0;
  }();
  return level;
#else
  return 0;
#endif
}

template <typename T, int Dim>
KernelSet<T> kernels_for_isa() {
  using K = Kernels<T, Dim>;
#if TESSERA_NA_MULTI_ISA
  if (isa_level() == 4) return {&K::forward_v4, &K::query_pass_v4, &K::key_pass_v4};
  if (isa_level() == 3) return {&K::forward_v3, &K::query_pass_v3, &K::key_pass_v3};
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
  threads = resolve_threads(threads);
  return q.dtype() == DType::f64
             ? backward_in<double>(p, q, k, v, rpb, grad_output, grad_lse, threads)
             : backward_in<float>(p, q, k, v, rpb, grad_output, grad_lse, threads);
}

}  // namespace tessera::ops
