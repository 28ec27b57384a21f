// The cpu kernels of the normalizations (norm_kernels.hpp). The piece is cut into units of one
// plane's chunk of at most kChunk elements; threads take units, every unit's partial results go
// to its own slot of a buffer, and the units are combined afterwards in plane order, so the
// results are the same for any thread count. Sums use eight independent lanes (which the
// compiler vectorizes) in f64.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/parallel_for.hpp"
#include "ops/cpu_lanes.hpp"
#include "ops/cpu_loops.hpp"
#include "ops/norm/norm_kernels.hpp"

namespace tessera::ops {

namespace {

using kernels::NormGeometry;

/// Elements per unit of work.
constexpr int64_t kChunk = 8192;
/// Independent f64 accumulators of a sum (a power of 2).
constexpr int kLanes = 16;

const char* op_name(const NormGeometry& g) {
  switch (g.kind) {
    case kernels::NormKind::group: return "group_norm";
    case kernels::NormKind::batch: return "batch_norm";
    case kernels::NormKind::instance: return "instance_norm";
    case kernels::NormKind::layer: return "layer_norm";
  }
  return "norm";
}

/// Calls fn.template operator()<T, Compute>() for the floating dtypes.
template <typename Fn>
void dispatch_norm(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DType::f32: fn.template operator()<float, float>(); return;
    case DType::f64: fn.template operator()<double, double>(); return;
    case DType::f16: fn.template operator()<Half, float>(); return;
    case DType::bf16: fn.template operator()<BFloat16, float>(); return;
    default: break;
  }
  throw InvalidArgument(op, fmt::format("needs a floating tensor, got {}", dtype_name(dtype)));
}

/// An element widened to double.
template <typename T>
[[gnu::always_inline]] inline double widen(T value) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>)
    return static_cast<double>(value);
  else
    return static_cast<double>(static_cast<float>(value));
}

