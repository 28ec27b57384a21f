// The cpu kernels of the normalizations (norm_kernels.hpp). The piece is cut into units of one
// plane's chunk of at most kChunk elements; threads take units, every unit's partial results go
// to its own slot of a buffer, and the units are combined afterwards in plane order, so the
// results are the same for any thread count. Sums use eight independent lanes (which the
// compiler vectorizes) in f64.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/parallel_for.hpp"
#include "ops/norm/norm_kernels.hpp"

namespace tessera::ops {

namespace {

using kernels::NormGeometry;

/// Elements per unit of work.
constexpr int64_t kChunk = 8192;
/// Independent accumulators of a sum.
constexpr int kLanes = 8;

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
inline double widen(T value) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>)
    return static_cast<double>(value);
  else
    return static_cast<double>(static_cast<float>(value));
}

/// Chunks per plane (0 for empty planes).
int64_t chunks_of(const NormGeometry& g) {
  return g.length > 0 ? (g.length + kChunk - 1) / kChunk : 0;
}

/// The sum of the lanes in a fixed order.
inline double fold(const double* lanes) {
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/// Sum of f(i) over [0, count) in eight lanes.
template <typename F>
inline double lane_sum(int64_t count, F&& f) {
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += f(i + l);
  double tail = 0;
  for (; i < count; ++i) tail += f(i);
  return fold(lanes) + tail;
}

/// Two sums of (f(i), g(i)) over [0, count) in eight lanes each.
template <typename F>
inline void lane_sum2(int64_t count, F&& f, double& first, double& second) {
  double a[kLanes] = {}, b[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      double u, v;
      f(i + l, u, v);
      a[l] += u;
      b[l] += v;
    }
  double ta = 0, tb = 0;
  for (; i < count; ++i) {
    double u, v;
    f(i, u, v);
    ta += u;
    tb += v;
  }
  first = fold(a) + ta;
  second = fold(b) + tb;
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
  check_arg(x.device().is_cpu(), op_name(g), "cpu kernel got a {} tensor", x.str());
  check_arg(x.numel() == g.numel(), op_name(g), "piece {} does not hold {} x {} x {} elements",
            x.str(), g.batch, g.channels, g.length);
}

}  // namespace

Tensor norm_moments_cpu(const NormGeometry& g, const Tensor& x) {
  check_piece(g, x);
  const Tensor input = x.contiguous();
  const int64_t chunks = chunks_of(g);
  std::vector<double> units(static_cast<size_t>(3 * g.planes() * chunks));
  dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
    const T* data = static_cast<const T*>(input.raw_data());
    for_units(g, [&](int64_t u, int64_t plane, int64_t lo, int64_t hi) {
      const T* p = data + plane * g.length + lo;
      const int64_t count = hi - lo;
      const double mean = lane_sum(count, [&](int64_t i) { return widen(p[i]); }) / count;
      const double m2 = lane_sum(count, [&](int64_t i) {
        const double d = widen(p[i]) - mean;
        return d * d;
      });
      units[3 * u] = static_cast<double>(count);
      units[3 * u + 1] = mean;
      units[3 * u + 2] = m2;
    });
  });
  Tensor moments = Tensor::zeros({g.slots, 3}, DType::f64);
  double* out = moments.data<double>();
  parallel_for(g.slots, compute_threads(), [&](int64_t begin, int64_t end, int) {
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
  const Tensor source = gathered.contiguous();
  const int64_t ranks = source.shape()[0], slots = source.shape()[1];
  const double* in = source.data<double>();
  Tensor statistics = Tensor::empty({slots, 4}, DType::f64);
  double* out = statistics.data<double>();
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
    for_units(g, [&](int64_t, int64_t plane, int64_t lo, int64_t hi) {
      const int64_t slot = g.slot_of(plane);
      const C mean = static_cast<C>(s[4 * slot]), rstd = static_cast<C>(s[4 * slot + 1]);
      const T* p = in + plane * g.length;
      T* q = out + plane * g.length;
      if (!g.per_element_affine) {
        const int64_t c = g.channel_of(plane);
        const C scale = rstd * (w ? static_cast<C>(weight[c]) : C(1));
        const C shift = b ? static_cast<C>(bias[c]) : C(0);
        for (int64_t i = lo; i < hi; ++i) q[i] = T((static_cast<C>(p[i]) - mean) * scale + shift);
      } else {
        for (int64_t i = lo; i < hi; ++i) {
          C value = (static_cast<C>(p[i]) - mean) * rstd;
          if (w) value *= static_cast<C>(weight[i]);
          if (b) value += static_cast<C>(bias[i]);
          q[i] = T(value);
        }
      }
    });
  });
  return y;
}

