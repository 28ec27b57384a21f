// cpu bodies of sum and mean over one block of dims (see reduce_cpu.hpp).
#include "ops/reduce/reduce_cpu.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "ops/cpu_loops.hpp"

namespace tessera::ops {

namespace {

/// x's shape as [outer, reduced, inner] around the reduced dims, when those with extent > 1 are
/// adjacent (kept dims between them have extent 1).
struct Blocks {
  int64_t outer = 1, reduced = 1, inner = 1;
};

std::optional<Blocks> blocks_of(const Shape& shape, const std::vector<int64_t>& dims) {
  auto reduced = [&](size_t d) {
    return std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) != dims.end();
  };
  int first = -1, last = -1;
  for (size_t d = 0; d < shape.size(); ++d)
    if (reduced(d) && shape[d] > 1) {
      if (first < 0) first = static_cast<int>(d);
      last = static_cast<int>(d);
    }
  Blocks blocks;
  for (size_t d = 0; d < shape.size(); ++d) {
    const int i = static_cast<int>(d);
    if (first >= 0 && i >= first && i <= last) {
      if (!reduced(d) && shape[d] > 1) return std::nullopt;
      blocks.reduced *= shape[d];
    } else if (first < 0 || i < first) {
      blocks.outer *= shape[d];
    } else {
      blocks.inner *= shape[d];
    }
  }
  return blocks;
}

/// Reduced elements one unit of work sums (the partial sums of a long row are added in order).
constexpr int64_t kPiece = int64_t{1} << 16;
/// Inner positions one unit of work accumulates.
constexpr int64_t kColumns = 1024;
/// Independent f64 accumulators of a contiguous sum (vector lanes).
constexpr int kLanes = 16;
/// Independent float accumulators of a contiguous f32 sum: 64, four 512-bit registers (eight
/// 256-bit ones), so that a pass's adds form four dependency chains rather than one; one chain
/// of 16 lanes adds 16 floats per add latency, less than L3 delivers from huge pages.
constexpr int kFloatLanes = 64;
/// Values an f32 sum accumulates in float (per column, or per lane of a contiguous sum) before
/// adding the block's sum into f64.
constexpr int64_t kFloatRows = 32;

template <typename T>
void sum_rows(const T* x, const Blocks& b, double* out) {
  // inner == 1: each output sums a contiguous row; rows cut into pieces of kPiece, each piece
  // summed in kLanes lanes, the pieces' sums added in order. f32 sums blocks of kFloatRows values
  // in each of kFloatLanes float lanes (no conversion per value; a block's error is that of at
  // most kFloatRows float additions, as in sum_columns_f32), the blocks' sums in f64.
  const int64_t pieces = std::max<int64_t>(1, (b.reduced + kPiece - 1) / kPiece);
  std::vector<double> partial(static_cast<size_t>(b.outer * pieces), 0.0);
  parallel_ranges(
      b.outer * pieces,
      [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
        for (int64_t unit = lo; unit < hi; ++unit) {
          const int64_t row = unit / pieces, piece = unit % pieces;
          const int64_t begin = piece * kPiece, end = std::min(b.reduced, begin + kPiece);
          const T* values = x + row * b.reduced;
          double lanes[kLanes] = {};
          int64_t j = begin;
          if constexpr (std::is_same_v<T, float>) {
            double wide[kFloatLanes] = {};
            for (; j + kFloatRows * kFloatLanes <= end; j += kFloatRows * kFloatLanes) {
              float block[kFloatLanes] = {};
              for (int64_t step = 0; step < kFloatRows; ++step)
                for (int l = 0; l < kFloatLanes; ++l)
                  block[l] += values[j + step * kFloatLanes + l];
              for (int l = 0; l < kFloatLanes; ++l) wide[l] += static_cast<double>(block[l]);
            }
            for (int l = 0; l < kFloatLanes; ++l) lanes[l % kLanes] += wide[l];
          }
          for (; j + kLanes <= end; j += kLanes)
            for (int l = 0; l < kLanes; ++l) lanes[l] += double(values[j + l]);
          double total = 0;
          for (int l = 0; l < kLanes; ++l) total += lanes[l];
          for (; j < end; ++j) total += double(values[j]);
          partial[static_cast<size_t>(unit)] = total;
        }
      },
      1);
  for (int64_t row = 0; row < b.outer; ++row) {
    double total = 0;
    for (int64_t p = 0; p < pieces; ++p) total += partial[static_cast<size_t>(row * pieces + p)];
    out[row] = total;
  }
}

template <typename T>
void sum_columns(const T* x, const Blocks& b, double* out) {
  // inner > 1: out[o, i] = sum over r of x[o, r, i], units of (o, kColumns inner positions).
  const int64_t blocks = (b.inner + kColumns - 1) / kColumns;
  parallel_ranges(
      b.outer * blocks,
      [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
        for (int64_t unit = lo; unit < hi; ++unit) {
          const int64_t o = unit / blocks, first = (unit % blocks) * kColumns;
          const int64_t count = std::min(kColumns, b.inner - first);
          double* sums = out + o * b.inner + first;
          const T* column = x + o * b.reduced * b.inner + first;
          // Tiles of kTile columns summed over r in registers, stored once (each column's sum
          // in r order, as in the tail loop).
          constexpr int64_t kTile = 16;
          int64_t i = 0;
          for (; i + kTile <= count; i += kTile) {
            double tile[kTile] = {};
            for (int64_t r = 0; r < b.reduced; ++r) {
              const T* values = column + r * b.inner + i;
              for (int64_t l = 0; l < kTile; ++l) tile[l] += double(values[l]);
            }
            for (int64_t l = 0; l < kTile; ++l) sums[i + l] = tile[l];
          }
          for (int64_t k = i; k < count; ++k) sums[k] = 0;
          for (int64_t r = 0; r < b.reduced; ++r) {
            const T* values = column + r * b.inner;
            for (int64_t k = i; k < count; ++k) sums[k] += double(values[k]);
          }
        }
      },
      1);
}

void sum_columns_f32(const float* x, const Blocks& b, double scale, float* out) {
  // inner > 1, f32: as sum_columns, but each column sums blocks of kFloatRows rows in float lanes
  // (twice the lanes of f64 and no conversions; the error of a block's sum is that of at most
  // kFloatRows float additions), the blocks' sums added in f64 in r order when there are more
  // than one. The result depends on the shape only.
  const int64_t blocks = (b.inner + kColumns - 1) / kColumns;
  const bool one_block = b.reduced <= kFloatRows;
  parallel_ranges(
      b.outer * blocks,
      [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
        for (int64_t unit = lo; unit < hi; ++unit) {
          const int64_t o = unit / blocks, first = (unit % blocks) * kColumns;
          const int64_t count = std::min(kColumns, b.inner - first);
          float* sums = out + o * b.inner + first;
          const float* column = x + o * b.reduced * b.inner + first;
          // Tiles of W columns summed over r in float registers (W = 128 while 128 remain: each
          // of the `reduced` rows a tile visits is then read 512 contiguous bytes at a time; then
          // 32). Over [2, 16, 110592] (one thread, the input in L3) 128 took 0.44-0.52 ms, 64
          // 0.50-0.65, 32 0.58-0.66 (AVX-512 and AVX2 builds alike; 20-40 rounds, the widths
          // alternated).
          auto tiles = [&]<int64_t W>(std::integral_constant<int64_t, W>, int64_t i,
                                      int64_t width) TESSERA_LOOP_BODY {
            double total[W] = {};
            for (int64_t r0 = 0; r0 < b.reduced; r0 += kFloatRows) {
              const int64_t r1 = std::min(b.reduced, r0 + kFloatRows);
              float tile[W] = {};
              if (width == W) {
                for (int64_t r = r0; r < r1; ++r) {
                  const float* values = column + r * b.inner + i;
                  for (int64_t l = 0; l < W; ++l) tile[l] += values[l];
                }
              } else {
                for (int64_t r = r0; r < r1; ++r) {
                  const float* values = column + r * b.inner + i;
                  for (int64_t l = 0; l < width; ++l) tile[l] += values[l];
                }
              }
              if (one_block) {
                for (int64_t l = 0; l < width; ++l)
                  sums[i + l] = static_cast<float>(static_cast<double>(tile[l]) * scale);
                return;
              }
              for (int64_t l = 0; l < W; ++l) total[l] += static_cast<double>(tile[l]);
            }
            for (int64_t l = 0; l < width; ++l) sums[i + l] = static_cast<float>(total[l] * scale);
          };
          int64_t i = 0;
          for (; i + 128 <= count; i += 128) tiles(std::integral_constant<int64_t, 128>{}, i, 128);
          for (; i < count; i += 32)
            tiles(std::integral_constant<int64_t, 32>{}, i, std::min<int64_t>(32, count - i));
        }
      },
      1);
}

}  // namespace