/// Chunks per plane (0 for empty planes).
int64_t chunks_of(const NormGeometry& g) {
  return g.length > 0 ? (g.length + kChunk - 1) / kChunk : 0;
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TESSERA_NORM_MULTI_ISA 1
#define TESSERA_NORM_INLINE [[gnu::always_inline]] inline
#define TESSERA_NORM_TARGET_V4 __attribute__((target("arch=x86-64-v4,prefer-vector-width=512")))
#define TESSERA_NORM_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#else
#define TESSERA_NORM_MULTI_ISA 0
#define TESSERA_NORM_INLINE inline
#define TESSERA_NORM_TARGET_V4
#define TESSERA_NORM_TARGET_V3
#endif

using ops::fold;  // of two Lanes8 (cpu_lanes.hpp), beside this one of an array

/// fold of the kLanes lanes of an array.
TESSERA_NORM_INLINE double fold(const double* lanes) {
  static_assert(kLanes == 16);
  Lanes8 low, high;
  std::memcpy(&low, lanes, sizeof low);
  std::memcpy(&high, lanes + 8, sizeof high);
  return fold(low, high);
}

/// mean and M2 of the n elements at p (two passes, f64 lanes).
template <typename T>
TESSERA_NORM_INLINE void chunk_moments(const T* p, int64_t n, double& mean, double& m2) {
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += widen(p[i + l]);
  double tail = 0;
  for (int64_t j = i; j < n; ++j) tail += widen(p[j]);
  mean = (fold(lanes) + tail) / static_cast<double>(n);
  for (int l = 0; l < kLanes; ++l) lanes[l] = 0;
  for (i = 0; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const double d = widen(p[i + l]) - mean;
      lanes[l] += d * d;
    }
  tail = 0;
  for (int64_t j = i; j < n; ++j) {
    const double d = widen(p[j]) - mean;
    tail += d * d;
  }
  m2 = fold(lanes) + tail;
}

/// first = sum of dy * w, second = sum of dy * w * xhat over n elements (w per element, or none).
/// Lane l of the 16 sums takes the elements i with i % 16 == l, in order; the lanes are held in
/// vector registers (as scalar arrays the compiler left this loop scalar, 2.5x slower than the
/// memory it reads).
template <typename T>
TESSERA_NORM_INLINE void chunk_sums(const T* p, const T* d, const double* w, int64_t n, double mean,
                                    double rstd, double& first, double& second) {
  static_assert(kLanes == 16);
  Lanes8 a0 = {}, a1 = {}, b0 = {}, b1 = {};
  int64_t i = 0;
  if (w) {
    for (; i + kLanes <= n; i += kLanes) {
      Lanes8 w0, w1, g0, g1, x0, x1;
      std::memcpy(&w0, w + i, sizeof w0);
      std::memcpy(&w1, w + i + 8, sizeof w1);
      widen8(d + i, g0);
      widen8(d + i + 8, g1);
      widen8(p + i, x0);
      widen8(p + i + 8, x1);
      g0 *= w0;
      g1 *= w1;
      a0 += g0;
      a1 += g1;
      b0 += g0 * ((x0 - mean) * rstd);
      b1 += g1 * ((x1 - mean) * rstd);
    }
  } else {
    for (; i + kLanes <= n; i += kLanes) {
      Lanes8 g0, g1, x0, x1;
      widen8(d + i, g0);
      widen8(d + i + 8, g1);
      widen8(p + i, x0);
      widen8(p + i + 8, x1);
      a0 += g0;
      a1 += g1;
      b0 += g0 * ((x0 - mean) * rstd);
      b1 += g1 * ((x1 - mean) * rstd);
    }
  }
  double ta = 0, tb = 0;
  for (; i < n; ++i) {
    const double g = widen(d[i]) * (w ? w[i] : 1.0);
    ta += g;
    tb += g * ((widen(p[i]) - mean) * rstd);
  }
  first = fold(a0, a1) + ta;
  second = fold(b0, b1) + tb;
}

/// q = (p - mean) * scale + shift, or with per-element w, b (either may be null):
/// q = (p - mean) * rstd * w + b.
template <typename T, typename C>
TESSERA_NORM_INLINE void chunk_forward(const T* p, T* q, int64_t n, C mean, C rstd, C scale,
                                       C shift, const C* w, const C* b) {
  if (!w && !b) {
    for (int64_t i = 0; i < n; ++i) q[i] = T((static_cast<C>(p[i]) - mean) * scale + shift);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    C value = (static_cast<C>(p[i]) - mean) * rstd;
    if (w) value *= w[i];
    if (b) value += b[i];
    q[i] = T(value);
  }
}

/// q = rstd * (dy * scale (or * w per element) - mean_dxhat - xhat * mean_dxhat_xhat).
template <typename T, typename C>
TESSERA_NORM_INLINE void chunk_dx(const T* p, const T* d, T* q, int64_t n, C mean, C rstd, C scale,
                                  const C* w, C mean_dxhat, C mean_dxhat_xhat) {
  if (!w) {
    for (int64_t i = 0; i < n; ++i) {
      const C xhat = (static_cast<C>(p[i]) - mean) * rstd;
      q[i] = T(rstd * (static_cast<C>(d[i]) * scale - mean_dxhat - xhat * mean_dxhat_xhat));
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const C xhat = (static_cast<C>(p[i]) - mean) * rstd;
    q[i] = T(rstd * (static_cast<C>(d[i]) * w[i] - mean_dxhat - xhat * mean_dxhat_xhat));
  }
}

/// The chunk kernels compiled for one instruction set.
template <typename T, typename C>
struct ChunkKernels {
  void (*moments)(const T*, int64_t, double&, double&);
  void (*sums)(const T*, const T*, const double*, int64_t, double, double, double&, double&);
  void (*forward)(const T*, T*, int64_t, C, C, C, C, const C*, const C*);
  void (*dx)(const T*, const T*, T*, int64_t, C, C, C, const C*, C, C);
};

#define TESSERA_NORM_CHUNKS(SUFFIX, TARGET)                                                   \
  template <typename T, typename C>                                                           \
  struct Chunks##SUFFIX {                                                                     \
    TARGET static void moments(const T* p, int64_t n, double& mean, double& m2) {             \
      chunk_moments<T>(p, n, mean, m2);                                                       \
    }                                                                                         \
    TARGET static void sums(const T* p, const T* d, const double* w, int64_t n, double mean,  \
                            double rstd, double& first, double& second) {                     \
      chunk_sums<T>(p, d, w, n, mean, rstd, first, second);                                   \
    }                                                                                         \
    TARGET static void forward(const T* p, T* q, int64_t n, C mean, C rstd, C scale, C shift, \
                               const C* w, const C* b) {                                      \
      chunk_forward<T, C>(p, q, n, mean, rstd, scale, shift, w, b);                           \
    }                                                                                         \
    TARGET static void dx(const T* p, const T* d, T* q, int64_t n, C mean, C rstd, C scale,   \
                          const C* w, C mean_dxhat, C mean_dxhat_xhat) {                      \
      chunk_dx<T, C>(p, d, q, n, mean, rstd, scale, w, mean_dxhat, mean_dxhat_xhat);          \
    }                                                                                         \
    static ChunkKernels<T, C> set() { return {&moments, &sums, &forward, &dx}; }              \
  };
TESSERA_NORM_CHUNKS(Base, )
#if TESSERA_NORM_MULTI_ISA
TESSERA_NORM_CHUNKS(V3, TESSERA_NORM_TARGET_V3)
TESSERA_NORM_CHUNKS(V4, TESSERA_NORM_TARGET_V4)
#endif

/// The chunk kernels for this cpu: x86-64-v4, -v3 or the baseline.
template <typename T, typename C>
ChunkKernels<T, C> chunk_kernels() {
#if TESSERA_NORM_MULTI_ISA
  static const int level = [] {
    __builtin_cpu_init();
    const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                    __builtin_cpu_supports("avx512cd");
    return v4 ? 4 : v3 ? 3 : 0;
  }();
  if (level == 4) return ChunksV4<T, C>::set();
  if (level == 3) return ChunksV3<T, C>::set();
#endif
  return ChunksBase<T, C>::set();
}

/// `values` as the computation type.
template <typename C>
std::vector<C> as_compute(const std::vector<double>& values) {
  return std::vector<C>(values.begin(), values.end());
}

/// Calls body(unit, plane, lo, hi) for every unit of the piece, in parallel.
template <typename Body>
void for_units(const NormGeometry& g, Body&& body) {
  const int64_t chunks = chunks_of(g);
  const int64_t units = g.planes() * chunks;
  if (units == 0) return;
  parallel_for(units, compute_threads(), [&](int64_t begin, int64_t end, int) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t plane = u / chunks, lo = (u % chunks) * kChunk;
      body(u, plane, lo, std::min(g.length, lo + kChunk));
    }
  });
}

