// Fast cpu neighborhood attention (see na_cpu.hpp).
//
// Layout: heads-last, so the D values of one (position, head) are contiguous and every inner
// loop runs over D with unit stride: dot products into a block of independent partial sums (two
// 512-bit registers' worth, which the compiler keeps in vector registers), and y += a * x updates.
// Every call is seen as 3-d (na_problem.hpp); the innermost window axis gives the blocks of the
// streaming softmax: the logits of one window row are computed, the running maximum and the
// accumulator are rescaled once per row when the maximum grows, and the row's exponentials are
// taken in one vector loop (f32: a polynomial exp, ~1 ulp; f64: std::exp).
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

/// Partial sums of a dot product: 128 bytes of T, two 512-bit registers.
template <typename T>
constexpr int kLanes = 128 / sizeof(T);

template <int Dim, typename T>
TESSERA_NA_INLINE T dot(const T* a, const T* b, int64_t dim) {
  const int64_t n = Dim > 0 ? Dim : dim;
  constexpr int lanes = kLanes<T>;
  T partial[lanes] = {};
  int64_t e = 0;
  for (; e + lanes <= n; e += lanes)
    for (int l = 0; l < lanes; ++l) partial[l] += a[e + l] * b[e + l];
  for (int l = 0; e + l < n; ++l) partial[l] += a[e + l] * b[e + l];
  for (int width = lanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) partial[l] += partial[l + width];
  return partial[0];
}

