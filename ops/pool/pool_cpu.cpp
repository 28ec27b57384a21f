// The cpu pooling kernels (pool_cpu.hpp): the real cells of every window are found once per
// spatial dim and output index, then each thread walks its planes' outputs.
#include "ops/pool/pool_cpu.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/parallel_for.hpp"

namespace tessera::ops {

namespace {

using kernels::PoolDim;
using kernels::PoolKind;
using kernels::PoolRange;
using kernels::PoolWindows;

/// The window ranges of every output index along each of the three dims.
std::array<std::vector<PoolRange>, 3> ranges_of(const PoolWindows& windows) {
  std::array<std::vector<PoolRange>, 3> ranges;
  for (int d = 0; d < 3; ++d)
    for (int64_t j = 0; j < windows.dims[d].out; ++j)
      ranges[d].push_back(kernels::pool_range(windows.dims[d], j));
  return ranges;
}

/// Calls fn.template operator()<T, Compute>() for the floating dtypes.
template <typename Fn>
void dispatch_pool(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DType::f32: fn.template operator()<float, float>(); return;
    case DType::f64: fn.template operator()<double, double>(); return;
    case DType::f16: fn.template operator()<Half, float>(); return;
    case DType::bf16: fn.template operator()<BFloat16, float>(); return;
    default: break;
  }
  throw InvalidArgument(op,
                        fmt::format("pooling needs a floating tensor, got {}", dtype_name(dtype)));
}

const char* op_name(const PoolWindows& windows) {
  return windows.kind == PoolKind::max ? "max_pool" : "avg_pool";
}

/// Walks every output of one plane: visit(output index, r0, r1, r2, window start (3 dims)).
template <typename Visit>
void for_each_window(const PoolWindows& windows,
                     const std::array<std::vector<PoolRange>, 3>& ranges, Visit&& visit) {
  const PoolDim* dims = windows.dims;
  int64_t o = 0;
  for (int64_t j0 = 0; j0 < dims[0].out; ++j0) {
    const int64_t s0 = dims[0].first + j0 * dims[0].stride;
    for (int64_t j1 = 0; j1 < dims[1].out; ++j1) {
      const int64_t s1 = dims[1].first + j1 * dims[1].stride;
      for (int64_t j2 = 0; j2 < dims[2].out; ++j2, ++o) {
        const int64_t s2 = dims[2].first + j2 * dims[2].stride;
        visit(o, ranges[0][j0], ranges[1][j1], ranges[2][j2], s0, s1, s2);
      }
    }
  }
}

/// Whether a window holds no real cell.
bool empty_window(const PoolRange& r0, const PoolRange& r1, const PoolRange& r2) {
  return r0.hi <= r0.lo || r1.hi <= r1.lo || r2.hi <= r2.lo;
}

/// The input index of the first real cell of a window (PyTorch's argmax when every real cell is
/// -inf), or -1 when the window holds no real cell.
int64_t first_real_cell(const PoolWindows& windows, const PoolRange& r0, const PoolRange& r1,
                        const PoolRange& r2, int64_t s0, int64_t s1, int64_t s2) {
  if (empty_window(r0, r1, r2)) return -1;
  const PoolDim* dims = windows.dims;
  return ((s0 + r0.lo * dims[0].dilation) * dims[1].in + s1 + r1.lo * dims[1].dilation) *
             dims[2].in +
         s2 + r2.lo * dims[2].dilation;
}

/// The input index of the maximum of a window (first maximum in window order, the last NaN when
/// there is one, the first real cell when all are -inf), or -1 when the window holds no real cell.
template <typename T, typename C>
int64_t window_argmax(const PoolWindows& windows, const T* plane, const PoolRange& r0,
                      const PoolRange& r1, const PoolRange& r2, int64_t s0, int64_t s1,
                      int64_t s2) {
  const PoolDim* dims = windows.dims;
  C best = -std::numeric_limits<C>::infinity();
  int64_t arg = first_real_cell(windows, r0, r1, r2, s0, s1, s2);
  for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0) {
    const int64_t i0 = s0 + t0 * dims[0].dilation;
    for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
      const int64_t row = (i0 * dims[1].in + s1 + t1 * dims[1].dilation) * dims[2].in + s2;
      for (int64_t t2 = r2.lo; t2 < r2.hi; ++t2) {
        const int64_t index = row + t2 * dims[2].dilation;
        const C value = static_cast<C>(plane[index]);
        if (value > best || value != value) {
          best = value;
          arg = index;
        }
      }
    }
  }
  return arg;
}

