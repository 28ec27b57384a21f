// The source cells of interpolated outputs on one local (haloed) piece, as the cpu and cuda
// kernels read them: plain C++17 (included by interpolate_cuda.cu too). Spatial dims are padded at
// the front to three with unit dims. Along a dim, output o (global) reads source cells i0 and i1
// (global, i1 = i0 + 1 clamped at the last cell; nearest modes: i1 = i0) with weights w0 and w1,
// PyTorch's rules computed in double:
//   nearest:       i0 = min(floor(o * s), L - 1)
//   nearest-exact: i0 = min(floor((o + 0.5) * s), L - 1)
//   linear:        x = align_corners ? o * s : max(0, (o + 0.5) * s - 0.5), i0 = min(floor(x),
//   L-1),
//                  w1 = x - i0, w0 = 1 - w1
// where s is the source cells per output cell (see InterpDim::scale). The functions are
// constexpr so that device code calls them too (--expt-relaxed-constexpr).
#pragma once

#include <cstdint>

namespace tessera::ops::kernels {

/// How outputs read their source cells.
enum class InterpMode : int { nearest, nearest_exact, linear };

/// One spatial dim of a local piece.
struct InterpDim {
  int64_t in = 1;      ///< haloed input extent
  int64_t out = 1;     ///< local output extent
  int64_t out_lo = 0;  ///< global index of local output 0
  int64_t in_lo = 0;   ///< global index of local input cell 0
  int64_t length = 1;  ///< global input extent L
  double scale = 0.0;  ///< source cells per output cell s
  bool align_corners = false;
};

/// Every output of a local piece: `planes` (N*C) contiguous input and output planes.
struct InterpPlan {
  InterpMode mode = InterpMode::nearest;
  int64_t planes = 0;
  InterpDim dims[3];

  /// Input cells per plane.
  constexpr int64_t in_plane() const { return dims[0].in * dims[1].in * dims[2].in; }
  /// Output cells per plane.
  constexpr int64_t out_plane() const { return dims[0].out * dims[1].out * dims[2].out; }
};

/// The two source cells of an output along a dim (global indices) and their weights.
struct InterpTap {
  int64_t i0 = 0, i1 = 0;
  double w0 = 1.0, w1 = 0.0;
};

/// The source cells of global output o along a dim of global input extent `length`.
constexpr InterpTap interp_source(InterpMode mode, double scale, bool align_corners, int64_t length,
                                  int64_t o) {
  InterpTap tap;
  if (mode == InterpMode::linear) {
    double x = align_corners ? static_cast<double>(o) * scale
                             : (static_cast<double>(o) + 0.5) * scale - 0.5;
    if (x < 0.0) x = 0.0;
    // x >= 0: truncation is floor.
    int64_t i0 = static_cast<int64_t>(x);
    if (i0 > length - 1) i0 = length - 1;
    double lambda = x - static_cast<double>(i0);
    if (lambda < 0.0) lambda = 0.0;
    if (lambda > 1.0) lambda = 1.0;
    tap.i0 = i0;
    tap.i1 = i0 < length - 1 ? i0 + 1 : i0;
    tap.w0 = 1.0 - lambda;
    tap.w1 = lambda;
    return tap;
  }
  const double x = mode == InterpMode::nearest ? static_cast<double>(o) * scale
                                               : (static_cast<double>(o) + 0.5) * scale;
  int64_t i0 = static_cast<int64_t>(x);
  if (i0 > length - 1) i0 = length - 1;
  tap.i0 = tap.i1 = i0;
  return tap;
}

/// The source cells of local output j along `dim`, as indices local to the haloed piece.
constexpr InterpTap interp_tap(InterpMode mode, const InterpDim& dim, int64_t j) {
  InterpTap tap = interp_source(mode, dim.scale, dim.align_corners, dim.length, dim.out_lo + j);
  tap.i0 -= dim.in_lo;
  tap.i1 -= dim.in_lo;
  return tap;
}

}  // namespace tessera::ops::kernels