/// y += a * x over D.
template <int Dim, typename T>
TESSERA_NA_INLINE void add_scaled(T* __restrict y, T a, const T* __restrict x, int64_t dim) {
  const int64_t n = Dim > 0 ? Dim : dim;
  for (int64_t e = 0; e < n; ++e) y[e] += a * x[e];
}

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
  int64_t longest_row = 1;  // most queries of one key along the innermost axis
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
  for (const NaWindow& w : inverse.axis[2])
    inverse.longest_row = std::max(inverse.longest_row, w.count);
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
  std::vector<T> weights(p.kernel[2]), accumulator(dim);
  T* acc = accumulator.data();
  for (int64_t item = begin; item < end; ++item) {
    const int64_t batch = item / queries, flat = item % queries;
    const int64_t count = neighbours_of(p, flat / plane, (flat / p.queries[2]) % p.queries[1],
                                        flat % p.queries[2], positions.data(), bias_indices.data());
    const int64_t row_length = p.windows[2][flat % p.queries[2]].count;
    const T* k_batch = job.k + batch * p.tile_count() * row;
    const T* v_batch = job.v + batch * p.tile_count() * row;
    for (int64_t h = 0; h < heads; ++h) {
      const T* q_row = job.q + (item * heads + h) * dim;
      const T* bias = job.bias ? job.bias + h * p.rpb_count() : nullptr;
      T running_max = -std::numeric_limits<T>::infinity(), sum = 0;
      std::fill_n(acc, dim, T(0));
      for (int64_t start = 0; start < count; start += row_length) {
        T row_max = -std::numeric_limits<T>::infinity();
        for (int64_t t = 0; t < row_length; ++t) {
          const int64_t n = start + t;
          T logit = scale * dot<Dim>(q_row, k_batch + positions[n] * row + h * dim, dim);
          if (bias) logit += bias[bias_indices[n]];
          weights[t] = logit;
          row_max = std::max(row_max, logit);
        }
        if (row_max > running_max) {
          // Rescale what was accumulated under the old maximum (nothing on the first row).
          const T correction = start == 0 ? T(0) : exp_of(running_max - row_max);
          sum *= correction;
          for (int64_t e = 0; e < dim; ++e) acc[e] *= correction;
          running_max = row_max;
        }
        sum += exp_shifted(weights.data(), row_length, running_max);
        for (int64_t t = 0; t < row_length; ++t)
          add_scaled<Dim>(acc, weights[t], v_batch + positions[start + t] * row + h * dim, dim);
      }
      T* o_row = job.output + (item * heads + h) * dim;
      const T inverse_sum = T(1) / sum;
      for (int64_t e = 0; e < dim; ++e) o_row[e] = acc[e] * inverse_sum;
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
  std::vector<T> probs(window), grads(window);
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
      T row_max = -std::numeric_limits<T>::infinity();
      for (int64_t n = 0; n < count; ++n) {
        T logit = scale * dot<Dim>(q_row, k_batch + positions[n] * row + h * dim, dim);
        if (bias) logit += bias[bias_indices[n]];
        probs[n] = logit;
        row_max = std::max(row_max, logit);
      }
      const T sum = exp_shifted(probs.data(), count, row_max);
      const T inverse_sum = T(1) / sum;
      // p_j, dp_j = go . v_j and delta = sum_j p_j dp_j.
      T delta = 0;
      for (int64_t n = 0; n < count; ++n) {
        probs[n] *= inverse_sum;
        grads[n] = dot<Dim>(go_row, v_batch + positions[n] * row + h * dim, dim);
        delta += probs[n] * grads[n];
      }
      const T shift = delta - (job.grad_lse ? job.grad_lse[query_head] : T(0));
      T* dq_row = job.dq + query_head * dim;
      for (int64_t n = 0; n < count; ++n) {
        const T grad_logit = probs[n] * (grads[n] - shift);
        add_scaled<Dim>(dq_row, scale * grad_logit, k_batch + positions[n] * row + h * dim, dim);
        if (bias_grad) bias_grad[h * p.rpb_count() + bias_indices[n]] += grad_logit;
      }
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
  std::vector<T> probs(inverse.longest_row), dk_sum(dim), dv_sum(dim);
  T* dk_acc = dk_sum.data();
  T* dv_acc = dv_sum.data();
  for (int64_t item = begin; item < end; ++item) {
    const int64_t batch = item / tile, position = item % tile;
    const int64_t key[kAxes] = {position / tile_plane, (position / p.tile[2]) % p.tile[1],
                                position % p.tile[2]};
    const NaWindow& i0 = inverse.axis[0][key[0]];
    const NaWindow& i1 = inverse.axis[1][key[1]];
    const NaWindow& i2 = inverse.axis[2][key[2]];
    if (i0.count == 0 || i1.count == 0 || i2.count == 0) continue;  // dk, dv stay zero
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
    const int64_t count = static_cast<int64_t>(query_rows.size()), row_length = i2.count;
    for (int64_t h = 0; h < heads; ++h) {
      const T* k_row = job.k + item * row + h * dim;
      const T* v_row = job.v + item * row + h * dim;
      const T* bias = job.bias ? job.bias + h * p.rpb_count() : nullptr;
      std::fill_n(dk_acc, dim, T(0));
      std::fill_n(dv_acc, dim, T(0));
      for (int64_t start = 0; start < count; start += row_length) {
        for (int64_t t = 0; t < row_length; ++t) {
          const int64_t query_head = query_rows[start + t] * heads + h;
          T logit = scale * dot<Dim>(job.q + query_head * dim, k_row, dim);
          if (bias) logit += bias[bias_indices[start + t]];
          probs[t] = logit - job.lse[query_head];
        }
        exp_shifted(probs.data(), row_length, T(0));
        for (int64_t t = 0; t < row_length; ++t) {
          const int64_t query_head = query_rows[start + t] * heads + h;
          const T* go_row = job.grad_output + query_head * dim;
          const T grad_logit = probs[t] * (dot<Dim>(go_row, v_row, dim) - job.shift[query_head]);
          add_scaled<Dim>(dk_acc, scale * grad_logit, job.q + query_head * dim, dim);
          add_scaled<Dim>(dv_acc, probs[t], go_row, dim);
        }
      }
      std::copy_n(dk_acc, dim, job.dk + item * row + h * dim);
      std::copy_n(dv_acc, dim, job.dv + item * row + h * dim);
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
  Tensor dq = Tensor::zeros(q.shape(), dtype);
  Tensor dk = Tensor::zeros(k.shape(), dtype);
  Tensor dv = Tensor::zeros(v.shape(), dtype);
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
