// The cpu pooling kernels (pool_cpu.hpp): the real cells of every window are found once per
// spatial dim and output index, then each thread walks its planes' outputs.
#include "ops/pool/pool_cpu.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <optional>
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

/// Whether a window holds no real cell.
bool empty_window(const PoolRange& r0, const PoolRange& r1, const PoolRange& r2) {
  return r0.hi <= r0.lo || r1.hi <= r1.lo || r2.hi <= r2.lo;
}

/// A window's maximum: its local input index in the plane and pool_global_index's, or -1 for
/// both when the window holds no real cell.
struct PoolArgmax {
  int64_t local = -1, global = -1;
};

/// The maximum of a window: the first maximum in window order, the last NaN when there is one,
/// the first real cell when all are -inf (as PyTorch's).
template <typename T, typename C>
PoolArgmax window_argmax(const PoolWindows& windows, const T* plane, const PoolRange& r0,
                         const PoolRange& r1, const PoolRange& r2, int64_t s0, int64_t s1,
                         int64_t s2) {
  if (empty_window(r0, r1, r2)) return {};
  const PoolDim* dims = windows.dims;
  C best = -std::numeric_limits<C>::infinity();
  int64_t b0 = r0.lo, b1 = r1.lo, b2 = r2.lo;  // the kernel cell of the maximum
  for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0) {
    const int64_t i0 = s0 + t0 * dims[0].dilation;
    for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
      const T* row = plane + (i0 * dims[1].in + s1 + t1 * dims[1].dilation) * dims[2].in + s2;
      for (int64_t t2 = r2.lo; t2 < r2.hi; ++t2) {
        const C value = static_cast<C>(row[t2 * dims[2].dilation]);
        if (value > best || value != value) {
          best = value;
          b0 = t0;
          b1 = t1;
          b2 = t2;
        }
      }
    }
  }
  const int64_t i0 = s0 + b0 * dims[0].dilation, i1 = s1 + b1 * dims[1].dilation,
                i2 = s2 + b2 * dims[2].dilation;
  return {(i0 * dims[1].in + i1) * dims[2].in + i2,
          kernels::pool_global_index(windows, i0, i1, i2)};
}

/// Turns max_pool's global indices (pool_global_index) into local input indices of the plane:
/// by one subtraction when the piece holds whole rows and columns of the global planes (shards
/// of the first spatial dim only), else by splitting the index into its coordinates.
class LocalIndex {
 public:
  explicit LocalIndex(const PoolWindows& windows) : dims_(windows.dims) {
    whole_ = dims_[1].global_lo == 0 && dims_[1].in == dims_[1].global_in &&
             dims_[2].global_lo == 0 && dims_[2].in == dims_[2].global_in;
    base_ = dims_[0].global_lo * dims_[1].in * dims_[2].in;
  }

  int64_t operator()(int64_t global) const {
    if (whole_) return global - base_;
    const int64_t i2 = global % dims_[2].global_in, rest = global / dims_[2].global_in;
    const int64_t i1 = rest % dims_[1].global_in, i0 = rest / dims_[1].global_in;
    return ((i0 - dims_[0].global_lo) * dims_[1].in + i1 - dims_[1].global_lo) * dims_[2].in + i2 -
           dims_[2].global_lo;
  }

 private:
  const PoolDim* dims_;
  bool whole_ = false;
  int64_t base_ = 0;
};

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

/// Calls row(r0, r1, s0, s1, start) for every row (j0, j1) of a plane's outputs: the window
/// ranges and starts on the two outer dims, and the flat index of the row's first output.
template <typename Row>
void for_each_output_row(const PoolWindows& windows,
                         const std::array<std::vector<PoolRange>, 3>& ranges, Row&& row) {
  const PoolDim* dims = windows.dims;
  for (int64_t j0 = 0; j0 < dims[0].out; ++j0)
    for (int64_t j1 = 0; j1 < dims[1].out; ++j1)
      row(ranges[0][j0], ranges[1][j1], dims[0].first + j0 * dims[0].stride,
          dims[1].first + j1 * dims[1].stride, (j0 * dims[1].out + j1) * dims[2].out);
}