/// window_argmax given the window's maximum `y` (the forward's output): the first cell equal to
/// it (the forward keeps the first of equal maxima), or the last NaN when y is NaN.
template <typename T, typename C>
int64_t window_argmax_of(const PoolWindows& windows, const T* plane, C y, const PoolRange& r0,
                         const PoolRange& r1, const PoolRange& r2, int64_t s0, int64_t s1,
                         int64_t s2) {
  if (y != y) return window_argmax<T, C>(windows, plane, r0, r1, r2, s0, s1, s2);
  const PoolDim* dims = windows.dims;
  for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0) {
    const int64_t i0 = s0 + t0 * dims[0].dilation;
    for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
      const int64_t row = (i0 * dims[1].in + s1 + t1 * dims[1].dilation) * dims[2].in + s2;
      for (int64_t t2 = r2.lo; t2 < r2.hi; ++t2)
        if (static_cast<C>(plane[row + t2 * dims[2].dilation]) == y)
          return row + t2 * dims[2].dilation;
    }
  }
  return -1;
}

/// avg's divisor of a window with real cells r0 x r1 x r2.
double avg_divisor(const PoolWindows& windows, const PoolRange& r0, const PoolRange& r1,
                   const PoolRange& r2) {
  if (windows.divisor_override != 0) return static_cast<double>(windows.divisor_override);
  if (windows.count_include_pad) return static_cast<double>(r0.padded * r1.padded * r2.padded);
  return static_cast<double>((r0.hi - r0.lo) * (r1.hi - r1.lo) * (r2.hi - r2.lo));
}

/// The outputs [lo, hi) along the innermost dim whose windows are whole there (every kernel cell
/// real, no padding): the first such run, empty when there is none. avg runs them as vector loops
/// along that dim, as they share one divisor and one pattern of cells.
struct FullRun {
  int64_t lo = 0, hi = 0;
};

FullRun full_run(const PoolDim& dim, const std::vector<PoolRange>& ranges) {
  const auto full = [&](const PoolRange& r) {
    return r.lo == 0 && r.hi == dim.kernel && r.padded == dim.kernel;
  };
  const int64_t count = static_cast<int64_t>(ranges.size());
  FullRun run;
  while (run.lo < count && !full(ranges[run.lo])) ++run.lo;
  run.hi = run.lo;
  while (run.hi < count && full(ranges[run.hi])) ++run.hi;
  return run;
}

/// avg's output of one window (cells summed in window order in C, then divided).
template <typename T, typename C>
T avg_window(const PoolWindows& windows, const T* plane, const PoolRange& r0, const PoolRange& r1,
             const PoolRange& r2, int64_t s0, int64_t s1, int64_t s2) {
  if (empty_window(r0, r1, r2)) return T(C(0));
  C sum = 0;
  for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0)
    for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
      const T* row = plane + ((s0 + t0) * windows.dims[1].in + s1 + t1) * windows.dims[2].in + s2;
      for (int64_t t2 = r2.lo; t2 < r2.hi; ++t2) sum += static_cast<C>(row[t2]);
    }
  return T(sum / static_cast<C>(avg_divisor(windows, r0, r1, r2)));
}