/// Threads for combining the units into slots: one (no parallel region) unless there are many.
int combine_threads(const NormGeometry& g) {
  return g.planes() * chunks_of(g) > (int64_t{1} << 16) ? compute_threads() : 1;
}

/// Calls visit(plane) for every plane of slot `slot`, in plane order.
template <typename Visit>
void for_slot_planes(const NormGeometry& g, int64_t slot, Visit&& visit) {
  const kernels::SlotPlanes planes = kernels::slot_planes(g, slot);
  for (int64_t n = planes.n_lo; n < planes.n_hi; ++n)
    for (int64_t c = planes.c_lo; c < planes.c_hi; ++c) visit(n * g.channels + c);
}

/// A contiguous f64 copy of a small cpu tensor's values.
std::vector<double> values_of(const Tensor& tensor) {
  const Tensor source = tensor.contiguous();
  std::vector<double> values(static_cast<size_t>(source.numel()));
  dispatch_norm(source.dtype(), "norm", [&]<typename T, typename C>() {
    const T* data = static_cast<const T*>(source.raw_data());
    for (size_t i = 0; i < values.size(); ++i) values[i] = widen(data[i]);
  });
  return values;
}

/// A tensor of `dtype` holding `values`.
Tensor tensor_of(const std::vector<double>& values, const Shape& shape, DType dtype) {
  Tensor result = Tensor::empty(shape, dtype);
  dispatch_norm(dtype, "norm", [&]<typename T, typename C>() {
    T* data = static_cast<T*>(result.raw_data());
    for (size_t i = 0; i < values.size(); ++i) data[i] = T(static_cast<C>(values[i]));
  });
  return result;
}

void check_piece(const NormGeometry& g, const Tensor& x) {
  TESSERA_CHECK_ARG(x.device().is_cpu(), op_name(g), "cpu kernel got a {} tensor", x.str());
  TESSERA_CHECK_ARG(x.numel() == g.numel(), op_name(g),
                    "piece {} does not hold {} x {} x {} elements", x.str(), g.batch, g.channels,
                    g.length);
}

/// True when every plane is its own statistics slot and fits in one unit (layer_norm's rows of at
/// most kChunk elements). Then a slot's moments and sums are its single unit's, so the row kernels
/// below write them straight into the slot, and rows are handed to the threads in blocks: on short
/// rows (16 channels) the per-unit call, the unit buffer and the combine step cost more than the
/// arithmetic. The arithmetic per row is that of the chunk kernels (same results).
bool one_unit_per_slot(const NormGeometry& g) {
  return g.kind == kernels::NormKind::layer && g.channels == 1 && g.slot_stride == 1 &&
         g.slot_offset == 0 && g.channels_per_slot == 1 && g.slots == g.planes() && g.length > 0 &&
         g.length <= kChunk;
}

/// Calls rows(first, last) over blocks of about kChunk elements of whole rows, in parallel, each
/// compiled for this cpu's instruction set (cpu_loops.hpp).
template <typename Rows>
void for_row_blocks(const NormGeometry& g, const Rows& rows) {
  parallel_ranges(g.planes(), rows, std::max<int64_t>(1, kChunk / g.length));
}

}  // namespace