/// The kernel cells of max windows as offsets from the window's start: cell code
/// c = (t0 * K1 + t1) * K2 + t2 (window order) lies `local[c]` cells into the plane from the start
/// and `global[c]` cells into the global plane (pool_global_index is linear in the coordinates).
struct KernelOffsets {
  std::vector<int64_t> local, global;
};

/// Kernel volumes up to this run the full run of max windows side by side (above: one by one).
inline constexpr int64_t kMaxRunKernelCells = 4096;

KernelOffsets kernel_offsets(const PoolWindows& windows) {
  const PoolDim* dims = windows.dims;
  KernelOffsets offsets;
  for (int64_t t0 = 0; t0 < dims[0].kernel; ++t0)
    for (int64_t t1 = 0; t1 < dims[1].kernel; ++t1)
      for (int64_t t2 = 0; t2 < dims[2].kernel; ++t2) {
        const int64_t i0 = t0 * dims[0].dilation, i1 = t1 * dims[1].dilation,
                      i2 = t2 * dims[2].dilation;
        offsets.local.push_back((i0 * dims[1].in + i1) * dims[2].in + i2);
        offsets.global.push_back((i0 * dims[1].global_in + i1) * dims[2].global_in + i2);
      }
  return offsets;
}

/// max pooling of one plane into `target` (values) and `target_index` (global indices). Outputs
/// of the full run (every kernel cell real along the innermost dim) are reduced side by side in
/// `best` and `cell` (at least run.hi - run.lo values each), each visiting its cells in window
/// order with window_argmax's comparison, so the results are the same.
template <typename T, typename C>
void max_plane_forward(const PoolWindows& windows,
                       const std::array<std::vector<PoolRange>, 3>& ranges, const FullRun& run,
                       const KernelOffsets& offsets, const T* plane, T* target,
                       int64_t* target_index, C* __restrict best, int32_t* __restrict cell) {
  const PoolDim* dims = windows.dims;
  const int64_t stride = dims[2].stride, width = run.hi - run.lo;
  const bool runs = width > 0 && static_cast<int64_t>(offsets.local.size()) > 0;
  for_each_output_row(
      windows, ranges,
      [&](const PoolRange& r0, const PoolRange& r1, int64_t s0, int64_t s1, int64_t row_start) {
        T* out = target + row_start;
        int64_t* out_index = target_index + row_start;
        const bool vector = runs && r0.hi > r0.lo && r1.hi > r1.lo;
        for (int64_t j2 = 0; j2 < dims[2].out; ++j2) {
          if (vector && j2 == run.lo) j2 = run.hi;
          if (j2 == dims[2].out) break;
          const PoolArgmax arg = window_argmax<T, C>(windows, plane, r0, r1, ranges[2][j2], s0, s1,
                                                     dims[2].first + j2 * stride);
          out[j2] = arg.local < 0 ? T(-std::numeric_limits<C>::infinity()) : plane[arg.local];
          out_index[j2] = arg.global;
        }
        if (!vector) return;
        // The first real cell of each window until a larger one is seen.
        const int32_t first_cell =
            static_cast<int32_t>((r0.lo * dims[1].kernel + r1.lo) * dims[2].kernel);
        for (int64_t j = 0; j < width; ++j) {
          best[j] = -std::numeric_limits<C>::infinity();
          cell[j] = first_cell;
        }
        const int64_t s2 = dims[2].first + run.lo * stride;  // the start of the run's first window
        for (int64_t t0 = r0.lo; t0 < r0.hi; ++t0)
          for (int64_t t1 = r1.lo; t1 < r1.hi; ++t1) {
            const T* row =
                plane +
                ((s0 + t0 * dims[0].dilation) * dims[1].in + s1 + t1 * dims[1].dilation) *
                    dims[2].in +
                s2;
            for (int64_t t2 = 0; t2 < dims[2].kernel; ++t2) {
              const T* cells = row + t2 * dims[2].dilation;
              const int32_t code =
                  static_cast<int32_t>((t0 * dims[1].kernel + t1) * dims[2].kernel + t2);
              for (int64_t j = 0; j < width; ++j) {
                const C value = static_cast<C>(cells[j * stride]);
                const bool take = value > best[j] || value != value;
                best[j] = take ? value : best[j];
                cell[j] = take ? code : cell[j];
              }
            }
          }
        const int64_t local_start = (s0 * dims[1].in + s1) * dims[2].in + s2;
        const int64_t global_start = kernels::pool_global_index(windows, s0, s1, s2);
        for (int64_t j = 0; j < width; ++j) {
          const int64_t local = local_start + j * stride + offsets.local[cell[j]];
          out[run.lo + j] = plane[local];
          out_index[run.lo + j] = global_start + j * stride + offsets.global[cell[j]];
        }
      });
}