std::optional<Tensor> blocked_sum_cpu(const Tensor& x, const std::vector<int64_t>& dims,
                                      double scale) {
  if (x.dtype() != DType::f32 && x.dtype() != DType::f64) return std::nullopt;
  const std::optional<Blocks> blocks = blocks_of(x.shape(), dims);
  if (!blocks) return std::nullopt;
  Shape kept = x.shape();
  for (int64_t d : dims) kept[d] = 1;
  const Tensor source = x.contiguous();
  if (x.dtype() == DType::f32 && blocks->inner > 1 && source.numel() > 0) {
    Tensor result = Tensor::empty(kept, DType::f32);
    sum_columns_f32(source.data<float>(), *blocks, scale, result.data<float>());
    return result;
  }
  Tensor sums = Tensor::empty(kept, DType::f64);
  double* out = sums.data<double>();
  if (source.numel() == 0) {
    for (int64_t i = 0; i < sums.numel(); ++i) out[i] = 0;
  } else if (x.dtype() == DType::f32) {
    blocks->inner == 1 ? sum_rows(source.data<float>(), *blocks, out)
                       : sum_columns(source.data<float>(), *blocks, out);
  } else {
    blocks->inner == 1 ? sum_rows(source.data<double>(), *blocks, out)
                       : sum_columns(source.data<double>(), *blocks, out);
  }
  if (x.dtype() == DType::f64) {
    for (int64_t i = 0; i < sums.numel(); ++i) out[i] *= scale;
    return sums;
  }
  Tensor result = Tensor::empty(kept, x.dtype());
  float* narrow = result.data<float>();
  for (int64_t i = 0; i < sums.numel(); ++i) narrow[i] = static_cast<float>(out[i] * scale);
  return result;
}