/// avg pooling of one plane. Outputs of the full run are summed side by side in `sums` (at least
/// dims[2].out values), each in the same order as avg_window's (so the results are the same).
template <typename T, typename C>
void avg_plane_forward(const PoolWindows& windows,
                       const std::array<std::vector<PoolRange>, 3>& ranges, const FullRun& run,
                       const T* plane, T* target, C* __restrict sums) {
  const PoolDim* dims = windows.dims;
  const int64_t stride = dims[2].stride, width = run.hi - run.lo;
  for (int64_t j0 = 0; j0 < dims[0].out; ++j0) {
    const int64_t s0 = dims[0].first + j0 * dims[0].stride;
    const PoolRange& r0 = ranges[0][j0];
    for (int64_t j1 = 0; j1 < dims[1].out; ++j1) {
      const int64_t s1 = dims[1].first + j1 * dims[1].stride;
      const PoolRange& r1 = ranges[1][j1];
      T* out = target + (j0 * dims[1].out + j1) * dims[2].out;
      const bool vector = width > 0 && r0.hi > r0.lo && r1.hi > r1.lo;
      for (int64_t j2 = 0; j2 < dims[2].out; ++j2) {
        if (vector && j2 == run.lo) j2 = run.hi;
        if (j2 == dims[2].out) break;
        out[j2] = avg_window<T, C>(windows, plane, r0, r1, ranges[2][j2], s0, s1,
                                   dims[2].first + j2 * stride);
      }
      if (!vector) continue;
      for (int64_t j = 0; j < width; ++j) sums[j] = 0;
      for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0)
        for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
          const T* row = plane + ((s0 + t0) * dims[1].in + s1 + t1) * dims[2].in + dims[2].first +
                         run.lo * stride;
          for (int64_t t2 = 0; t2 < dims[2].kernel; ++t2) {
            const T* cells = row + t2;
            if (stride == 1)
              for (int64_t j = 0; j < width; ++j) sums[j] += static_cast<C>(cells[j]);
            else
              for (int64_t j = 0; j < width; ++j) sums[j] += static_cast<C>(cells[j * stride]);
          }
        }
      const C divisor = static_cast<C>(avg_divisor(windows, r0, r1, ranges[2][run.lo]));
      for (int64_t j = 0; j < width; ++j) out[run.lo + j] = T(sums[j] / divisor);
    }
  }
}

/// avg's backward of one plane into acc: each output's share gy / divisor added to its window's
/// real cells; the full run's shares are added side by side (a cell's shares in another order
/// than output order: within rounding of it).
template <typename T, typename C>
void avg_plane_backward(const PoolWindows& windows,
                        const std::array<std::vector<PoolRange>, 3>& ranges, const FullRun& run,
                        const T* g_plane, C* __restrict acc, C* __restrict shares) {
  const PoolDim* dims = windows.dims;
  const int64_t stride = dims[2].stride, width = run.hi - run.lo;
  for (int64_t j0 = 0; j0 < dims[0].out; ++j0) {
    const int64_t s0 = dims[0].first + j0 * dims[0].stride;
    const PoolRange& r0 = ranges[0][j0];
    for (int64_t j1 = 0; j1 < dims[1].out; ++j1) {
      const int64_t s1 = dims[1].first + j1 * dims[1].stride;
      const PoolRange& r1 = ranges[1][j1];
      const T* g = g_plane + (j0 * dims[1].out + j1) * dims[2].out;
      const bool vector = width > 0 && r0.hi > r0.lo && r1.hi > r1.lo;
      for (int64_t j2 = 0; j2 < dims[2].out; ++j2) {
        if (vector && j2 == run.lo) j2 = run.hi;
        if (j2 == dims[2].out) break;
        const PoolRange& r2 = ranges[2][j2];
        if (empty_window(r0, r1, r2)) continue;
        const int64_t s2 = dims[2].first + j2 * stride;
        const C share = static_cast<C>(g[j2]) / static_cast<C>(avg_divisor(windows, r0, r1, r2));
        for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0)
          for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
            C* row = acc + ((s0 + t0) * dims[1].in + s1 + t1) * dims[2].in + s2;
            for (int64_t t2 = r2.lo; t2 < r2.hi; ++t2) row[t2] += share;
          }
      }
      if (!vector) continue;
      const C divisor = static_cast<C>(avg_divisor(windows, r0, r1, ranges[2][run.lo]));
      for (int64_t j = 0; j < width; ++j) shares[j] = static_cast<C>(g[run.lo + j]) / divisor;
      for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0)
        for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
          C* row = acc + ((s0 + t0) * dims[1].in + s1 + t1) * dims[2].in + dims[2].first +
                   run.lo * stride;
          for (int64_t t2 = 0; t2 < dims[2].kernel; ++t2) {
            C* cells = row + t2;
            if (stride == 1)
              for (int64_t j = 0; j < width; ++j) cells[j] += shares[j];
            else
              for (int64_t j = 0; j < width; ++j) cells[j * stride] += shares[j];
          }
        }
    }
  }
}

}  // namespace