/// avg pooling of one plane. Outputs of the full run are summed side by side in `sums` (at least
/// dims[2].out values), each in the same order as avg_window's (so the results are the same).
template <typename T, typename C>
void avg_plane_forward(const PoolWindows& windows,
                       const std::array<std::vector<PoolRange>, 3>& ranges, const FullRun& run,
                       const T* plane, T* target, C* __restrict sums) {
  const PoolDim* dims = windows.dims;
  const int64_t stride = dims[2].stride, width = run.hi - run.lo;
  for_each_output_row(
      windows, ranges,
      [&](const PoolRange& r0, const PoolRange& r1, int64_t s0, int64_t s1, int64_t row_start) {
        T* out = target + row_start;
        const bool vector = width > 0 && r0.hi > r0.lo && r1.hi > r1.lo;
        for (int64_t j2 = 0; j2 < dims[2].out; ++j2) {
          if (vector && j2 == run.lo) j2 = run.hi;
          if (j2 == dims[2].out) break;
          out[j2] = avg_window<T, C>(windows, plane, r0, r1, ranges[2][j2], s0, s1,
                                     dims[2].first + j2 * stride);
        }
        if (!vector) return;
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
      });
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
  for_each_output_row(
      windows, ranges,
      [&](const PoolRange& r0, const PoolRange& r1, int64_t s0, int64_t s1, int64_t row_start) {
        const T* g = g_plane + row_start;
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
        if (!vector) return;
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
      });
}

}  // namespace

std::vector<Tensor> pool_forward_cpu(const PoolWindows& windows, const Tensor& x,
                                     const Shape& y_shape) {
  TESSERA_CHECK_ARG(x.device().is_cpu(), op_name(windows), "cpu kernel got a {} tensor", x.str());
  const bool max = windows.kind == PoolKind::max;
  const Tensor input = x.contiguous();
  Tensor y = Tensor::empty(y_shape, input.dtype());
  Tensor indices = max ? Tensor::empty(y_shape, DType::i64) : Tensor();
  const int64_t in_plane = windows.in_plane(), out_plane = windows.out_plane();
  if (y.numel() > 0) {
    const auto ranges = ranges_of(windows);
    dispatch_pool(input.dtype(), op_name(windows), [&]<typename T, typename C>() {
      const T* in = static_cast<const T*>(input.raw_data());
      T* out = static_cast<T*>(y.raw_data());
      int64_t* argmax = max ? static_cast<int64_t*>(indices.raw_data()) : nullptr;
      const FullRun run = full_run(windows.dims[2], ranges[2]);
      const int64_t volume =
          windows.dims[0].kernel * windows.dims[1].kernel * windows.dims[2].kernel;
      const KernelOffsets offsets =
          max && volume <= kMaxRunKernelCells ? kernel_offsets(windows) : KernelOffsets{};
      parallel_for(windows.planes, compute_threads(), [&](int64_t begin, int64_t end, int) {
        const size_t width = static_cast<size_t>(run.hi - run.lo);
        std::vector<C> sums(width);  // avg: the sums; max: the best values
        std::vector<int32_t> cells(max ? width : 0);
        for (int64_t p = begin; p < end; ++p) {
          const T* plane = in + p * in_plane;
          T* target = out + p * out_plane;
          if (max) {
            max_plane_forward<T, C>(windows, ranges, run, offsets, plane, target,
                                    argmax + p * out_plane, sums.data(), cells.data());
          } else {
            avg_plane_forward<T, C>(windows, ranges, run, plane, target, sums.data());
          }
        }
      });
    });
  }
  std::vector<Tensor> outputs{std::move(y)};
  if (max) outputs.push_back(std::move(indices));
  return outputs;
}

