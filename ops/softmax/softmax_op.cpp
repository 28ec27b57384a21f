// softmax and log_softmax: rule, cpu kernels, backward and registration.
//
// A local piece is seen as [outer, length, inner] around the softmax dim; every (outer, inner)
// pair is one slot. Forward: each rank takes its slots' maxima, the ranks along the mesh dims
// that shard the dim all-gather them and take the largest; then each rank sums exp(x - max)
// over its part of every slot, the same ranks all-gather those sums and add them in their
// sub-communicator's rank order, so every rank gets the same bits. Backward needs one more such
// sum per slot: of g * y (softmax: dx = y (g - sum)) or of g (log_softmax: dx = g - exp(y) sum).
// Sums are in f64 whatever the dtype; f32 and f64 run typed vectorised passes (exp in float for
// f32), other dtypes one f64 path. Without mesh dims sharding the dim nothing is sent.
#include "ops/softmax/softmax_op.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/autograd.hpp"
#include "core/compute_threads.hpp"
#include "core/estimate/real_data.hpp"
#include "core/parallel_for.hpp"
#include "ops/cpu_lanes.hpp"
#include "ops/cpu_loops.hpp"
#include "ops/op_helpers.hpp"
#include "ops/pointwise/vector_math.hpp"
#include "ops/softmax/softmax_cuda.hpp"

namespace tessera::ops {

namespace {

/// The softmax dim of a tensor of `ndim` dims from the attribute (negative from the end).
int softmax_dim(const std::string& op, const OpAttrs& attrs, size_t ndim) {
  const int64_t dim = attrs.has("dim") ? attrs.get_int("dim") : -1;
  const int64_t rank = static_cast<int64_t>(ndim);
  check_arg(rank > 0, op, "x has no dims (a scalar)");
  check_arg(dim >= -rank && dim < rank, op, "attribute 'dim' = {} is not a dim of a {}-d x", dim,
            rank);
  return static_cast<int>(dim < 0 ? dim + rank : dim);
}

/// Mesh dims that shard tensor dim `dim` in `spec`.
std::vector<int> sharding_mesh_dims(const ShardSpec& spec, int dim) {
  std::vector<int> dims;
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_shard() && spec.placements[m].dim == dim)
      dims.push_back(static_cast<int>(m));
  return dims;
}

/// A local piece as [outer, length, inner] around dim (the cuda bodies take the same).
using Slots = SoftmaxPiece;

/// Number of slots (outer, inner) of a piece.
size_t slot_count(const Slots& s) {
  return static_cast<size_t>(s.outer * s.inner);
}

Slots slots_of(const Shape& shape, int dim) {
  Slots s;
  for (int d = 0; d < dim; ++d) s.outer *= shape[d];
  s.length = shape[dim];
  for (size_t d = dim + 1; d < shape.size(); ++d) s.inner *= shape[d];
  return s;
}

/// Per-slot values (f64) of every rank along `dims` combined: the largest (max) or the sum in
/// the sub-communicator's rank order (every rank gets the same bits).
std::vector<double> combine(const DeviceMesh& mesh, const std::vector<int>& dims,
                            std::vector<double> local, bool max) {
  if (dims.empty()) return local;
  const std::shared_ptr<Comm> comm = mesh.sub_comm(dims);
  const size_t count = local.size();
  std::vector<double> gathered(count * static_cast<size_t>(comm->size()));
  comm->all_gather_v(local.data(), count, gathered.data(),
                     std::vector<size_t>(static_cast<size_t>(comm->size()), count), DType::f64);
  std::vector<double> result(gathered.begin(), gathered.begin() + static_cast<ptrdiff_t>(count));
  for (int r = 1; r < comm->size(); ++r)
    for (size_t i = 0; i < count; ++i) {
      const double v = gathered[static_cast<size_t>(r) * count + i];
      result[i] = max ? (std::isnan(v) || v > result[i] ? v : result[i]) : result[i] + v;
    }
  return result;
}

/// Calls fn(slot, index) for every element of every slot, on the compute threads: units of
/// (outer, a chunk of up to 1024 inner positions) walk the dim in order with the inner positions
/// innermost (contiguous), so each slot is visited along the dim in order by one thread and no
/// two threads touch the same slot.
template <typename Fn>
void for_each_in_slots(const Slots& s, Fn&& fn) {
  constexpr int64_t chunk = 1024;
  const int64_t chunks = (s.inner + chunk - 1) / chunk;
  parallel_for(s.outer * chunks, compute_threads(), [&](int64_t begin, int64_t end, int) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t o = unit / chunks, first = (unit % chunks) * chunk;
      const int64_t last = std::min(s.inner, first + chunk);
      for (int64_t l = 0; l < s.length; ++l) {
        const int64_t base = (o * s.length + l) * s.inner;
        for (int64_t i = first; i < last; ++i) fn(o * s.inner + i, base + i);
      }
    }
  });
}