Tensor norm_moments_cpu(const NormGeometry& g, const Tensor& x) {
  // Estimate mode (shape-only pieces): the results' shapes, no element visited.
  if (x.is_shape_only()) return Tensor::empty({g.slots, 3}, DType::f64);
  check_piece(g, x);
  const Tensor input = x.contiguous();
  if (one_unit_per_slot(g)) {
    // The slot's moments are its one unit's (combining into an empty slot copies them).
    Tensor moments = Tensor::empty({g.slots, 3}, DType::f64);
    double* out = moments.data<double>();
    dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
      const T* data = static_cast<const T*>(input.raw_data());
      const int64_t length = g.length;
      for_row_blocks(g, [&](int64_t first, int64_t last) TESSERA_LOOP_BODY {
        for (int64_t row = first; row < last; ++row) {
          out[3 * row] = static_cast<double>(length);
          chunk_moments<T>(data + row * length, length, out[3 * row + 1], out[3 * row + 2]);
        }
      });
    });
    return moments;
  }
  const int64_t chunks = chunks_of(g);
  std::vector<double> units(static_cast<size_t>(3 * g.planes() * chunks));
  dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
    const T* data = static_cast<const T*>(input.raw_data());
    const ChunkKernels<T, C> kernels = chunk_kernels<T, C>();
    for_units(g, [&](int64_t u, int64_t plane, int64_t lo, int64_t hi) {
      units[3 * u] = static_cast<double>(hi - lo);
      kernels.moments(data + plane * g.length + lo, hi - lo, units[3 * u + 1], units[3 * u + 2]);
    });
  });
  Tensor moments = Tensor::zeros({g.slots, 3}, DType::f64);
  double* out = moments.data<double>();
  parallel_for(g.slots, combine_threads(g), [&](int64_t begin, int64_t end, int) {
    for (int64_t s = begin; s < end; ++s) {
      double count = 0, mean = 0, m2 = 0;
      for_slot_planes(g, s, [&](int64_t plane) {
        for (int64_t k = 0; k < chunks; ++k) {
          const double* unit = &units[3 * (plane * chunks + k)];
          kernels::combine_moments(count, mean, m2, unit[0], unit[1], unit[2]);
        }
      });
      out[3 * s] = count;
      out[3 * s + 1] = mean;
      out[3 * s + 2] = m2;
    }
  });
  return moments;
}

Tensor norm_statistics_cpu(const Tensor& gathered, double eps) {
  if (gathered.is_shape_only()) return Tensor::empty({gathered.shape()[1], 4}, DType::f64);
  const Tensor source = gathered.contiguous();
  const int64_t ranks = source.shape()[0], slots = source.shape()[1];
  const double* in = source.data<double>();
  Tensor statistics = Tensor::empty({slots, 4}, DType::f64);
  double* out = statistics.data<double>();
  if (ranks == 1) {
    // Combining one rank's moments into empty ones copies them (an empty slot stays all zero):
    // the same values without the combine's branches. In blocks: the interleaved fields are
    // copied by scalar loops, the square roots and divisions run over a contiguous block, where
    // they vectorise.
    parallel_ranges(slots, [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
      constexpr int64_t kBlock = 256;
      double var[kBlock];
      const double epsilon = eps;
      for (int64_t first = lo; first < hi; first += kBlock) {
        const int64_t n = std::min(kBlock, hi - first);
        const double* from = in + 3 * first;
        double* to = out + 4 * first;
        for (int64_t k = 0; k < n; ++k) {
          const double count = from[3 * k];
          const double mean = count != 0 ? from[3 * k + 1] : 0.0;
          const double m2 = count != 0 ? from[3 * k + 2] : 0.0;
          var[k] = count > 0 ? m2 / count : 0.0;
          to[4 * k] = mean;
          to[4 * k + 2] = count;
          to[4 * k + 3] = m2;
        }
        for (int64_t k = 0; k < n; ++k) var[k] = 1.0 / std::sqrt(var[k] + epsilon);
        for (int64_t k = 0; k < n; ++k) to[4 * k + 1] = var[k];
      }
    });
    return statistics;
  }
  for (int64_t s = 0; s < slots; ++s) {
    double count = 0, mean = 0, m2 = 0;
    for (int64_t r = 0; r < ranks; ++r) {
      const double* m = in + 3 * (r * slots + s);
      kernels::combine_moments(count, mean, m2, m[0], m[1], m[2]);
    }
    const double var = count > 0 ? m2 / count : 0.0;
    out[4 * s] = mean;
    out[4 * s + 1] = 1.0 / std::sqrt(var + eps);
    out[4 * s + 2] = count;
    out[4 * s + 3] = m2;
  }
  return statistics;
}

Tensor norm_running_statistics_cpu(const Tensor& running_mean, const Tensor& running_var,
                                   double eps) {
  if (running_mean.is_shape_only() || running_var.is_shape_only())
    return Tensor::empty({running_mean.numel(), 4}, DType::f64);
  const std::vector<double> mean = values_of(running_mean), var = values_of(running_var);
  const int64_t channels = static_cast<int64_t>(mean.size());
  Tensor statistics = Tensor::zeros({channels, 4}, DType::f64);
  double* out = statistics.data<double>();
  for (int64_t c = 0; c < channels; ++c) {
    out[4 * c] = mean[c];
    out[4 * c + 1] = 1.0 / std::sqrt(var[c] + eps);
  }
  return statistics;
}

