// The source cell of every padded output on one local (haloed) piece, as the cpu and cuda
// kernels read them: plain C++17 (included by pad_cuda.cu too). Padded dims are padded at the
// front to three with unit dims. Along a padded dim with input extent L and lo cells added before
// it, output j (global) reads t = j - lo: constant: x[t] inside [0, L), else the value; reflect:
// -t before the input, 2(L-1) - t after it; replicate: t clamped to [0, L-1]; circular: t itself,
// in the unwrapped coordinates of a haloed piece that a periodic halo filled (so no index wraps
// here). The functions are constexpr so that device code calls them too.
#pragma once

#include <cstdint>

namespace tessera::ops::kernels {

/// How the padding cells are filled.
enum class PadMode : int { constant, reflect, replicate, circular };

/// One padded dim of a local piece.
struct PadDim {
  int64_t in = 1;      ///< haloed input extent
  int64_t out = 1;     ///< local output extent
  int64_t out_lo = 0;  ///< global index of local output 0
  int64_t in_lo = 0;   ///< global (for circular: unwrapped) index of local input cell 0
  int64_t length = 1;  ///< global input extent L
  int64_t lo = 0;      ///< cells added before the input
};

/// Every output of a local piece: `planes` contiguous input and output planes (the product of
/// the unpadded leading dims).
struct PadPlan {
  PadMode mode = PadMode::constant;
  double value = 0.0;
  int64_t planes = 0;
  PadDim dims[3];

  /// Input cells per plane.
  constexpr int64_t in_plane() const { return dims[0].in * dims[1].in * dims[2].in; }
  /// Output cells per plane.
  constexpr int64_t out_plane() const { return dims[0].out * dims[1].out * dims[2].out; }
};

/// The global source of global output j along a dim (unwrapped for circular), or -1 for a
/// constant padding cell. Circular sources may lie outside [0, L).
constexpr int64_t pad_global_source(PadMode mode, int64_t lo, int64_t length, int64_t j) {
  const int64_t t = j - lo;
  switch (mode) {
    case PadMode::constant: return t >= 0 && t < length ? t : -1;
    case PadMode::reflect: return t < 0 ? -t : t >= length ? 2 * (length - 1) - t : t;
    case PadMode::replicate: return t < 0 ? 0 : t >= length ? length - 1 : t;
    case PadMode::circular: return t;
  }
  return -1;
}

/// Whether global output j along a dim is a constant padding cell.
constexpr bool pad_is_value(PadMode mode, int64_t lo, int64_t length, int64_t j) {
  return mode == PadMode::constant && (j - lo < 0 || j - lo >= length);
}

/// The local (haloed piece) source of local output j along `dim`, or -1 for a constant padding
/// cell.
constexpr int64_t pad_tap(PadMode mode, const PadDim& dim, int64_t j) {
  const int64_t global = dim.out_lo + j;
  if (pad_is_value(mode, dim.lo, dim.length, global)) return -1;
  return pad_global_source(mode, dim.lo, dim.length, global) - dim.in_lo;
}

}  // namespace tessera::ops::kernels