/// e^x: vector_math's in f32 (vectorises), std::exp in f64.
[[gnu::always_inline]] inline float softmax_exp(float x) {
  return vm::exp_f32(x);
}
[[gnu::always_inline]] inline double softmax_exp(double x) {
  return std::exp(x);
}

/// log of a slot's sum of exponentials, in T: for f32 the vectorising log of vector_math (within
/// 2 ulp; the sum rounded to float first), for f64 std::log of the f64 sum.
[[gnu::always_inline]] inline void log_of_total(double t, float& n) {
  n = vm::log_f32(static_cast<float>(t));
}
[[gnu::always_inline]] inline void log_of_total(double t, double& n) {
  n = std::log(t);
}

/// What one call needs: its dim, the mesh dims that shard it, the local slots.
struct SoftmaxCall {
  int dim = 0;
  std::vector<int> mesh_dims;
  Slots slots;
};

SoftmaxCall call_of(const std::string& op, const OpAttrs& attrs, const ShardSpec& spec,
                    const Shape& local_shape) {
  SoftmaxCall call;
  call.dim = softmax_dim(op, attrs, spec.global_shape.size());
  call.mesh_dims = sharding_mesh_dims(spec, call.dim);
  call.slots = slots_of(local_shape, call.dim);
  return call;
}

/// Estimate mode (core/estimate/real_data.hpp): a shape-only piece posts the `combines`
/// all-gathers of its statistics that the kernel would (with no payload: the simulated
/// communicator records their bytes) and gives a shape-only result of its shape.
Tensor estimated(const SoftmaxCall& call, const DeviceMesh& mesh, const Tensor& x, int combines) {
  if (!call.mesh_dims.empty()) {
    const std::shared_ptr<Comm> comm = mesh.sub_comm(call.mesh_dims);
    const size_t count = static_cast<size_t>(slot_count(call.slots));
    for (int k = 0; k < combines; ++k)
      comm->all_gather_v(nullptr, count, nullptr,
                         std::vector<size_t>(static_cast<size_t>(comm->size()), count), DType::f64);
  }
  return Tensor::empty(x.shape(), x.dtype());
}

constexpr int64_t kSlotColumns = 4096;  // the most columns of a unit (the bodies' buffers)

/// Columns of a unit: a unit's rows (`length` of them, a whole piece of the dim apart) are
/// fetched from memory by its first pass and read again from the L2 by the next ones; rows of
/// 16 KiB ran those first passes faster than rows of 4 KiB (docs/benchmarks.md), so the widest
/// unit whose rows together stay within 512 KiB, at least 256 columns.
int64_t slot_columns(const Slots& s, size_t value_bytes) {
  int64_t columns = kSlotColumns;
  while (columns > 256 && s.length * columns * static_cast<int64_t>(value_bytes) > (512 << 10))
    columns /= 2;
  return columns;
}

/// Calls body(o, first, count) for units of (outer index o, up to `columns` inner positions from
/// `first`) on the compute threads, each compiled for the cpu's instruction set: a body walks the
/// dim in order with the inner positions innermost (contiguous, vectorised), so each slot is
/// visited along the dim in order by one thread and no two threads touch the same slot.
template <typename Body>
void for_slot_columns(const Slots& s, int64_t columns, const Body& body) {
  const int64_t chunks = (s.inner + columns - 1) / columns;
  parallel_ranges(
      s.outer * chunks,
      [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
        for (int64_t unit = lo; unit < hi; ++unit) {
          const int64_t o = unit / chunks, first = (unit % chunks) * columns;
          body(o, first, std::min(columns, s.inner - first));
        }
      },
      1);
}

// Along a contiguous dim (inner == 1: a slot is a row of `length` adjacent values, the last
// dim's softmax of attention scores and classifiers) the passes run along the row in 16 lanes,
// in f64 for the sums: lane j takes the values i with i % 16 == j in order, the lanes are then
// added in a fixed order (fold), so the result depends on the row alone, not on the threads.
constexpr int kRowLanes = 16;