std::pair<Tensor, Tensor> norm_update_running_cpu(const Tensor& statistics,
                                                  const Tensor& running_mean,
                                                  const Tensor& running_var, double momentum) {
  if (statistics.is_shape_only() || running_mean.is_shape_only() || running_var.is_shape_only())
    return {Tensor::empty(running_mean.shape(), running_mean.dtype()),
            Tensor::empty(running_var.shape(), running_var.dtype())};
  const Tensor stats = statistics.contiguous();
  std::vector<double> mean = values_of(running_mean), var = values_of(running_var);
  const double* s = stats.data<double>();
  for (size_t c = 0; c < mean.size(); ++c) {
    const double count = s[4 * c + 2];
    const double unbiased = count > 1 ? s[4 * c + 3] / (count - 1) : 0.0;
    mean[c] = (1 - momentum) * mean[c] + momentum * s[4 * c];
    var[c] = (1 - momentum) * var[c] + momentum * unbiased;
  }
  return {tensor_of(mean, running_mean.shape(), running_mean.dtype()),
          tensor_of(var, running_var.shape(), running_var.dtype())};
}

Tensor norm_forward_cpu(const NormGeometry& g, const Tensor& x, const Tensor& statistics,
                        const std::optional<Tensor>& w, const std::optional<Tensor>& b) {
  if (x.is_shape_only() || statistics.is_shape_only()) {
    check_piece(g, x);
    return Tensor::empty(x.shape(), x.dtype());
  }
  check_piece(g, x);
  const Tensor input = x.contiguous();
  const Tensor stats = statistics.contiguous();
  const std::vector<double> weight = w ? values_of(*w) : std::vector<double>{};
  const std::vector<double> bias = b ? values_of(*b) : std::vector<double>{};
  Tensor y = Tensor::empty(input.shape(), input.dtype());
  const double* s = stats.data<double>();
  dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    T* out = static_cast<T*>(y.raw_data());
    const ChunkKernels<T, C> kernels = chunk_kernels<T, C>();
    const std::vector<C> w_c = as_compute<C>(weight), b_c = as_compute<C>(bias);
    if (one_unit_per_slot(g)) {
      const C* wp = w ? w_c.data() : nullptr;
      const C* bp = b ? b_c.data() : nullptr;
      const int64_t length = g.length;
      for_row_blocks(g, [&](int64_t first, int64_t last) TESSERA_LOOP_BODY {
        for (int64_t row = first; row < last; ++row) {
          const C mean = static_cast<C>(s[4 * row]), rstd = static_cast<C>(s[4 * row + 1]);
          chunk_forward<T, C>(in + row * length, out + row * length, length, mean, rstd, rstd, C(0),
                              wp, bp);
        }
      });
      return;
    }
    for_units(g, [&](int64_t, int64_t plane, int64_t lo, int64_t hi) {
      const int64_t slot = g.slot_of(plane);
      const C mean = static_cast<C>(s[4 * slot]), rstd = static_cast<C>(s[4 * slot + 1]);
      const T* p = in + plane * g.length + lo;
      T* q = out + plane * g.length + lo;
      if (!g.per_element_affine) {
        const int64_t c = g.channel_of(plane);
        const C scale = rstd * (w ? w_c[c] : C(1));
        kernels.forward(p, q, hi - lo, mean, rstd, scale, b ? b_c[c] : C(0), nullptr, nullptr);
      } else {
        kernels.forward(p, q, hi - lo, mean, rstd, rstd, C(0), w ? w_c.data() + lo : nullptr,
                        b ? b_c.data() + lo : nullptr);
      }
    });
  });
  return y;
}