Tensor norm_backward_sums_cpu(const NormGeometry& g, const Tensor& x, const Tensor& dy,
                              const Tensor& statistics, const std::optional<Tensor>& w,
                              bool want_dw, bool want_db, NormParamGrads& grads) {
  check_piece(g, x);
  check_arg(dy.shape() == x.shape() && dy.dtype() == x.dtype(), op_name(g),
            "backward got the gradient {} for x {}", dy.str(), x.str());
  const Tensor input = x.contiguous(), grad = dy.contiguous();
  const Tensor stats = statistics.contiguous();
  const std::vector<double> weight = w ? values_of(*w) : std::vector<double>{};
  const double* s = stats.data<double>();
  const int64_t chunks = chunks_of(g);
  // Per unit: (sum dy, sum dy * xhat) with a per-plane affine, (sum dxhat, sum dxhat * xhat)
  // with a per-element one.
  std::vector<double> units(static_cast<size_t>(2 * g.planes() * chunks));
  dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    const T* gy = static_cast<const T*>(grad.raw_data());
    for_units(g, [&](int64_t u, int64_t plane, int64_t lo, int64_t hi) {
      const int64_t slot = g.slot_of(plane);
      const double mean = s[4 * slot], rstd = s[4 * slot + 1];
      const T* p = in + plane * g.length + lo;
      const T* d = gy + plane * g.length + lo;
      if (!g.per_element_affine || !w) {
        lane_sum2(
            hi - lo,
            [&](int64_t i, double& a, double& b) {
              a = widen(d[i]);
              b = a * ((widen(p[i]) - mean) * rstd);
            },
            units[2 * u], units[2 * u + 1]);
      } else {
        const double* wp = weight.data() + lo;
        lane_sum2(
            hi - lo,
            [&](int64_t i, double& a, double& b) {
              a = widen(d[i]) * wp[i];
              b = a * ((widen(p[i]) - mean) * rstd);
            },
            units[2 * u], units[2 * u + 1]);
      }
    });
  });
  // Slot sums over the slot's planes and chunks in order.
  Tensor sums = Tensor::zeros({g.slots, 2}, DType::f64);
  double* out = sums.data<double>();
  const bool scaled = !g.per_element_affine && w;
  parallel_for(g.slots, compute_threads(), [&](int64_t begin, int64_t end, int) {
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
  // layer_norm: column sums over the planes (rows) in order, threads over blocks of columns.
  std::vector<double> dw(static_cast<size_t>(g.length), 0.0), db(dw.size(), 0.0);
  constexpr int64_t kColumns = 256;
  dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    const T* gy = static_cast<const T*>(grad.raw_data());
    const int64_t blocks = (g.length + kColumns - 1) / kColumns;
    parallel_for(blocks, compute_threads(), [&](int64_t begin, int64_t end, int) {
      for (int64_t block = begin; block < end; ++block) {
        const int64_t lo = block * kColumns, hi = std::min(g.length, lo + kColumns);
        for (int64_t plane = 0; plane < g.planes(); ++plane) {
          const double mean = s[4 * plane], rstd = s[4 * plane + 1];  // slot = plane
          const T* p = in + plane * g.length;
          const T* d = gy + plane * g.length;
          for (int64_t i = lo; i < hi; ++i) {
            const double value = widen(d[i]);
            db[i] += value;
            dw[i] += value * ((widen(p[i]) - mean) * rstd);
          }
        }
      }
    });
  });
  if (want_dw) grads.dw = tensor_of(dw, {g.length}, x.dtype());
  if (want_db) grads.db = tensor_of(db, {g.length}, x.dtype());
  return sums;
}

Tensor norm_sum_ranks_cpu(const Tensor& gathered) {
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
  check_piece(g, x);
  const Tensor input = x.contiguous(), grad = dy.contiguous();
  const Tensor stats = statistics.contiguous();
  const std::optional<Tensor> total = sums ? std::optional<Tensor>(sums->contiguous()) : std::nullopt;
  const std::vector<double> weight = w ? values_of(*w) : std::vector<double>{};
  const double* s = stats.data<double>();
  Tensor dx = Tensor::empty(input.shape(), input.dtype());
  dispatch_norm(input.dtype(), op_name(g), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    const T* gy = static_cast<const T*>(grad.raw_data());
    T* out = static_cast<T*>(dx.raw_data());
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
      const T* p = in + plane * g.length;
      const T* d = gy + plane * g.length;
      T* q = out + plane * g.length;
      if (!g.per_element_affine) {
        const C scale = w ? static_cast<C>(weight[g.channel_of(plane)]) : C(1);
        for (int64_t i = lo; i < hi; ++i) {
          const C xhat = (static_cast<C>(p[i]) - mean) * rstd;
          q[i] = T(rstd * (static_cast<C>(d[i]) * scale - mean_dxhat - xhat * mean_dxhat_xhat));
        }
      } else {
        for (int64_t i = lo; i < hi; ++i) {
          const C xhat = (static_cast<C>(p[i]) - mean) * rstd;
          const C dxhat = w ? static_cast<C>(d[i]) * static_cast<C>(weight[i]) : static_cast<C>(d[i]);
          q[i] = T(rstd * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat));
        }
      }
    });
  });
  return dx;
}

}  // namespace tessera::ops