// The lane loops of the row maxima stay loops (`unroll 1`) so that GCC vectorises them:
// unrolled first, their selects were left as scalar branches. Comparisons of vector-extension
// types are no way round it: in a function without a target attribute they are split into
// scalar ones before the function is inlined into the instruction set's body.

/// lane[j] = the larger of lane[j] and lane[j + Half] (NaN where either is), for j < Half.
template <int Half, typename T>
[[gnu::always_inline]] inline void fold_max(T* lane) {
#pragma GCC unroll 1
  for (int j = 0; j < Half; ++j) {
    const T other = lane[j + Half];
    lane[j] = other != other || other > lane[j] ? other : lane[j];
  }
}

/// The largest of a row's n values, NaN if any is NaN (as the column passes).
template <typename T>
[[gnu::always_inline]] inline T row_max(const T* v, int64_t n) {
  T lane[kRowLanes];
  for (int j = 0; j < kRowLanes; ++j) lane[j] = -std::numeric_limits<T>::infinity();
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
#pragma GCC unroll 1
    for (int j = 0; j < kRowLanes; ++j)
      lane[j] = v[i + j] != v[i + j] || v[i + j] > lane[j] ? v[i + j] : lane[j];
  }
  fold_max<kRowLanes / 2>(lane);
  fold_max<kRowLanes / 4>(lane);
  fold_max<kRowLanes / 8>(lane);
  fold_max<kRowLanes / 16>(lane);
  T peak = lane[0];
  for (; i < n; ++i) peak = v[i] != v[i] || v[i] > peak ? v[i] : peak;
  return peak;
}

/// The f64 sum of a row's n values in the lanes' order.
template <typename T>
[[gnu::always_inline]] inline void add_lanes(const T* e, int64_t n, Lanes8& low, Lanes8& high,
                                             double& tail) {
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    Lanes8 a, b;
    widen8(e + i, a);
    widen8(e + i + 8, b);
    low += a;
    high += b;
  }
  for (; i < n; ++i) tail += double(e[i]);
}

/// sum of exp(v - peak) over a row (f64, the lanes' order); the exponentials written to `store`
/// when given (softmax's output row), else through a buffer of 1024.
template <typename T>
[[gnu::always_inline]] inline double row_exp_sum(const T* v, int64_t n, T peak, T* store) {
  constexpr int64_t kPiece = 1024;  // a multiple of kRowLanes: lane j keeps i % 16 == j
  T buffer[kPiece];
  Lanes8 low = {}, high = {};
  double tail = 0;
  for (int64_t c = 0; c < n; c += kPiece) {
    const int64_t m = std::min(kPiece, n - c);
    T* e = store ? store + c : buffer;
    for (int64_t i = 0; i < m; ++i) e[i] = softmax_exp(T(v[c + i] - peak));
    add_lanes(e, m, low, high, tail);
  }
  return fold(low, high) + tail;
}

/// The output row from x's row, its peak and norm (the sum, or its log for log_softmax); for
/// softmax `w` already holds the exponentials (row_exp_sum's store).
template <typename T>
[[gnu::always_inline]] inline void row_output(const T* v, int64_t n, T peak, T norm, bool log,
                                              T* w) {
  if (log) {
    for (int64_t i = 0; i < n; ++i) w[i] = T(v[i] - peak) - norm;
  } else {
    // One division a row, a product an element (as torch's cpu softmax): 4% off the forward on
    // rows of 48, for about one more rounding (within the bounds the tests hold it to).
    const T inverse = T(1) / norm;
    for (int64_t i = 0; i < n; ++i) w[i] = w[i] * inverse;
  }
}

/// fn(r) for every row r < rows on the compute threads, `grain` rows a unit; fn must be a
/// TESSERA_LOOP_BODY lambda (inlined into the instruction set's body).
template <typename Fn>
void for_each_row(int64_t rows, int64_t grain, const Fn& fn) {
  parallel_ranges(
      rows,
      [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
        for (int64_t r = lo; r < hi; ++r) fn(r);
      },
      grain);
}

/// Rows per unit of work: about 64 KiB of values.
int64_t rows_per_unit(const Slots& s, size_t value_bytes) {
  return std::max<int64_t>(1, (int64_t{64} << 10) / std::max<int64_t>(1, s.length * value_bytes));
}