Tensor norm_backward_sums_cpu(const NormGeometry& g, const Tensor& x, const Tensor& dy,
                              const Tensor& statistics, const std::optional<Tensor>& w,
                              bool want_dw, bool want_db, NormParamGrads& grads) {
  if (x.is_shape_only() || dy.is_shape_only() || statistics.is_shape_only()) {
    check_piece(g, x);
    const Shape param{g.per_element_affine ? g.length : g.channels};
    if (want_dw) grads.dw = Tensor::empty(param, x.dtype());
    if (want_db) grads.db = Tensor::empty(param, x.dtype());
    return Tensor::empty({g.slots, 2}, DType::f64);
  }
  check_piece(g, x);
  TESSERA_CHECK_ARG(dy.shape() == x.shape() && dy.dtype() == x.dtype(), op_name(g),
                    "backward got the gradient {} for x {}", dy.str(), x.str());
  const Tensor input = x.contiguous(), grad = dy.contiguous();
  const Tensor stats = statistics.contiguous();
  const std::vector<double> weight = w ? values_of(*w) : std::vector<double>{};
  const double* s = stats.data<double>();
  const int64_t chunks = chunks_of(g);
  // Per unit: (sum dy, sum dy * xhat) with a per-plane affine, (sum dxhat, sum dxhat * xhat)
  // with a per-element one.
  const bool rows = one_unit_per_slot(g);
  std::vector<double> units(rows ? 0 : static_cast<size_t>(2 * g.planes() * chunks));
  // layer_norm's dw, db: column sums over the planes (rows). Ranges of kPlanes planes each sum
  // their planes in order into their own partial row; the partial rows are then added in range
  // order (the order depends on the shape only). With rows of one unit, the pass that sums each
  // row also sums its columns (one read of x and dy instead of two).
  constexpr int64_t kColumns = 256;
  constexpr int64_t kPlanes = 2048;
  const bool want_columns = g.per_element_affine && (want_dw || want_db);
  const int64_t ranges = std::max<int64_t>(1, (g.planes() + kPlanes - 1) / kPlanes);
  std::vector<double> partial(want_columns ? static_cast<size_t>(2 * ranges * g.length) : 0, 0.0);
  const bool columns_with_rows = rows && want_columns;
  Tensor sums =
      rows ? Tensor::empty({g.slots, 2}, DType::f64) : Tensor::zeros({g.slots, 2}, DType::f64);
  dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    const T* gy = static_cast<const T*>(grad.raw_data());
    const ChunkKernels<T, C> kernels = chunk_kernels<T, C>();
    const bool per_element = g.per_element_affine && w;
    if (rows) {
      // A slot's sums are its one unit's (the per-element affine needs no per-plane factor).
      double* out = sums.data<double>();
      const double* wp = per_element ? weight.data() : nullptr;
      const int64_t length = g.length;
      if (!columns_with_rows) {
        for_row_blocks(g, [&](int64_t first, int64_t last) TESSERA_LOOP_BODY {
          for (int64_t row = first; row < last; ++row)
            chunk_sums<T>(in + row * length, gy + row * length, wp, length, s[4 * row],
                          s[4 * row + 1], out[2 * row], out[2 * row + 1]);
        });
        return;
      }
      // Calls cover whole ranges of kPlanes rows (the chunk), so no two threads share a range.
      double* part = partial.data();
      parallel_ranges(
          g.planes(),
          [&](int64_t first, int64_t last) TESSERA_LOOP_BODY {
            for (int64_t row = first; row < last; ++row) {
              const T* p = in + row * length;
              const T* d = gy + row * length;
              const double mean = s[4 * row], rstd = s[4 * row + 1];
              chunk_sums<T>(p, d, wp, length, mean, rstd, out[2 * row], out[2 * row + 1]);
              double* part_db = part + 2 * (row / kPlanes) * length;
              double* part_dw = part_db + length;
              for (int64_t i = 0; i < length; ++i) {
                const double value = widen(d[i]);
                part_db[i] += value;
                part_dw[i] += value * ((widen(p[i]) - mean) * rstd);
              }
            }
          },
          kPlanes);
      return;
    }
    for_units(g, [&](int64_t u, int64_t plane, int64_t lo, int64_t hi) {
      const int64_t slot = g.slot_of(plane);
      kernels.sums(in + plane * g.length + lo, gy + plane * g.length + lo,
                   per_element ? weight.data() + lo : nullptr, hi - lo, s[4 * slot],
                   s[4 * slot + 1], units[2 * u], units[2 * u + 1]);
    });
  });
  // Slot sums over the slot's planes and chunks in order.
  double* out = sums.data<double>();
  const bool scaled = !g.per_element_affine && w;
  if (!rows)
    parallel_for(g.slots, combine_threads(g), [&](int64_t begin, int64_t end, int) {
      for (int64_t slot = begin; slot < end; ++slot) {
        double first = 0, second = 0;
        for_slot_planes(g, slot, [&](int64_t plane) {
          const double factor = scaled ? weight[g.channel_of(plane)] : 1.0;
          for (int64_t k = 0; k < chunks; ++k) {
            first += factor * units[2 * (plane * chunks + k)];
            second += factor * units[2 * (plane * chunks + k) + 1];
          }
        });
        out[2 * slot] = first;
        out[2 * slot + 1] = second;
      }
    });
  if (!want_dw && !want_db) return sums;
  if (!g.per_element_affine) {
    // dw[c] = sum of dy * xhat, db[c] = sum of dy over the planes of channel c, n in order.
    std::vector<double> dw(static_cast<size_t>(g.channels), 0.0), db(dw.size(), 0.0);
    for (int64_t c = 0; c < g.channels; ++c)
      for (int64_t n = 0; n < g.batch; ++n)
        for (int64_t k = 0; k < chunks; ++k) {
          const int64_t u = (n * g.channels + c) * chunks + k;
          db[c] += units[2 * u];
          dw[c] += units[2 * u + 1];
        }
    if (want_dw) grads.dw = tensor_of(dw, {g.channels}, x.dtype());
    if (want_db) grads.db = tensor_of(db, {g.channels}, x.dtype());
    return sums;
  }
  // layer_norm: the column sums (above); units of (a range of kPlanes planes, a block of
  // kColumns columns) run on the compute threads when the row pass did not sum them.
  std::vector<double> dw(static_cast<size_t>(g.length), 0.0), db(dw.size(), 0.0);
  const int64_t blocks = (g.length + kColumns - 1) / kColumns;
  if (!columns_with_rows)
    dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
      const T* in = static_cast<const T*>(input.raw_data());
      const T* gy = static_cast<const T*>(grad.raw_data());
      parallel_for(blocks * ranges, compute_threads(), [&](int64_t begin, int64_t end, int) {
        for (int64_t unit = begin; unit < end; ++unit) {
          const int64_t block = unit % blocks, range = unit / blocks;
          const int64_t lo = block * kColumns, hi = std::min(g.length, lo + kColumns);
          const int64_t first = range * kPlanes, last = std::min(g.planes(), first + kPlanes);
          double* part_db = partial.data() + 2 * range * g.length;
          double* part_dw = part_db + g.length;
          for (int64_t plane = first; plane < last; ++plane) {
            const double mean = s[4 * plane], rstd = s[4 * plane + 1];  // slot = plane
            const T* p = in + plane * g.length;
            const T* d = gy + plane * g.length;
            for (int64_t i = lo; i < hi; ++i) {
              const double value = widen(d[i]);
              part_db[i] += value;
              part_dw[i] += value * ((widen(p[i]) - mean) * rstd);
            }
          }
        }
      });
    });
  for (int64_t range = 0; range < ranges; ++range) {
    const double* part_db = partial.data() + 2 * range * g.length;
    const double* part_dw = part_db + g.length;
    for (int64_t i = 0; i < g.length; ++i) {
      db[i] += part_db[i];
      dw[i] += part_dw[i];
    }
  }
  if (want_dw) grads.dw = tensor_of(dw, {g.length}, x.dtype());
  if (want_db) grads.db = tensor_of(db, {g.length}, x.dtype());
  return sums;
}

