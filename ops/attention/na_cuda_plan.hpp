// What the host and the cuda kernels of neighborhood attention share (plain C++17, included by
// na_cuda.cu too): one call seen as 3-d (1-d and 2-d calls get leading axes of extent 1), the
// window of a query and its inverse (the queries whose window holds a key) along one axis, both
// from GLOBAL indices and extents, and the choice of kernel for a call. The functions are
// host-and-device so that the cpu unit tests check exactly the code the kernels run.
#pragma once

#include <cstdint>
#include <string_view>

#if defined(__CUDACC__)
#define TESSERA_NA_HD __host__ __device__ __forceinline__
#else
#define TESSERA_NA_HD inline
#endif

namespace tessera::ops::kernels {

/// One spatial axis of a call: the global extent and window attributes, the local query piece
/// [query_offset, query_offset + queries) and the key/value tile [tile_offset, tile_offset +
/// tile), both in global indices.
struct NaAxis {
  int64_t length = 1, kernel = 1, dilation = 1;
  int causal = 0;
  int64_t query_offset = 0, queries = 1;
  int64_t tile_offset = 0, tile = 1;
};

/// One call: q, o [batch, queries.., heads, dim], k, v [batch, tile.., heads, dim], lse [batch,
/// queries.., heads], rpb [heads, 2k0-1, 2k1-1, 2k2-1] (axes of extent 1 have kernel 1), all
/// contiguous.
struct NaCall {
  int spatial = 1;  ///< the user's axes: the last `spatial` of the 3
  int64_t batch = 0, heads = 0, dim = 0;
  NaAxis axes[3];
  double scale = 1.0;
  bool has_rpb = false;