/// forward_typed along a contiguous dim (inner == 1).
template <typename T>
Tensor forward_rows(const SoftmaxCall& call, const DeviceMesh& mesh, const T* in, Tensor y,
                    bool log) {
  const Slots& s = call.slots;
  const int64_t n = s.length, grain = rows_per_unit(s, sizeof(T));
  T* out = y.data<T>();
  if (call.mesh_dims.empty()) {
    // The dim is not sharded: every pass of a few rows while they are in cache (up to 16 rows
    // of at most 64 KiB together), their norms together (log_softmax's logs vectorise).
    const int64_t block = std::min<int64_t>(grain, kRowLanes);
    parallel_ranges(
        s.outer,
        [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
          for (int64_t r0 = lo; r0 < hi; r0 += block) {
            const int64_t rows = std::min(block, hi - r0);
            T peak[kRowLanes], norm[kRowLanes];
            double total[kRowLanes];
            // Every row's maximum first, then every row's exponentials: consecutive rows' chains
            // (a maximum's fold, then the exponentials that wait for it) are independent, so
            // the core overlaps them rather than waiting on each row's fold in turn.
            for (int64_t r = 0; r < rows; ++r) peak[r] = row_max(in + (r0 + r) * n, n);
            for (int64_t r = 0; r < rows; ++r)
              total[r] =
                  row_exp_sum(in + (r0 + r) * n, n, peak[r], log ? nullptr : out + (r0 + r) * n);
            if (log)
              for (int64_t r = 0; r < rows; ++r) log_of_total(total[r], norm[r]);
            else
              for (int64_t r = 0; r < rows; ++r) norm[r] = static_cast<T>(total[r]);
            for (int64_t r = 0; r < rows; ++r)
              row_output(in + (r0 + r) * n, n, peak[r], norm[r], log, out + (r0 + r) * n);
          }
        },
        grain);
    return y;
  }
  // Sharded: each pass over every row, the per-row statistics combined between them.
  std::vector<double> peak(s.outer);
  for_each_row(s.outer, grain,
               [&](int64_t r) TESSERA_LOOP_BODY { peak[r] = row_max(in + r * n, n); });
  peak = combine(mesh, call.mesh_dims, std::move(peak), true);
  std::vector<double> total(s.outer);
  for_each_row(s.outer, grain, [&](int64_t r) TESSERA_LOOP_BODY {
    total[r] = row_exp_sum(in + r * n, n, static_cast<T>(peak[r]), log ? nullptr : out + r * n);
  });
  total = combine(mesh, call.mesh_dims, std::move(total), false);
  for_each_row(s.outer, grain, [&](int64_t r) TESSERA_LOOP_BODY {
    T norm;
    if (log)
      log_of_total(total[r], norm);
    else
      norm = static_cast<T>(total[r]);
    row_output(in + r * n, n, static_cast<T>(peak[r]), norm, log, out + r * n);
  });
  return y;
}

/// backward_typed along a contiguous dim (inner == 1): per row the f64 sum of g (log_softmax)
/// or of g * y (softmax), then dx.
template <typename T>
Tensor backward_rows(const SoftmaxCall& call, const DeviceMesh& mesh, const T* yv, const T* gv,
                     Tensor dx, bool log) {
  const Slots& s = call.slots;
  const int64_t n = s.length, grain = rows_per_unit(s, sizeof(T));
  T* out = dx.data<T>();
  auto row_total = [&](int64_t r) TESSERA_LOOP_BODY {
    const T* y = yv + r * n;
    const T* g = gv + r * n;
    if (log) {
      Lanes8 low = {}, high = {};
      double tail = 0;
      add_lanes(g, n, low, high, tail);
      return fold(low, high) + tail;
    }
    // The products in f64, as the column passes take them: two sets of lanes.
    Lanes8 low = {}, high = {};
    int64_t i = 0;
    for (; i + kRowLanes <= n; i += kRowLanes) {
      Lanes8 y0, y1, g0, g1;
      widen8(y + i, y0);
      widen8(y + i + 8, y1);
      widen8(g + i, g0);
      widen8(g + i + 8, g1);
      low += y0 * g0;
      high += y1 * g1;
    }
    double tail = 0;
    for (; i < n; ++i) tail += double(g[i]) * double(y[i]);
    return fold(low, high) + tail;
  };
  auto row_gradient = [&](int64_t r, T t) TESSERA_LOOP_BODY {
    const T* y = yv + r * n;
    const T* g = gv + r * n;
    T* w = out + r * n;
    if (log) {
      for (int64_t i = 0; i < n; ++i) w[i] = softmax_exp(y[i]);
      for (int64_t i = 0; i < n; ++i) w[i] = g[i] - w[i] * t;
    } else {
      for (int64_t i = 0; i < n; ++i) w[i] = y[i] * (g[i] - t);
    }
  };
  if (call.mesh_dims.empty()) {
    for_each_row(s.outer, grain, [&](int64_t r) TESSERA_LOOP_BODY {
      row_gradient(r, static_cast<T>(row_total(r)));
    });
    return dx;
  }
  std::vector<double> total(s.outer);
  for_each_row(s.outer, grain, [&](int64_t r) TESSERA_LOOP_BODY { total[r] = row_total(r); });
  total = combine(mesh, call.mesh_dims, std::move(total), false);
  for_each_row(s.outer, grain,
               [&](int64_t r) TESSERA_LOOP_BODY { row_gradient(r, static_cast<T>(total[r])); });
  return dx;
}