Tensor pool_backward_cpu(const PoolWindows& windows, const Shape& x_shape,
                         const std::optional<Tensor>& indices, const Tensor& gy) {
  const bool max = windows.kind == PoolKind::max;
  TESSERA_CHECK_ARG(gy.device().is_cpu(), op_name(windows), "cpu kernel got {}", gy.str());
  const Tensor grad = gy.contiguous();
  if (max)
    TESSERA_CHECK_ARG(indices && indices->device().is_cpu() && indices->dtype() == DType::i64 &&
                          indices->shape() == grad.shape(),
                      op_name(windows), "backward got the indices {} for the gradient {}",
                      indices ? indices->str() : std::string("(none)"), grad.str());
  const Tensor argmax = max ? indices->contiguous() : Tensor();
  // Every plane of dx is written whole below (zeroed, then the gradient added), so it starts
  // uninitialised; with no gradient at all it is zeros.
  Tensor dx = Tensor::empty(x_shape, grad.dtype());
  const int64_t in_plane = windows.in_plane(), out_plane = windows.out_plane();
  if (grad.numel() == 0 || dx.numel() == 0) {
    dx.fill(0.0);
    return dx;
  }
  const auto ranges = ranges_of(windows);
  const FullRun run = full_run(windows.dims[2], ranges[2]);
  const LocalIndex local_index(windows);
  std::atomic<bool> stray{false};  // an index outside the piece (indices of another call)
  dispatch_pool(grad.dtype(), op_name(windows), [&]<typename T, typename C>() {
    const T* g = static_cast<const T*>(grad.raw_data());
    T* out = static_cast<T*>(dx.raw_data());
    // Accumulated in the computation type one plane at a time: in dx's own plane when that is
    // the computation type (f32, f64), else in a buffer rounded once at the end (f16, bf16).
    constexpr bool in_place = std::is_same_v<T, C>;
    parallel_for(windows.planes, compute_threads(), [&](int64_t begin, int64_t end, int) {
      std::vector<C> buffer(in_place ? 0 : static_cast<size_t>(in_plane));
      std::vector<C> shares(static_cast<size_t>(max ? 0 : run.hi - run.lo));
      for (int64_t p = begin; p < end; ++p) {
        T* target = out + p * in_plane;
        C* acc = nullptr;
        if constexpr (in_place)
          acc = target;
        else
          acc = buffer.data();
        std::fill(acc, acc + in_plane, C(0));
        const T* g_plane = g + p * out_plane;
        if (max) {
          // Each output's gradient goes to the cell its index names (none for a window with no
          // real cell, index -1), in output order.
          const int64_t* index = static_cast<const int64_t*>(argmax.raw_data()) + p * out_plane;
          for (int64_t o = 0; o < out_plane; ++o) {
            if (index[o] < 0) continue;
            const int64_t cell = local_index(index[o]);
            if (static_cast<uint64_t>(cell) >= static_cast<uint64_t>(in_plane)) {
              stray = true;
              continue;
            }
            acc[cell] += static_cast<C>(g_plane[o]);
          }
        } else {
          avg_plane_backward<T, C>(windows, ranges, run, g_plane, acc, shares.data());
        }
        if constexpr (!in_place)
          for (int64_t i = 0; i < in_plane; ++i) target[i] = T(acc[i]);
      }
    });
  });
  if (stray)
    throw Error(op_name(windows),
                "backward got indices of cells outside this rank's input piece (the indices are "
                "not this call's)");
  return dx;
}

}  // namespace tessera::ops