  TESSERA_NA_HD int64_t query_count() const {
    return axes[0].queries * axes[1].queries * axes[2].queries;
  }
  TESSERA_NA_HD int64_t tile_count() const { return axes[0].tile * axes[1].tile * axes[2].tile; }
  TESSERA_NA_HD int64_t rpb_extent(int a) const { return 2 * axes[a].kernel - 1; }
  TESSERA_NA_HD int64_t rpb_count() const { return rpb_extent(0) * rpb_extent(1) * rpb_extent(2); }
  TESSERA_NA_HD int64_t window_volume() const {
    return axes[0].kernel * axes[1].kernel * axes[2].kernel;
  }
};

/// Keys first + t * step for t < count (global indices) along one axis.
struct NaSpan {
  int64_t first = 0, count = 0, step = 1;
  TESSERA_NA_HD int64_t end() const { return count > 0 ? first + (count - 1) * step + 1 : first; }
  /// Whether global index j is one of the span's.
  TESSERA_NA_HD bool holds(int64_t j) const {
    return j >= first && j < end() && (j - first) % step == 0;
  }
};

/// The window of global query i along `axis` (na_window of na_reference.hpp, the definition).
/// Undilated axes (d = 1, the common case) take no division: the kernels run these in every
/// block's setup, where a 64-bit division is a subroutine.
TESSERA_NA_HD NaSpan na_axis_window(const NaAxis& axis, int64_t i) {
  const int64_t d = axis.dilation;
  const int64_t group = d == 1 ? 0 : i % d, sub = d == 1 ? i : i / d;
  NaSpan span;
  span.step = d;
  if (axis.causal) {
    const int64_t start = sub - axis.kernel + 1 > 0 ? sub - axis.kernel + 1 : 0;
    span.first = start * d + group;
    span.count = sub - start + 1;
    return span;
  }
  const int64_t group_length = d == 1 ? axis.length : (axis.length - group + d - 1) / d;
  int64_t start = sub - axis.kernel / 2;
  if (start > group_length - axis.kernel) start = group_length - axis.kernel;
  if (start < 0) start = 0;
  span.first = start * d + group;
  span.count = axis.kernel;
  return span;
}

/// The LOCAL queries (global indices in [query_offset, query_offset + queries)) whose window
/// along `axis` holds global key j: one dilation group, an interval of it because window starts
/// and ends never decrease with the query.
TESSERA_NA_HD NaSpan na_axis_inverse_window(const NaAxis& axis, int64_t j) {
  const int64_t d = axis.dilation, k = axis.kernel;
  const int64_t group = d == 1 ? 0 : j % d, sub = d == 1 ? j : j / d;
  const int64_t group_length = d == 1 ? axis.length : (axis.length - group + d - 1) / d;
  int64_t lo, hi;  // sub-grid queries [lo, hi] whose window holds sub-grid key `sub`
  if (axis.causal) {
    lo = sub;
    hi = sub + k - 1;
  } else {
    // start(ii) = clamp(ii - k/2, 0, Lg - k) <= sub  and  start(ii) + k - 1 >= sub.
    hi = sub >= group_length - k ? group_length - 1 : sub + k / 2;
    lo = sub - k + 1 <= 0 ? 0 : sub - k + 1 + k / 2;
  }
  if (hi > group_length - 1) hi = group_length - 1;
  // Clip to the local piece: the first and last local queries of the group.
  const int64_t first_local = axis.query_offset, end_local = axis.query_offset + axis.queries;
  const int64_t local_lo = first_local <= group ? 0
                           : d == 1             ? first_local
                                                : (first_local - group + d - 1) / d;
  const int64_t local_hi = end_local <= group ? -1
                           : d == 1           ? end_local - 1
                                              : (end_local - 1 - group) / d;
  if (lo < local_lo) lo = local_lo;
  if (hi > local_hi) hi = local_hi;
  NaSpan span;
  span.step = d;
  span.first = lo * d + group;
  span.count = hi >= lo ? hi - lo + 1 : 0;
  return span;
}

/// The union [lo, hi) of the windows of global queries [first, last) along `axis` (last >
/// first): the lowest key is read by one of the first d queries, the highest by one of the last.
TESSERA_NA_HD void na_axis_key_range(const NaAxis& axis, int64_t first, int64_t last, int64_t& lo,
                                     int64_t& hi) {
  lo = axis.length;
  hi = 0;
  for (int64_t i = first; i < last && i < first + axis.dilation; ++i) {
    const int64_t start = na_axis_window(axis, i).first;
    if (start < lo) lo = start;
  }
  for (int64_t i = last - axis.dilation > first ? last - axis.dilation : first; i < last; ++i) {
    const int64_t end = na_axis_window(axis, i).end();
    if (end > hi) hi = end;
  }
}

/// The union [lo, hi) of the inverse windows of global keys [first, last) along `axis`, clipped
/// to the local queries (lo == hi: no local query reads these keys).
TESSERA_NA_HD void na_axis_query_range(const NaAxis& axis, int64_t first, int64_t last, int64_t& lo,
                                       int64_t& hi) {
  lo = axis.query_offset + axis.queries;
  hi = axis.query_offset;
  // Every key is visited: an inverse window clipped to the local piece may be empty for the
  // first keys of a group and not for later ones, so the first and last d keys do not bound it.
  for (int64_t j = first; j < last; ++j) {
    const NaSpan span = na_axis_inverse_window(axis, j);
    if (span.count == 0) continue;
    if (span.first < lo) lo = span.first;
    if (span.end() > hi) hi = span.end();
  }
  if (hi < lo) hi = lo;
}

/// The most coordinates along `axis` of the box of one tile of `extent` consecutive local queries
/// (the union of their windows, na_axis_key_range) or of `extent` consecutive keys (the local
/// queries that read them, na_axis_query_range): extent + 2 k d, at most the axis' length.
/// Sizes the mma kernels' membership tables.
TESSERA_NA_HD int64_t na_box_capacity(const NaAxis& axis, int64_t extent) {
  const int64_t bound = extent + 2 * axis.kernel * axis.dilation;
  return bound < axis.length ? bound : axis.length;
}

/// Division of values below 2^31 by a fixed divisor d >= 1 as a multiply-high, an add and a
/// shift (Granlund and Montgomery's round-up method; d < 2^31): the mma kernels split a box item
/// into coordinates for every row of every streamed chunk, by the box's extents, where a 32-bit
/// division by a value known only at run time is a sequence of about 15 instructions.
struct NaFastDiv {
  uint32_t divisor = 1, multiplier = 1, shift = 0;
};
TESSERA_NA_HD NaFastDiv na_fast_div(uint32_t d) {
  NaFastDiv f;
  f.divisor = d;
  while ((uint64_t{1} << f.shift) < d) ++f.shift;
  // m = floor(2^32 (2^s - d) / d) + 1 < 2^32 for 2^(s-1) < d <= 2^s.
  f.multiplier =
      static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
  return f;
}
/// n / f.divisor for n < 2^31 (the sum below then stays under 2^32).
TESSERA_NA_HD uint32_t na_divide(uint32_t n, const NaFastDiv& f) {
#if defined(__CUDA_ARCH__)
  const uint32_t high = __umulhi(n, f.multiplier);
#else
  const uint32_t high = static_cast<uint32_t>((uint64_t{n} * f.multiplier) >> 32);
#endif
  return (high + n) >> f.shift;
}

/// Which cuda kernel runs a call.
enum class NaKernel : int {
  plain,  ///< one warp per (query, head) or (key, head) row, no tensor cores: any call
  fused,  ///< query tiles with tensor cores, online softmax: f16/bf16, dim 32, 64 or 128
  mma     ///< the fused kernel's calls, S, P and the accumulators in registers (mma.sync,
          ///< ldmatrix, cp.async double buffering), forward and backward
};

/// A kernel's name: plain, fused or mma.
inline const char* na_kernel_name(NaKernel kernel) {
  return kernel == NaKernel::plain ? "plain" : kernel == NaKernel::fused ? "fused" : "mma";
}

/// Element types as the kernel choice sees them.
enum class NaElement : int { f32, f64, f16, bf16 };

/// Most (batch, head) pairs of a fused launch (they are the grid's second dimension).
constexpr int64_t kFusedMaxBatchHeads = 65535;

/// The kernel that takes a call of element type `element`, head dim `dim` and `batch_heads`
/// (batch * heads) pairs on a device with (`tensor_cores`) or without bf16 tensor cores (sm_80 and
/// newer): the fused kernel's tensor-core tiles need such a device, a half type and a head dim it
/// is instantiated for, and 16-byte aligned rows (`aligned`: the base pointers are; the host
/// copies operands that are not); everything else runs the plain kernel.
inline NaKernel choose_na_kernel(NaElement element, int64_t dim, int64_t batch_heads, bool aligned,
                                 bool tensor_cores) {
  const bool half = element == NaElement::f16 || element == NaElement::bf16;
  const bool tiled_dim = dim == 32 || dim == 64 || dim == 128;
  return half && tiled_dim && aligned && tensor_cores && batch_heads <= kFusedMaxBatchHeads
             ? NaKernel::fused
             : NaKernel::plain;
}

/// The tensor-core kernels a call the fused kernel takes runs: `fused` or `mma` (the
/// register-tiled ones), as TESSERA_NA_CUDA_KERNEL names it (null or empty: `default_kernel`);
/// false for another value.
inline bool parse_na_kernel_family(const char* value, NaKernel default_kernel, NaKernel& kernel) {
  const std::string_view name = value ? value : "";
  if (name.empty())
    kernel = default_kernel;
  else if (name == "fused")
    kernel = NaKernel::fused;
  else if (name == "mma")
    kernel = NaKernel::mma;
  else
    return false;
  return true;
}

/// TESSERA_NA_MMA_FORWARD_BLOCKS: how many blocks of the mma forward one SM must hold at once.
/// Null, empty or "4" (the default): a thread keeps to 128 registers (Q's fragments re-read from
/// shared memory for each 8-key tile, and some spills), for 16 warps per SM instead of 12, at
/// head dims 32 and 64 (at 128 the shared memory allows 2 blocks whatever the registers); it
/// was 1-12% faster than auto on an H100 and an H200. "auto": as many as the registers the
/// compiler allocates allow (3 for a head dim of 64 on sm_90). Sets `blocks` (0 for auto) and
/// returns true, or returns false (and leaves it) for any other value.
inline bool parse_na_mma_forward_blocks(const char* value, int& blocks) {
  const std::string_view name = value ? value : "";
  if (name == "auto")
    blocks = 0;
  else if (name.empty() || name == "4")
    blocks = 4;
  else
    return false;
  return true;
}

/// Query tile of the fused kernel: kFusedQueries queries of the local piece, shaped per axis
/// so that a tile's key box stays small (1-d: 64; 2-d: 8 x 8; 3-d: 4 x 4 x 4).
constexpr int kFusedQueries = 64;

/// A query tile's extents along the 3 axes.
struct NaTileShape {
  int64_t extent[3];
};

/// Tiles of `tile` over a call's local queries (keys: over its key tile): the blocks of a query
/// tile (key tile) kernel's launch.
TESSERA_NA_HD int64_t na_tile_count(const NaCall& call, const NaTileShape& tile, bool keys) {
  int64_t tiles = 1;
  for (int a = 0; a < 3; ++a) {
    const int64_t extent = keys ? call.axes[a].tile : call.axes[a].queries;
    tiles *= (extent + tile.extent[a] - 1) / tile.extent[a];
  }
  return tiles;
}

/// The fused kernel's tile extents along the 3 axes for a call with `spatial` user axes.
inline void na_fused_tile_shape(int spatial, int64_t tile[3]) {
  tile[0] = spatial == 3 ? 4 : 1;
  tile[1] = spatial == 3 ? 4 : spatial == 2 ? 8 : 1;
  tile[2] = spatial == 3 ? 4 : spatial == 2 ? 8 : 64;
}

/// Whether every key box of a query tile and every query box of a key tile of the mma kernels
/// (na_fused_tile_shape) holds fewer than 2^31 items: the kernels split box items in 32 bits
/// (a bound: the product of na_box_capacity over the axes). Calls past it run the fused kernels.
inline bool na_mma_boxes_fit(const NaCall& call) {
  int64_t tile[3];
  na_fused_tile_shape(call.spatial, tile);
  int64_t volume = 1;
  for (int a = 0; a < 3; ++a) {
    volume *= na_box_capacity(call.axes[a], tile[a]);
    if (volume >= (int64_t{1} << 31)) return false;
  }
  return true;
}

}  // namespace tessera::ops::kernels