std::optional<Tensor> norm_backward_rows_cpu(const NormGeometry& g, const Tensor& x,
                                             const Tensor& dy, const Tensor& statistics,
                                             const std::optional<Tensor>& w, bool want_dw,
                                             bool want_db, NormParamGrads& grads) {
  if (x.is_shape_only() || dy.is_shape_only() || statistics.is_shape_only() ||
      !one_unit_per_slot(g))
    return std::nullopt;
  check_piece(g, x);
  TESSERA_CHECK_ARG(dy.shape() == x.shape() && dy.dtype() == x.dtype(), op_name(g),
                    "backward got the gradient {} for x {}", dy.str(), x.str());
  const Tensor input = x.contiguous(), grad = dy.contiguous();
  const Tensor stats = statistics.contiguous();
  const std::vector<double> weight = w ? values_of(*w) : std::vector<double>{};
  const double* s = stats.data<double>();
  // As norm_backward_sums_cpu's rows: ranges of kPlanes rows sum their columns into their own
  // partial row, the partial rows added in range order afterwards.
  constexpr int64_t kPlanes = 2048;
  const int64_t length = g.length;
  const bool want_columns = want_dw || want_db;
  const int64_t ranges = std::max<int64_t>(1, (g.planes() + kPlanes - 1) / kPlanes);
  std::vector<double> partial(want_columns ? static_cast<size_t>(2 * ranges * length) : 0, 0.0);
  Tensor dx = Tensor::empty(input.shape(), input.dtype());
  dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    const T* gy = static_cast<const T*>(grad.raw_data());
    T* out = static_cast<T*>(dx.raw_data());
    const std::vector<C> w_c = as_compute<C>(weight);
    const double* wp = w ? weight.data() : nullptr;
    const C* wcp = w ? w_c.data() : nullptr;
    double* part = partial.data();
    parallel_ranges(
        g.planes(),
        [&](int64_t first, int64_t last) TESSERA_LOOP_BODY {
          for (int64_t row = first; row < last; ++row) {
            const T* p = in + row * length;
            const T* d = gy + row * length;
            const double mean = s[4 * row], rstd = s[4 * row + 1], count = s[4 * row + 2];
            double sum_dxhat = 0, sum_dxhat_xhat = 0;
            chunk_sums<T>(p, d, wp, length, mean, rstd, sum_dxhat, sum_dxhat_xhat);
            if (want_columns) {
              double* part_db = part + 2 * (row / kPlanes) * length;
              double* part_dw = part_db + length;
              for (int64_t i = 0; i < length; ++i) {
                const double value = widen(d[i]);
                part_db[i] += value;
                part_dw[i] += value * ((widen(p[i]) - mean) * rstd);
              }
            }
            chunk_dx<T, C>(p, d, out + row * length, length, static_cast<C>(mean),
                           static_cast<C>(rstd), C(1), wcp, static_cast<C>(sum_dxhat / count),
                           static_cast<C>(sum_dxhat_xhat / count));
          }
        },
        kPlanes);
  });
  if (want_columns) {
    std::vector<double> dw(static_cast<size_t>(length), 0.0), db(dw.size(), 0.0);
    for (int64_t range = 0; range < ranges; ++range) {
      const double* part_db = partial.data() + 2 * range * length;
      const double* part_dw = part_db + length;
      for (int64_t i = 0; i < length; ++i) {
        db[i] += part_db[i];
        dw[i] += part_dw[i];
      }
    }
    if (want_dw) grads.dw = tensor_of(dw, {length}, x.dtype());
    if (want_db) grads.db = tensor_of(db, {length}, x.dtype());
  }
  return dx;
}