/// forward_cpu for f32 (exp in float, vector_math.hpp) and f64: three vectorised passes.
template <typename T>
Tensor forward_typed(const SoftmaxCall& call, const DeviceMesh& mesh, const Tensor& x, bool log) {
  const Tensor source = x.contiguous();
  const T* in = source.data<T>();
  const Slots& s = call.slots;
  const int64_t columns = slot_columns(s, sizeof(T));
  if (s.inner == 1)
    return forward_rows<T>(call, mesh, in, Tensor::empty(source.shape(), source.dtype()), log);
  if (call.mesh_dims.empty()) {
    // The dim is not sharded: the three passes per unit of columns, while the unit is in cache,
    // with the same arithmetic as below (so the same results), the exponentials of softmax kept
    // in y between the sum and the division.
    Tensor y = Tensor::empty(source.shape(), source.dtype());
    T* out = y.data<T>();
    for_slot_columns(s, columns, [&](int64_t o, int64_t first, int64_t count) TESSERA_LOOP_BODY {
      T p[kSlotColumns];
      double t[kSlotColumns];
      T e[kSlotColumns];
      for (int64_t i = 0; i < count; ++i) p[i] = -std::numeric_limits<T>::infinity(), t[i] = 0;
      for (int64_t l = 0; l < s.length; ++l) {
        const T* v = in + (o * s.length + l) * s.inner + first;
        for (int64_t i = 0; i < count; ++i) p[i] = v[i] != v[i] || v[i] > p[i] ? v[i] : p[i];
      }
      // log_softmax keeps x - max in y between the passes (y's lines are first written while
      // the exponentials are computed, as softmax's are), the exponentials in a row buffer.
      for (int64_t l = 0; l < s.length; ++l) {
        const int64_t base = (o * s.length + l) * s.inner + first;
        const T* v = in + base;
        T* w = out + base;
        if (log) {
          for (int64_t i = 0; i < count; ++i) w[i] = v[i] - p[i];
          for (int64_t i = 0; i < count; ++i) e[i] = softmax_exp(w[i]);
          for (int64_t i = 0; i < count; ++i) t[i] += double(e[i]);
        } else {
          for (int64_t i = 0; i < count; ++i) w[i] = softmax_exp(T(v[i] - p[i]));
          for (int64_t i = 0; i < count; ++i) t[i] += double(w[i]);
        }
      }
      T n[kSlotColumns];
      if (log)
        for (int64_t i = 0; i < count; ++i) log_of_total(t[i], n[i]);
      else
        for (int64_t i = 0; i < count; ++i) n[i] = static_cast<T>(t[i]);
      for (int64_t l = 0; l < s.length; ++l) {
        T* w = out + (o * s.length + l) * s.inner + first;
        if (log) {
          for (int64_t i = 0; i < count; ++i) w[i] = w[i] - n[i];
        } else {
          for (int64_t i = 0; i < count; ++i) w[i] = w[i] / n[i];
        }
      }
    });
    return y;
  }
  std::vector<T> peak(slot_count(s), -std::numeric_limits<T>::infinity());
  T* peaks = peak.data();
  for_slot_columns(s, columns, [&](int64_t o, int64_t first, int64_t count) TESSERA_LOOP_BODY {
    T* p = peaks + o * s.inner + first;
    for (int64_t l = 0; l < s.length; ++l) {
      const T* v = in + (o * s.length + l) * s.inner + first;
      for (int64_t i = 0; i < count; ++i) p[i] = v[i] != v[i] || v[i] > p[i] ? v[i] : p[i];
    }
  });
  if (!call.mesh_dims.empty()) {
    std::vector<double> wide = combine(mesh, call.mesh_dims, {peak.begin(), peak.end()}, true);
    std::copy(wide.begin(), wide.end(), peak.begin());
  }
  std::vector<double> total(slot_count(s), 0.0);
  double* totals = total.data();
  for_slot_columns(s, columns, [&](int64_t o, int64_t first, int64_t count) TESSERA_LOOP_BODY {
    const T* p = peaks + o * s.inner + first;
    double* t = totals + o * s.inner + first;
    // The exponentials into a buffer first: one loop of exp alone vectorises, one of exp widened
    // and accumulated does not (GCC 12).
    T e[kSlotColumns];
    for (int64_t l = 0; l < s.length; ++l) {
      const T* v = in + (o * s.length + l) * s.inner + first;
      for (int64_t i = 0; i < count; ++i) e[i] = softmax_exp(T(v[i] - p[i]));
      for (int64_t i = 0; i < count; ++i) t[i] += double(e[i]);
    }
  });
  total = combine(mesh, call.mesh_dims, std::move(total), false);
  // Per slot: the denominator (softmax) or log of it (log_softmax), in T.
  std::vector<T> norm(slot_count(s));
  for (size_t i = 0; i < norm.size(); ++i) {
    if (log)
      log_of_total(total[i], norm[i]);
    else
      norm[i] = static_cast<T>(total[i]);
  }
  const T* norms = norm.data();
  Tensor y = Tensor::empty(source.shape(), source.dtype());
  T* out = y.data<T>();
  for_slot_columns(s, columns, [&](int64_t o, int64_t first, int64_t count) TESSERA_LOOP_BODY {
    const T* p = peaks + o * s.inner + first;
    const T* n = norms + o * s.inner + first;
    for (int64_t l = 0; l < s.length; ++l) {
      const int64_t base = (o * s.length + l) * s.inner + first;
      const T* v = in + base;
      T* w = out + base;
      if (log) {
        for (int64_t i = 0; i < count; ++i) w[i] = (v[i] - p[i]) - n[i];
      } else {
        for (int64_t i = 0; i < count; ++i) w[i] = softmax_exp(T(v[i] - p[i]));
        for (int64_t i = 0; i < count; ++i) w[i] = w[i] / n[i];
      }
    }
  });
  return y;
}

