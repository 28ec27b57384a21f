// The pooling windows of one local (haloed) piece, as the cpu and cuda kernels read them: plain
// C++17 (included by pool_cuda.cu too). Spatial dims are padded at the front to three with unit
// dims; every index is local to the haloed piece, whose cells outside [real_lo, real_hi) are
// padding (max: -inf; avg: counted or not per count_include_pad). The functions are constexpr so
// that device code calls them too (pool_cuda.cu is compiled with --expt-relaxed-constexpr).
#pragma once

#include <cstdint>

namespace tessera::ops::kernels {

/// Which pooling.
enum class PoolKind : int { max, avg };

/// One spatial dim of the local windows: output j's window starts at input first + j*stride and
/// reads kernel cells dilation apart.
struct PoolDim {
  int64_t in = 1;         ///< haloed input extent
  int64_t out = 1;        ///< output extent
  int64_t kernel = 1;     ///< cells per window
  int64_t stride = 1;     ///< input cells between window starts
  int64_t dilation = 1;   ///< input cells between the cells of a window
  int64_t first = 0;      ///< window start of output 0
  int64_t real_lo = 0;    ///< first real (not padding) input cell
  int64_t real_hi = 1;    ///< one past the last real input cell
  int64_t padded_hi = 1;  ///< one past the padded extent (avg windows are clipped to it)
  int64_t global_lo = 0;  ///< the global index of local cell 0
  int64_t global_in = 1;  ///< the global input extent
};

/// Every window of a local piece: `planes` (N*C) contiguous input and output planes.
struct PoolWindows {
  PoolKind kind = PoolKind::max;
  int64_t planes = 0;
  PoolDim dims[3];
  bool count_include_pad = true;  ///< avg: the divisor counts padding cells
  int64_t divisor_override = 0;   ///< avg: the divisor when non-zero

  /// Input cells per plane.
  constexpr int64_t in_plane() const { return dims[0].in * dims[1].in * dims[2].in; }
  /// Output cells per plane.
  constexpr int64_t out_plane() const { return dims[0].out * dims[1].out * dims[2].out; }
};

/// max_pool's index of local input cell (i0, i1, i2): the flat index of the cell in the global
/// input's spatial plane (PyTorch's return_indices), the same however the input is sharded.
constexpr int64_t pool_global_index(const PoolWindows& windows, int64_t i0, int64_t i1,
                                    int64_t i2) {
  const PoolDim* dims = windows.dims;
  return ((dims[0].global_lo + i0) * dims[1].global_in + dims[1].global_lo + i1) *
             dims[2].global_in +
         dims[2].global_lo + i2;
}

/// The kernel cells [lo, hi) of output j's window along `dim` that are real input cells (for avg,
/// dilation is 1, so they are the cells of the window clipped to the input), and the window's
/// extent clipped to the padded extent (avg's count_include_pad divisor).
struct PoolRange {
  int64_t lo = 0, hi = 0, padded = 0;
};

/// The real cells of output j's window along `dim`.
constexpr PoolRange pool_range(const PoolDim& dim, int64_t j) {
  const int64_t start = dim.first + j * dim.stride;
  PoolRange range;
  const int64_t lo_gap = dim.real_lo - start;
  range.lo = lo_gap <= 0 ? 0 : (lo_gap + dim.dilation - 1) / dim.dilation;
  const int64_t hi_gap = dim.real_hi - 1 - start;
  range.hi = hi_gap < 0 ? 0 : hi_gap / dim.dilation + 1;
  if (range.hi > dim.kernel) range.hi = dim.kernel;
  if (range.hi < range.lo) range.hi = range.lo;
  const int64_t end = start + dim.kernel < dim.padded_hi ? start + dim.kernel : dim.padded_hi;
  range.padded = end - start;
  return range;
}

}  // namespace tessera::ops::kernels