std::optional<Tensor> blocked_broadcast_cpu(const Tensor& g, const Shape& shape,
                                            const std::vector<int64_t>& dims, double scale) {
  if (g.dtype() != DType::f32 && g.dtype() != DType::f64) return std::nullopt;
  const std::optional<Blocks> blocks = blocks_of(shape, dims);
  if (!blocks) return std::nullopt;
  const Tensor source = g.contiguous();
  Tensor result = Tensor::empty(shape, g.dtype());
  auto fill = [&]<typename T>(const T* in, T* out) {
    const Blocks b = *blocks;
    if (b.inner == 1) {
      // out[o, r] = g[o] * scale: runs of one value over the flat range.
      parallel_ranges(b.outer * b.reduced, [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
        while (lo < hi) {
          const int64_t o = lo / b.reduced, end = std::min(hi, (o + 1) * b.reduced);
          const T value = static_cast<T>(double(in[o]) * scale);
          for (int64_t i = lo; i < end; ++i) out[i] = value;
          lo = end;
        }
      });
      return;
    }
    if (scale == 1.0) {
      // sum: a product by 1 in f64 rounds back to g itself, so the rows are copies of g's.
      parallel_ranges(
          b.outer * b.reduced,
          [&](int64_t lo, int64_t hi) {
            for (int64_t row = lo; row < hi; ++row)
              std::memcpy(out + row * b.inner, in + (row / b.reduced) * b.inner,
                          sizeof(T) * static_cast<size_t>(b.inner));
          },
          std::max<int64_t>(1, kPiece / std::max<int64_t>(1, b.inner)));
      return;
    }
    // Units of (outer, reduced) rows of inner elements: out[o, r, i] = g[o, i] * scale, the
    // product in f64 as the general path takes it.
    parallel_ranges(
        b.outer * b.reduced,
        [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
          const double factor = scale;  // a local: stores through out cannot change it
          for (int64_t row = lo; row < hi; ++row) {
            const T* from = in + (row / b.reduced) * b.inner;
            T* to = out + row * b.inner;
            for (int64_t i = 0; i < b.inner; ++i) to[i] = static_cast<T>(double(from[i]) * factor);
          }
        },
        std::max<int64_t>(1, kPiece / std::max<int64_t>(1, b.inner)));
  };
  if (result.numel() == 0) return result;
  if (g.dtype() == DType::f32)
    fill(source.data<float>(), result.data<float>());
  else
    fill(source.data<double>(), result.data<double>());
  return result;
}

}  // namespace tessera::ops