Tensor pool_forward_cpu(const PoolWindows& windows, const Tensor& x, const Shape& y_shape) {
  check_arg(x.device().is_cpu(), op_name(windows), "cpu kernel got a {} tensor", x.str());
  const Tensor input = x.contiguous();
  Tensor y = Tensor::empty(y_shape, input.dtype());
  const int64_t in_plane = windows.in_plane(), out_plane = windows.out_plane();
  if (y.numel() == 0) return y;
  const auto ranges = ranges_of(windows);
  dispatch_pool(input.dtype(), op_name(windows), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    T* out = static_cast<T*>(y.raw_data());
    const FullRun run = full_run(windows.dims[2], ranges[2]);
    parallel_for(windows.planes, compute_threads(), [&](int64_t begin, int64_t end, int) {
      std::vector<C> sums(static_cast<size_t>(windows.kind == PoolKind::avg ? run.hi - run.lo : 0));
      for (int64_t p = begin; p < end; ++p) {
        const T* plane = in + p * in_plane;
        T* target = out + p * out_plane;
        if (windows.kind == PoolKind::max) {
          for_each_window(
              windows, ranges,
              [&](int64_t o, const PoolRange& r0, const PoolRange& r1, const PoolRange& r2,
                  int64_t s0, int64_t s1, int64_t s2) {
                const int64_t arg = window_argmax<T, C>(windows, plane, r0, r1, r2, s0, s1, s2);
                target[o] = arg < 0 ? T(-std::numeric_limits<C>::infinity()) : plane[arg];
              });
        } else {
          avg_plane_forward<T, C>(windows, ranges, run, plane, target, sums.data());
        }
      }
    });
  });
  return y;
}

Tensor pool_backward_cpu(const PoolWindows& windows, const Tensor& x, const Tensor& y,
                         const Tensor& gy) {
  check_arg(x.device().is_cpu() && gy.device().is_cpu() && gy.dtype() == x.dtype(),
            op_name(windows), "cpu kernel got {} and {}", x.str(), gy.str());
  const Tensor input = x.contiguous(), grad = gy.contiguous();
  const Tensor output = y.contiguous();
  if (windows.kind == PoolKind::max)
    check_arg(output.shape() == grad.shape() && output.dtype() == input.dtype(), op_name(windows),
              "backward got the output {} for the gradient {}", output.str(), grad.str());
  // Every plane of dx is written whole below (zeroed, then the gradient added), so it starts
  // uninitialised; with no gradient at all it is zeros.
  Tensor dx = Tensor::empty(input.shape(), input.dtype());
  const int64_t in_plane = windows.in_plane(), out_plane = windows.out_plane();
  if (grad.numel() == 0 || dx.numel() == 0) {
    dx.fill(0.0);
    return dx;
  }
  const auto ranges = ranges_of(windows);
  const FullRun run = full_run(windows.dims[2], ranges[2]);
  dispatch_pool(input.dtype(), op_name(windows), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    const T* g = static_cast<const T*>(grad.raw_data());
    T* out = static_cast<T*>(dx.raw_data());
    // Accumulated in the computation type one plane at a time: in dx's own plane when that is
    // the computation type (f32, f64), else in a buffer rounded once at the end (f16, bf16).
    constexpr bool in_place = std::is_same_v<T, C>;
    parallel_for(windows.planes, compute_threads(), [&](int64_t begin, int64_t end, int) {
      std::vector<C> buffer(in_place ? 0 : static_cast<size_t>(in_plane));
      std::vector<C> shares(
          static_cast<size_t>(windows.kind == PoolKind::avg ? run.hi - run.lo : 0));
      for (int64_t p = begin; p < end; ++p) {
        T* target = out + p * in_plane;
        C* acc = nullptr;
        if constexpr (in_place)
          acc = target;
        else
          acc = buffer.data();
        std::fill(acc, acc + in_plane, C(0));
        const T* plane = in + p * in_plane;
        const T* g_plane = g + p * out_plane;
        if (windows.kind == PoolKind::max) {
          const T* y_plane = static_cast<const T*>(output.raw_data()) + p * out_plane;
          for_each_window(windows, ranges,
                          [&](int64_t o, const PoolRange& r0, const PoolRange& r1,
                              const PoolRange& r2, int64_t s0, int64_t s1, int64_t s2) {
                            const int64_t arg = window_argmax_of<T, C>(
                                windows, plane, static_cast<C>(y_plane[o]), r0, r1, r2, s0, s1, s2);
                            if (arg >= 0) acc[arg] += static_cast<C>(g_plane[o]);
                          });
        } else {
          avg_plane_backward<T, C>(windows, ranges, run, g_plane, acc, shares.data());
        }
        if constexpr (!in_place)
          for (int64_t i = 0; i < in_plane; ++i) target[i] = T(acc[i]);
      }
    });
  });
  return dx;
}

}  // namespace tessera::ops