/// backward_cpu for f32 and f64: two vectorised passes.
template <typename T>
Tensor backward_typed(const SoftmaxCall& call, const DeviceMesh& mesh, const Tensor& y,
                      const Tensor& g, bool log) {
  const Tensor ys = y.contiguous(), gs = g.contiguous();
  const T* yv = ys.data<T>();
  const T* gv = gs.data<T>();
  const Slots& s = call.slots;
  const int64_t columns = slot_columns(s, sizeof(T));
  if (s.inner == 1)
    return backward_rows<T>(call, mesh, yv, gv, Tensor::empty(ys.shape(), ys.dtype()), log);
  if (call.mesh_dims.empty()) {
    // The dim is not sharded: both passes per unit of columns while it is in cache, with the
    // same arithmetic as below.
    Tensor dx = Tensor::empty(ys.shape(), ys.dtype());
    T* out = dx.data<T>();
    for_slot_columns(s, columns, [&](int64_t o, int64_t first, int64_t count) TESSERA_LOOP_BODY {
      double total[kSlotColumns];
      for (int64_t i = 0; i < count; ++i) total[i] = 0;
      for (int64_t l = 0; l < s.length; ++l) {
        const int64_t base = (o * s.length + l) * s.inner + first;
        if (log)
          for (int64_t i = 0; i < count; ++i) total[i] += double(gv[base + i]);
        else
          for (int64_t i = 0; i < count; ++i)
            total[i] += double(gv[base + i]) * double(yv[base + i]);
      }
      T t[kSlotColumns];
      for (int64_t i = 0; i < count; ++i) t[i] = static_cast<T>(total[i]);
      for (int64_t l = 0; l < s.length; ++l) {
        const int64_t base = (o * s.length + l) * s.inner + first;
        const T* yr = yv + base;
        const T* gr = gv + base;
        T* w = out + base;
        if (log) {
          for (int64_t i = 0; i < count; ++i) w[i] = softmax_exp(yr[i]);
          for (int64_t i = 0; i < count; ++i) w[i] = gr[i] - w[i] * t[i];
        } else
          for (int64_t i = 0; i < count; ++i) w[i] = yr[i] * (gr[i] - t[i]);
      }
    });
    return dx;
  }
  std::vector<double> total(slot_count(s), 0.0);
  double* totals = total.data();
  for_slot_columns(s, columns, [&](int64_t o, int64_t first, int64_t count) TESSERA_LOOP_BODY {
    double* t = totals + o * s.inner + first;
    for (int64_t l = 0; l < s.length; ++l) {
      const int64_t base = (o * s.length + l) * s.inner + first;
      if (log)
        for (int64_t i = 0; i < count; ++i) t[i] += double(gv[base + i]);
      else
        for (int64_t i = 0; i < count; ++i) t[i] += double(gv[base + i]) * double(yv[base + i]);
    }
  });
  total = combine(mesh, call.mesh_dims, std::move(total), false);
  std::vector<T> sum(total.begin(), total.end());
  const T* sums = sum.data();
  Tensor dx = Tensor::empty(ys.shape(), ys.dtype());
  T* out = dx.data<T>();
  for_slot_columns(s, columns, [&](int64_t o, int64_t first, int64_t count) TESSERA_LOOP_BODY {
    const T* t = sums + o * s.inner + first;
    for (int64_t l = 0; l < s.length; ++l) {
      const int64_t base = (o * s.length + l) * s.inner + first;
      const T* yr = yv + base;
      const T* gr = gv + base;
      T* w = out + base;
      if (log) {
        for (int64_t i = 0; i < count; ++i) w[i] = softmax_exp(yr[i]);
        for (int64_t i = 0; i < count; ++i) w[i] = gr[i] - w[i] * t[i];
      } else
        for (int64_t i = 0; i < count; ++i) w[i] = yr[i] * (gr[i] - t[i]);
    }
  });
  return dx;
}