Tensor norm_sum_ranks_cpu(const Tensor& gathered) {
  if (gathered.is_shape_only()) return Tensor::empty({gathered.shape()[1], 2}, DType::f64);
  const Tensor source = gathered.contiguous();
  const int64_t ranks = source.shape()[0], slots = source.shape()[1];
  const double* in = source.data<double>();
  Tensor sums = Tensor::zeros({slots, 2}, DType::f64);
  double* out = sums.data<double>();
  for (int64_t r = 0; r < ranks; ++r)
    for (int64_t i = 0; i < 2 * slots; ++i) out[i] += in[r * 2 * slots + i];
  return sums;
}

Tensor norm_backward_dx_cpu(const NormGeometry& g, const Tensor& x, const Tensor& dy,
                            const Tensor& statistics, const std::optional<Tensor>& sums,
                            const std::optional<Tensor>& w) {
  if (x.is_shape_only() || dy.is_shape_only() || statistics.is_shape_only()) {
    check_piece(g, x);
    return Tensor::empty(x.shape(), x.dtype());
  }
  check_piece(g, x);
  const Tensor input = x.contiguous(), grad = dy.contiguous();
  const Tensor stats = statistics.contiguous();
  const std::optional<Tensor> total =
      sums ? std::optional<Tensor>(sums->contiguous()) : std::nullopt;
  const std::vector<double> weight = w ? values_of(*w) : std::vector<double>{};
  const double* s = stats.data<double>();
  Tensor dx = Tensor::empty(input.shape(), input.dtype());
  dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    const T* gy = static_cast<const T*>(grad.raw_data());
    T* out = static_cast<T*>(dx.raw_data());
    const ChunkKernels<T, C> kernels = chunk_kernels<T, C>();
    const std::vector<C> w_c = as_compute<C>(weight);
    if (one_unit_per_slot(g)) {
      const C* wp = w ? w_c.data() : nullptr;
      const double* t = total ? total->data<double>() : nullptr;
      const int64_t length = g.length;
      for_row_blocks(g, [&](int64_t first, int64_t last) TESSERA_LOOP_BODY {
        for (int64_t row = first; row < last; ++row) {
          const C mean = static_cast<C>(s[4 * row]), rstd = static_cast<C>(s[4 * row + 1]);
          C mean_dxhat = 0, mean_dxhat_xhat = 0;
          if (t) {
            const double count = s[4 * row + 2];
            mean_dxhat = static_cast<C>(t[2 * row] / count);
            mean_dxhat_xhat = static_cast<C>(t[2 * row + 1] / count);
          }
          chunk_dx<T, C>(in + row * length, gy + row * length, out + row * length, length, mean,
                         rstd, C(1), wp, mean_dxhat, mean_dxhat_xhat);
        }
      });
      return;
    }
    for_units(g, [&](int64_t, int64_t plane, int64_t lo, int64_t hi) {
      const int64_t slot = g.slot_of(plane);
      const C mean = static_cast<C>(s[4 * slot]), rstd = static_cast<C>(s[4 * slot + 1]);
      C mean_dxhat = 0, mean_dxhat_xhat = 0;
      if (total) {
        const double count = s[4 * slot + 2];
        const double* t = total->data<double>() + 2 * slot;
        mean_dxhat = static_cast<C>(t[0] / count);
        mean_dxhat_xhat = static_cast<C>(t[1] / count);
      }
      const T* p = in + plane * g.length + lo;
      const T* d = gy + plane * g.length + lo;
      T* q = out + plane * g.length + lo;
      if (!g.per_element_affine) {
        const C scale = w ? w_c[g.channel_of(plane)] : C(1);
        kernels.dx(p, d, q, hi - lo, mean, rstd, scale, nullptr, mean_dxhat, mean_dxhat_xhat);
      } else {
        kernels.dx(p, d, q, hi - lo, mean, rstd, C(1), w ? w_c.data() + lo : nullptr, mean_dxhat,
                   mean_dxhat_xhat);
      }
    });
  });
  return dx;
}

}  // namespace tessera::ops