/// softmax (or log_softmax) of a local piece; the statistics combined over the call's mesh dims.
Tensor forward_cpu(const SoftmaxCall& call, const DeviceMesh& mesh, const Tensor& x, bool log) {
  if (x.is_shape_only()) return estimated(call, mesh, x, 2);  // the max, then the sum
  if (x.dtype() == DType::f32) return forward_typed<float>(call, mesh, x, log);
  if (x.dtype() == DType::f64) return forward_typed<double>(call, mesh, x, log);
  const Tensor x64 = x.to_dtype(DType::f64).contiguous();
  const double* in = x64.data<double>();
  const Slots& s = call.slots;
  std::vector<double> peak(slot_count(s), -std::numeric_limits<double>::infinity());
  for_each_in_slots(s, [&](int64_t slot, int64_t index) {
    const double v = in[index];
    if (std::isnan(v) || v > peak[slot]) peak[slot] = v;
  });
  peak = combine(mesh, call.mesh_dims, std::move(peak), true);
  std::vector<double> total(slot_count(s), 0.0);
  for_each_in_slots(
      s, [&](int64_t slot, int64_t index) { total[slot] += std::exp(in[index] - peak[slot]); });
  total = combine(mesh, call.mesh_dims, std::move(total), false);
  Tensor y = Tensor::empty(x64.shape(), DType::f64);
  double* out = y.data<double>();
  for_each_in_slots(s, [&](int64_t slot, int64_t index) {
    const double shifted = in[index] - peak[slot];
    out[index] = log ? shifted - std::log(total[slot]) : std::exp(shifted) / total[slot];
  });
  return y.to_dtype(x.dtype());
}

/// The gradient of x from y and g (local pieces of one layout).
Tensor backward_cpu(const SoftmaxCall& call, const DeviceMesh& mesh, const Tensor& y,
                    const Tensor& g, bool log) {
  if (y.is_shape_only() || g.is_shape_only()) return estimated(call, mesh, y, 1);  // the sum
  if (y.dtype() == DType::f32 && g.dtype() == DType::f32)
    return backward_typed<float>(call, mesh, y, g, log);
  if (y.dtype() == DType::f64 && g.dtype() == DType::f64)
    return backward_typed<double>(call, mesh, y, g, log);
  const Tensor y64 = y.to_dtype(DType::f64).contiguous();
  const Tensor g64 = g.to_dtype(DType::f64).contiguous();
  const double* yv = y64.data<double>();
  const double* gv = g64.data<double>();
  const Slots& s = call.slots;
  std::vector<double> total(slot_count(s), 0.0);
  for_each_in_slots(s, [&](int64_t slot, int64_t index) {
    total[slot] += log ? gv[index] : gv[index] * yv[index];
  });
  total = combine(mesh, call.mesh_dims, std::move(total), false);
  Tensor dx = Tensor::empty(y64.shape(), DType::f64);
  double* out = dx.data<double>();
  for_each_in_slots(s, [&](int64_t slot, int64_t index) {
    out[index] =
        log ? gv[index] - std::exp(yv[index]) * total[slot] : yv[index] * (gv[index] - total[slot]);
  });
  return dx.to_dtype(y.dtype());
}

/// The communicator of the call's statistics for the cuda bodies (null: nothing shards the dim).
Comm* comm_of(const SoftmaxCall& call, const DeviceMesh& mesh) {
  return call.mesh_dims.empty() ? nullptr : mesh.sub_comm(call.mesh_dims).get();
}

void register_softmax(const std::string& name, bool log) {
  RuleFn rule = [name](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    check_arg(inputs.size() == 1, name, "expects 1 input (x), got {}", inputs.size());
    softmax_dim(name, attrs, inputs[0].global_shape.size());  // validates before data moves
    const ShardSpec layout = without_partial(inputs[0]);
    return OpRule{{layout}, {std::nullopt}, {layout}};
  };
  KernelFn cpu = [name, log](const KernelContext& context, const std::vector<Tensor>& inputs) {
    require_floating_cpu(inputs[0], name);
    const SoftmaxCall call =
        call_of(name, context.attrs, context.input_specs[0], inputs[0].shape());
    return std::vector<Tensor>{forward_cpu(call, context.mesh, inputs[0], log)};
  };
  KernelFn cuda = [name, log](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const SoftmaxCall call =
        call_of(name, context.attrs, context.input_specs[0], inputs[0].shape());
    return std::vector<Tensor>{softmax_forward_cuda(
        inputs[0], call.slots, comm_of(call, context.mesh), log, context.stream)};
  };
  BackwardFn backward = [name, log](const OpRecord& record,
                                    const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardTensor& y = record.outputs[0];
    const ShardTensor g = grads[0]->spec() == y.spec()
                              ? *grads[0]
                              : grads[0]->redistribute(y.placements(), y.spec().extents);
    const SoftmaxCall call = call_of(name, record.attrs, y.spec(), y.to_local().shape());
    const Tensor dx =
        y.to_local().device().is_cuda()
            ? softmax_backward_cuda(y.to_local(), g.to_local(), call.slots, comm_of(call, y.mesh()),
                                    log, compute_stream_for(y.to_local().device()))
            : backward_cpu(call, y.mesh(), y.to_local(), g.to_local(), log);
    return {ShardTensor(dx, y.mesh(), y.spec())};
  };
  register_op(OpDef{.name = name,
                    .summary = log ? "log(softmax(x)) along dim, computed as x - max - log(sum "
                                     "exp(x - max)) (dim may be sharded)"
                                   : "exp(x - max) / sum(exp(x - max)) along dim (dim may be "
                                     "sharded)",
                    .inputs = {{.name = "x"}},
                    .outputs = {"y"},
                    .attrs = {{.name = "dim",
                               .type = AttrType::int_scalar,
                               .default_value = int64_t{-1},
                               .doc = "the dim normalized over (negative: from the end)"}},
                    .rule = std::move(rule),
                    .cpu = std::move(cpu),
                    .cuda = std::move(cuda),
                    .backward = std::move(backward)});
  // The kernel gathers the statistics over the ranks sharding the dim.
  estimate::run_kernel_in_estimate_mode(name);
}

}  // namespace

void register_softmax_ops() {
  register_softmax("softmax", false);
  register_softmax("log_softmax", true);
}

ShardTensor softmax(const ShardTensor& x, int64_t dim) {
  return apply_op("softmax", {x}, OpAttrs().set("dim", dim))[0];
}

ShardTensor log_softmax(const ShardTensor& x, int64_t dim) {
  return apply_op("log_softmax", {x}, OpAttrs().set("dim", dim))[0];
}

}  // namespace tessera::ops
