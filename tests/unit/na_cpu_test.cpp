// Fast cpu neighborhood attention (ops/attention/na_cpu.hpp) against the exact reference
// (na_reference.hpp): a seeded sweep of 1-d/2-d/3-d calls with odd and even kernels, dilation,
// causal axes, relative positional bias, head sizes on and off the specialised paths, and query
// pieces with key/value tiles at offsets (the sharded call's geometry), in f64 and f32, on 1 and
// several threads; the lane-tile forward and the query-tile forward on the same cases; the thread
// count not changing the result; f16/bf16; the argument checks.
#include "ops/attention/na_cpu.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/errors.hpp"
#include "core/tensor.hpp"
#include "ops/cpu_isa.hpp"

namespace tessera::ops {
namespace {

Tensor random_tensor(const Shape& shape, std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  Tensor tensor = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.data<double>()[i] = normal(rng);
  return tensor;
}

/// Largest |a - b| relative to the largest |b| (at least 1).
double relative_error(const Tensor& a, const Tensor& b) {
  const Tensor reference = b.to_dtype(DType::f64).contiguous();
  double scale = 1.0;
  for (int64_t i = 0; i < reference.numel(); ++i)
    scale = std::max(scale, std::fabs(reference.data<double>()[i]));
  return max_abs_diff(a.to_dtype(DType::f64), reference) / scale;
}

int64_t pick(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

/// One random call: inputs, geometry and the pieces of a sharded-call-like geometry.
struct Case {
  Tensor q, k, v, rpb, grad_output, grad_lse;
  bool has_rpb = false;
  NaGeometry geometry;
  NaPieces pieces;
  std::string text;
};

/// Head sizes of the general sweeps: on and off the specialised paths.
const std::vector<int64_t> kAnyDims{1, 3, 8, 32, 64, 20};

Case random_case(std::mt19937_64& rng, DType dtype, bool whole,
                 const std::vector<int64_t>& dims = kAnyDims) {
  Case c;
  const int spatial = static_cast<int>(pick(rng, 1, 3));
  const int64_t max_extent = spatial == 1 ? 24 : spatial == 2 ? 10 : 6;
  const int64_t batch = pick(rng, 1, 2), heads = pick(rng, 1, 3);
  const int64_t dim = dims[pick(rng, 0, static_cast<int64_t>(dims.size()) - 1)];
  Shape shape{batch};
  bool rpb_allowed = true;
  for (int a = 0; a < spatial; ++a) {
    const int64_t length = pick(rng, 1, max_extent);
    const int64_t kernel = pick(rng, 1, length);
    const int64_t dilation = pick(rng, 1, length / kernel);
    const int64_t causal = pick(rng, 0, 3) == 0;
    c.geometry.extent.push_back(length);
    c.geometry.kernel.push_back(kernel);
    c.geometry.dilation.push_back(dilation);
    c.geometry.causal.push_back(causal);
    rpb_allowed = rpb_allowed && !causal && kernel % 2 == 1;
    shape.push_back(length);
  }
  shape.push_back(heads);
  shape.push_back(dim);
  c.geometry.scale = 1.0 / std::sqrt(static_cast<double>(dim));
  const Tensor q = random_tensor(shape, rng), k = random_tensor(shape, rng);
  const Tensor v = random_tensor(shape, rng);
  c.has_rpb = rpb_allowed && pick(rng, 0, 1) == 1;
  if (c.has_rpb) c.rpb = random_tensor(na_rpb_shape(heads, c.geometry), rng).to_dtype(dtype);
  // Pieces: queries [lo, hi) per axis, the tile the union of their windows, sometimes grown by a
  // row the queries do not read (its dk and dv must be zero).
  Tensor q_piece = q, k_tile = k, v_tile = v;
  for (int a = 0; a < spatial; ++a) {
    const int64_t length = c.geometry.extent[a];
    int64_t lo = 0, hi = length;
    if (!whole) {
      lo = pick(rng, 0, length - 1);
      hi = pick(rng, lo + 1, length);
    }
    int64_t key_lo = length, key_hi = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const NaWindow w = na_window(i, length, c.geometry.kernel[a], c.geometry.dilation[a],
                                   c.geometry.causal[a] != 0);
      key_lo = std::min(key_lo, w.first);
      key_hi = std::max(key_hi, w.end());
    }
    if (!whole && pick(rng, 0, 2) == 0) {
      key_lo = std::max<int64_t>(0, key_lo - 1);
      key_hi = std::min(length, key_hi + 1);
    }
    q_piece = q_piece.slice(1 + a, lo, hi);
    k_tile = k_tile.slice(1 + a, key_lo, key_hi);
    v_tile = v_tile.slice(1 + a, key_lo, key_hi);
    c.pieces.query_offset.push_back(lo);
    c.pieces.key_offset.push_back(key_lo);
  }
  c.q = q_piece.contiguous().to_dtype(dtype);
  c.k = k_tile.contiguous().to_dtype(dtype);
  c.v = v_tile.contiguous().to_dtype(dtype);
  c.grad_output = random_tensor(c.q.shape(), rng).to_dtype(dtype);
  Shape lse_shape = c.q.shape();
  lse_shape.pop_back();
  c.grad_lse = random_tensor(lse_shape, rng).to_dtype(dtype == DType::f64 ? dtype : DType::f32);
  c.text = fmt::format(
      "shape {} extent {} kernel {} dilation {} causal {} rpb {} queries at {} "
      "tile at {} of shape {}",
      c.q.shape(), c.geometry.extent, c.geometry.kernel, c.geometry.dilation, c.geometry.causal,
      c.has_rpb, c.pieces.query_offset, c.pieces.key_offset, c.k.shape());
  return c;
}

/// Runs the fast kernels and the reference on one case and compares every output.
void expect_matches_reference(const Case& c, int threads, double tolerance) {
  const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
  const NaForward fast = na_cpu_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, threads);
  const NaForward exact = na_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces);
  ASSERT_EQ(fast.output.dtype(), exact.output.dtype()) << c.text;
  ASSERT_EQ(fast.lse.dtype(), exact.lse.dtype()) << c.text;
  EXPECT_LE(relative_error(fast.output, exact.output), tolerance) << "o, " << c.text;
  EXPECT_LE(relative_error(fast.lse, exact.lse), tolerance) << "lse, " << c.text;
  const NaGradients fast_grads = na_cpu_backward(c.q, c.k, c.v, rpb, c.grad_output, &c.grad_lse,
                                                 c.geometry, c.pieces, threads);
  const NaGradients exact_grads =
      na_backward(c.q, c.k, c.v, rpb, c.grad_output, &c.grad_lse, c.geometry, c.pieces);
  EXPECT_LE(relative_error(fast_grads.dq, exact_grads.dq), tolerance) << "dq, " << c.text;
  EXPECT_LE(relative_error(fast_grads.dk, exact_grads.dk), tolerance) << "dk, " << c.text;
  EXPECT_LE(relative_error(fast_grads.dv, exact_grads.dv), tolerance) << "dv, " << c.text;
  if (c.has_rpb) {
    EXPECT_LE(relative_error(fast_grads.drpb, exact_grads.drpb), tolerance) << "drpb, " << c.text;
  }
  // Without grad_lse too (the op's backward when only o receives a gradient).
  const NaGradients fast_plain =
      na_cpu_backward(c.q, c.k, c.v, rpb, c.grad_output, nullptr, c.geometry, c.pieces, threads);
  const NaGradients exact_plain =
      na_backward(c.q, c.k, c.v, rpb, c.grad_output, nullptr, c.geometry, c.pieces);
  EXPECT_LE(relative_error(fast_plain.dk, exact_plain.dk), tolerance) << "dk, " << c.text;
  EXPECT_LE(relative_error(fast_plain.dq, exact_plain.dq), tolerance) << "dq, " << c.text;
}

TEST(NaCpu, F64MatchesReferenceOnWholeCalls) {
  std::mt19937_64 rng(101);
  for (int n = 0; n < 60; ++n) {
    const Case c = random_case(rng, DType::f64, true);
    expect_matches_reference(c, n % 2 == 0 ? 1 : 3, 1e-12);
  }
}

TEST(NaCpu, F64MatchesReferenceOnQueryPiecesWithTilesAtOffsets) {
  std::mt19937_64 rng(202);
  for (int n = 0; n < 120; ++n) {
    const Case c = random_case(rng, DType::f64, false);
    expect_matches_reference(c, n % 2 == 0 ? 1 : 4, 1e-12);
  }
}

TEST(NaCpu, F32MatchesReferenceToSinglePrecision) {
  std::mt19937_64 rng(303);
  for (int n = 0; n < 120; ++n) {
    const Case c = random_case(rng, DType::f32, n % 3 == 0);
    expect_matches_reference(c, n % 2 == 0 ? 1 : 3, 1e-5);
  }
}

TEST(NaCpu, QueryTilesMatchReferenceOnEveryHeadSizeTheyTake) {
  // D of 32, 64 and 128 run the tiled forward and query pass (queries in tiles of up to 4
  // neighbours along one axis sharing the k/v rows they read): 1-d/2-d/3-d, odd and even
  // kernels, dilation (tiles within one dilation group), causal axes, rpb, extents that are not
  // multiples of the tile, and query pieces with tiles at offsets (windows from global indices),
  // forward and backward, in f64 and f32. CTest runs it under every instruction set's body.
  std::mt19937_64 rng(808);
  for (int n = 0; n < 160; ++n) {
    const DType dtype = n % 2 == 0 ? DType::f64 : DType::f32;
    const Case c = random_case(rng, dtype, n % 4 < 2, {32, 64, 128});
    expect_matches_reference(c, n % 3 == 0 ? 1 : 3, dtype == DType::f64 ? 1e-12 : 1e-5);
  }
}

TEST(NaCpu, KeyTilesMatchReferenceOnEveryHeadSizeTheyTake) {
  // D of 32, 64 and 128 also run the tiled key pass (dk, dv): keys that are neighbours along one
  // axis share the query rows they read, each key's queries being its inverse window. Query
  // pieces with tiles at offsets, often grown by a row no query reads (tiles holding such keys
  // run per key and write zeros), 1-d/2-d/3-d extents that are not multiples of the tile, odd
  // and even kernels, dilation (tiles within one dilation group), causal axes, rpb (mirrored for
  // the key pass), up to 3 heads; f64 to 1e-12 and f32 to 1e-5 against the reference.
  std::mt19937_64 rng(909);
  for (int n = 0; n < 160; ++n) {
    const DType dtype = n % 2 == 0 ? DType::f64 : DType::f32;
    const Case c = random_case(rng, dtype, n % 5 == 0, {32, 64, 128});
    const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
    const double tolerance = dtype == DType::f64 ? 1e-12 : 1e-5;
    const int threads = n % 3 == 0 ? 1 : 3;
    const NaGradients fast = na_cpu_backward(c.q, c.k, c.v, rpb, c.grad_output, &c.grad_lse,
                                             c.geometry, c.pieces, threads);
    const NaGradients exact =
        na_backward(c.q, c.k, c.v, rpb, c.grad_output, &c.grad_lse, c.geometry, c.pieces);
    EXPECT_LE(relative_error(fast.dk, exact.dk), tolerance) << "dk, " << c.text;
    EXPECT_LE(relative_error(fast.dv, exact.dv), tolerance) << "dv, " << c.text;
  }
}

TEST(NaCpu, LargerTwoDimensionalCaseMatchesReference) {
  // The benchmark's shape family (heads-last, D 64, 2-d, k 7 and 13 with and without dilation),
  // at a size the reference runs in a moment.
  std::mt19937_64 rng(404);
  for (const auto& [kernel, dilation, causal] :
       std::vector<std::array<int64_t, 3>>{{7, 1, 0}, {13, 1, 0}, {5, 3, 0}, {6, 2, 1}}) {
    const Shape shape{2, 24, 20, 4, 64};
    const NaGeometry geometry{
        {24, 20}, {kernel, kernel}, {dilation, dilation}, {causal, causal}, 0.125};
    const NaPieces whole{{0, 0}, {0, 0}};
    const Tensor rpb_f64 = random_tensor(na_rpb_shape(4, geometry), rng);
    for (DType dtype : {DType::f64, DType::f32}) {
      Case c;
      c.q = random_tensor(shape, rng).to_dtype(dtype);
      c.k = random_tensor(shape, rng).to_dtype(dtype);
      c.v = random_tensor(shape, rng).to_dtype(dtype);
      c.grad_output = random_tensor(shape, rng).to_dtype(dtype);
      c.grad_lse = random_tensor({2, 24, 20, 4}, rng).to_dtype(dtype);
      c.has_rpb = kernel % 2 == 1 && !causal;
      if (c.has_rpb) c.rpb = rpb_f64.to_dtype(dtype);
      c.geometry = geometry;
      c.pieces = whole;
      c.text = fmt::format("k {} d {} causal {} {}", kernel, dilation, causal, dtype_name(dtype));
      expect_matches_reference(c, 2, dtype == DType::f64 ? 1e-12 : 1e-5);
    }
  }
}

TEST(NaCpu, EightQueryForwardTilesMatchReference) {
  // Windows of at most 9 keys on the tile axis run the f32 forward in tiles of 8 queries where a
  // register holds 16 lanes (AVX-512): kernels at and around the limit (9 runs them, 10 does not),
  // dilation (8 queries of one dilation group span 15 dilated rows), causal, rpb, and an extent
  // of the tile axis (37) that is not a multiple of 8, forward and backward in f32 and f64.
  std::mt19937_64 rng(1212);
  for (const auto& [kernel, dilation, causal] : std::vector<std::array<int64_t, 3>>{
           {3, 1, 0}, {7, 1, 0}, {9, 1, 0}, {10, 1, 0}, {7, 2, 0}, {4, 3, 1}}) {
    const Shape shape{1, 37, 15, 2, 32};
    const NaGeometry geometry{
        {37, 15}, {kernel, kernel}, {dilation, dilation}, {causal, causal}, 0.25};
    const Tensor rpb_f64 = random_tensor(na_rpb_shape(2, geometry), rng);
    for (DType dtype : {DType::f32, DType::f64}) {
      Case c;
      c.q = random_tensor(shape, rng).to_dtype(dtype);
      c.k = random_tensor(shape, rng).to_dtype(dtype);
      c.v = random_tensor(shape, rng).to_dtype(dtype);
      c.grad_output = random_tensor(shape, rng).to_dtype(dtype);
      c.grad_lse = random_tensor({1, 37, 15, 2}, rng).to_dtype(dtype);
      c.has_rpb = kernel % 2 == 1 && !causal;
      if (c.has_rpb) c.rpb = rpb_f64.to_dtype(dtype);
      c.geometry = geometry;
      c.pieces = NaPieces{{0, 0}, {0, 0}};
      c.text = fmt::format("k {} d {} causal {} {}", kernel, dilation, causal, dtype_name(dtype));
      expect_matches_reference(c, 2, dtype == DType::f64 ? 1e-12 : 1e-5);
    }
  }
}

/// The forward with `kernel` asked for against the reference, o and lse; returns the kernel run.
NaCpuForward expect_forward_matches_reference(const Case& c, NaCpuForward kernel, int threads,
                                              double tolerance) {
  const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
  const NaForward fast = na_cpu_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, threads, kernel);
  const NaForward exact = na_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces);
  EXPECT_LE(relative_error(fast.output, exact.output), tolerance) << "o, " << c.text;
  EXPECT_LE(relative_error(fast.lse, exact.lse), tolerance) << "lse, " << c.text;
  return na_cpu_forward_kernel(c.q, c.k, c.v, rpb, c.geometry, c.pieces, kernel);
}

TEST(NaCpu, LaneForwardMatchesReferenceOnEveryCaseItTakes) {
  // The f32 forward's lane tiles (8 neighbours on the innermost axis as the lanes of a register,
  // with AVX2 or AVX-512 and D of 32, 64, 128), asked for on the general sweep: 1-d/2-d/3-d, odd
  // and even kernels, dilation (strips within one dilation group), causal axes, rpb, innermost
  // extents that are not multiples of 8, query pieces with tiles at offsets, 1 and 3 threads; and
  // the query tiles on the same cases. Both within 1e-5 of the reference. CTest runs it under
  // every instruction set's body (the generic one has no lane tiles: the query tiles run).
  std::mt19937_64 rng(1313);
  int lanes = 0;
  for (int n = 0; n < 240; ++n) {
    const Case c = random_case(rng, DType::f32, n % 3 == 0, {32, 64, 128});
    const int threads = n % 2 == 0 ? 1 : 3;
    const NaCpuForward ran =
        expect_forward_matches_reference(c, NaCpuForward::lanes, threads, 1e-5);
    EXPECT_EQ(ran == NaCpuForward::lanes, cpu_isa_level() >= 3) << c.text;
    lanes += ran == NaCpuForward::lanes;
    EXPECT_EQ(expect_forward_matches_reference(c, NaCpuForward::query_tiles, threads, 1e-5),
              NaCpuForward::query_tiles)
        << c.text;
  }
  if (cpu_isa_level() >= 3) {
    EXPECT_EQ(lanes, 240);
  }
}

TEST(NaCpu, LaneForwardTakesLongAxesWideWindowsAndFallsBackBeyondThem) {
  // Long innermost axes (several strips, the last one partly filled), windows up to the widest
  // strip the lane tiles take (8 + 33 - 1 = 40 keys), dilation with causal windows, rpb, windows
  // whose p.v runs key row by key row, and the first window beyond the widest strip (k = 34 on
  // the innermost axis), which runs the query tiles.
  std::mt19937_64 rng(1414);
  struct Shape1 {
    Shape shape;
    NaGeometry geometry;
  };
  const std::vector<Shape1> shapes{
      {{2, 9, 37, 3, 32}, {{9, 37}, {5, 13}, {1, 2}, {0, 1}, 0.2}},
      {{1, 6, 29, 2, 64}, {{6, 29}, {3, 7}, {2, 1}, {1, 0}, 0.125}},
      {{1, 80, 2, 128}, {{80}, {33}, {1}, {0}, 0.1}},
      {{1, 80, 2, 128}, {{80}, {34}, {1}, {0}, 0.1}},
      {{2, 3, 4, 21, 1, 32}, {{3, 4, 21}, {3, 3, 7}, {1, 1, 3}, {0, 1, 0}, 0.3}},
      // Windows whose v outgrows the L1 for one query (p.v key row by key row): 13 x 13 at
      // D = 64 with rpb, and 9 x 15 at D = 128 with dilation and a causal innermost axis.
      {{1, 15, 30, 2, 64}, {{15, 30}, {13, 13}, {1, 1}, {0, 0}, 0.125}},
      {{1, 20, 26, 1, 128}, {{20, 26}, {9, 15}, {2, 1}, {0, 1}, 0.1}},
  };
  for (const Shape1& s : shapes) {
    Case c;
    c.q = random_tensor(s.shape, rng).to_dtype(DType::f32);
    c.k = random_tensor(s.shape, rng).to_dtype(DType::f32);
    c.v = random_tensor(s.shape, rng).to_dtype(DType::f32);
    c.geometry = s.geometry;
    bool rpb_allowed = true;
    for (size_t a = 0; a < s.geometry.kernel.size(); ++a)
      rpb_allowed = rpb_allowed && s.geometry.kernel[a] % 2 == 1 && s.geometry.causal[a] == 0;
    c.has_rpb = rpb_allowed;
    if (c.has_rpb)
      c.rpb = random_tensor(na_rpb_shape(s.shape[s.shape.size() - 2], s.geometry), rng)
                  .to_dtype(DType::f32);
    c.pieces = NaPieces{std::vector<int64_t>(s.geometry.extent.size(), 0),
                        std::vector<int64_t>(s.geometry.extent.size(), 0)};
    c.text = fmt::format("shape {} kernel {} dilation {} causal {}", s.shape, s.geometry.kernel,
                         s.geometry.dilation, s.geometry.causal);
    const bool takes = s.geometry.kernel.back() <= 33 && cpu_isa_level() >= 3;
    EXPECT_EQ(
        expect_forward_matches_reference(c, NaCpuForward::lanes, 2, 1e-5) == NaCpuForward::lanes,
        takes)
        << c.text;
    // Automatic picks the lane tiles where they take the call (these axes fill them).
    const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
    EXPECT_EQ(
        na_cpu_forward_kernel(c.q, c.k, c.v, rpb, c.geometry, c.pieces) == NaCpuForward::lanes,
        takes)
        << c.text;
    // Every output row is one thread's: any thread count gives the same bits.
    const NaForward one =
        na_cpu_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, 1, NaCpuForward::lanes);
    const NaForward many =
        na_cpu_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, 5, NaCpuForward::lanes);
    EXPECT_EQ(max_abs_diff(one.output, many.output), 0.0) << c.text;
    EXPECT_EQ(max_abs_diff(one.lse, many.lse), 0.0) << c.text;
  }
}

TEST(NaCpu, LaneForwardKeepsKeysAndValuesOffAQuerysWindowOutOfIt) {
  // The lane tiles compute logits for every key of the strip and, with AVX-512, for the key rows
  // of both query rows of a pass, and mask the ones off each query's window. An infinite k and a
  // NaN v there must not reach the query: its o and lse equal those of the same call with the two
  // values replaced by finite ones. The bad key (6, 12) lies in the windows of query rows 4..8,
  // so query rows 3 and 9 run beside rows that read it (pairs), and the strip of x = 8..15 holds
  // lanes on both sides of it. Any thread count (other pairings of rows) gives the same bits.
  std::mt19937_64 rng(1515);
  const Shape shape{1, 12, 24, 2, 64};
  const NaGeometry geometry{{12, 24}, {5, 5}, {1, 1}, {0, 0}, 0.125};
  const NaPieces pieces{{0, 0}, {0, 0}};
  const Tensor q = random_tensor(shape, rng).to_dtype(DType::f32);
  const Tensor k = random_tensor(shape, rng).to_dtype(DType::f32);
  const Tensor v = random_tensor(shape, rng).to_dtype(DType::f32);
  Tensor bad_k = k.clone(), bad_v = v.clone();
  const auto at = [&](int64_t y, int64_t x, int64_t h) { return ((y * 24 + x) * 2 + h) * 64; };
  for (int e = 0; e < 64; ++e) {
    bad_k.data<float>()[at(6, 12, 0) + e] = std::numeric_limits<float>::infinity();
    bad_v.data<float>()[at(6, 12, 1) + e] = std::numeric_limits<float>::quiet_NaN();
  }
  const NaForward clean =
      na_cpu_forward(q, k, v, nullptr, geometry, pieces, 1, NaCpuForward::lanes);
  for (int threads : {1, 4}) {
    const NaForward dirty =
        na_cpu_forward(q, bad_k, bad_v, nullptr, geometry, pieces, threads, NaCpuForward::lanes);
    int outside = 0;
    for (int64_t y = 0; y < 12; ++y)
      for (int64_t x = 0; x < 24; ++x) {
        const NaWindow wy = na_window(y, 12, 5, 1, false), wx = na_window(x, 24, 5, 1, false);
        const bool reads = 6 >= wy.first && 6 < wy.end() && 12 >= wx.first && 12 < wx.end();
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t row = (y * 24 + x) * 2 + h;
          if (reads) {
            // Its own window holds them: not finite (inf logit for head 0, NaN p.v for head 1).
            EXPECT_FALSE(std::isfinite(dirty.output.data<float>()[row * 64])) << y << " " << x;
            continue;
          }
          ++outside;
          for (int e = 0; e < 64; ++e)
            ASSERT_EQ(dirty.output.data<float>()[row * 64 + e],
                      clean.output.data<float>()[row * 64 + e])
                << "query " << y << ", " << x << " head " << h << " threads " << threads;
          ASSERT_EQ(dirty.lse.data<float>()[row], clean.lse.data<float>()[row])
              << "query " << y << ", " << x << " head " << h << " threads " << threads;
        }
      }
    EXPECT_EQ(outside, 2 * (12 * 24 - 25));
  }
}

TEST(NaCpu, LaneForwardReadsTheOwnedKeysWhereTheyLie) {
  // A sharded call's k/v tile whose interior (the rank's own rows) the halo exchange left
  // unfilled: NaN there, the owned pieces beside it. The lane forward reads the rows the owned
  // pieces hold from them and gives the bits of the call on the whole tile; 2-d and 3-d, dilation
  // and a causal axis, rpb, batch 2, a tile whose owned rows reach its end. Calls the lane forward
  // does not take (f64, another kernel asked for, pieces cut on the innermost axis, the generic
  // instruction set) do not read in place, and pieces that do not fit the tile are refused.
  std::mt19937_64 rng(1515);
  struct Sharded {
    Shape global;  // [B, spatial.., heads, D]
    NaGeometry geometry;
    int64_t query_lo, query_hi, tile_lo, tile_hi, own_lo, own_hi;  // on the first spatial axis
  };
  const std::vector<Sharded> calls{
      {{2, 26, 19, 2, 32}, {{26, 19}, {7, 5}, {1, 1}, {0, 0}, 0.2}, 9, 16, 6, 19, 9, 16},
      {{1, 30, 22, 1, 64}, {{30, 22}, {5, 7}, {2, 1}, {1, 0}, 0.125}, 12, 21, 4, 21, 12, 21},
      {{1, 12, 3, 17, 2, 32},
       {{12, 3, 17}, {3, 3, 5}, {1, 1, 1}, {0, 0, 0}, 0.3},
       4,
       8,
       3,
       9,
       4,
       8},
  };
  for (const Sharded& call : calls) {
    const size_t spatial = call.geometry.extent.size();
    const Tensor q = random_tensor(call.global, rng).to_dtype(DType::f32);
    const Tensor k = random_tensor(call.global, rng).to_dtype(DType::f32);
    const Tensor v = random_tensor(call.global, rng).to_dtype(DType::f32);
    bool rpb_allowed = true;
    for (size_t a = 0; a < spatial; ++a) rpb_allowed = rpb_allowed && call.geometry.causal[a] == 0;
    const Tensor bias =
        rpb_allowed ? random_tensor(na_rpb_shape(call.global[spatial + 1], call.geometry), rng)
                          .to_dtype(DType::f32)
                    : Tensor();
    const Tensor* rpb = rpb_allowed ? &bias : nullptr;
    const Tensor qp = q.slice(1, call.query_lo, call.query_hi).contiguous();
    const Tensor kt = k.slice(1, call.tile_lo, call.tile_hi).contiguous();
    const Tensor vt = v.slice(1, call.tile_lo, call.tile_hi).contiguous();
    std::vector<int64_t> query_offset(spatial, 0), tile_offset(spatial, 0);
    query_offset[0] = call.query_lo;
    tile_offset[0] = call.tile_lo;
    const NaPieces pieces{query_offset, tile_offset};
    // The tile with NaN where the owned pieces lie, and the pieces.
    Tensor k_holed = kt.clone(), v_holed = vt.clone();
    const int64_t lo = call.own_lo - call.tile_lo, hi = call.own_hi - call.tile_lo;
    k_holed.slice(1, lo, hi).fill(std::nan(""));
    v_holed.slice(1, lo, hi).fill(std::nan(""));
    std::vector<int64_t> offset(spatial, 0);
    offset[0] = lo;
    const NaOwnedKeys owned{k.slice(1, call.own_lo, call.own_hi).contiguous(),
                            v.slice(1, call.own_lo, call.own_hi).contiguous(), offset};
    const std::string text = fmt::format("global {} kernel {}", call.global, call.geometry.kernel);
    const bool lanes = cpu_isa_level() >= 3;
    EXPECT_EQ(na_cpu_forward_reads_owned(qp, k_holed, v_holed, rpb, call.geometry, pieces, owned,
                                         NaCpuForward::lanes),
              lanes)
        << text;
    if (lanes) {
      for (int threads : {1, 3}) {
        const NaForward whole =
            na_cpu_forward(qp, kt, vt, rpb, call.geometry, pieces, threads, NaCpuForward::lanes);
        const NaForward around = na_cpu_forward(qp, k_holed, v_holed, rpb, call.geometry, pieces,
                                                threads, NaCpuForward::lanes, &owned);
        EXPECT_TRUE(bitwise_equal(around.output, whole.output)) << text;
        EXPECT_TRUE(bitwise_equal(around.lse, whole.lse)) << text;
      }
    } else {
      EXPECT_THROW(na_cpu_forward(qp, k_holed, v_holed, rpb, call.geometry, pieces, 1,
                                  NaCpuForward::lanes, &owned),
                   InvalidArgument)
          << text;
    }
    // Not in place: the query tiles asked for, f64 inputs.
    EXPECT_FALSE(na_cpu_forward_reads_owned(qp, k_holed, v_holed, rpb, call.geometry, pieces, owned,
                                            NaCpuForward::query_tiles));
    const NaOwnedKeys owned64{owned.k.to_dtype(DType::f64), owned.v.to_dtype(DType::f64), offset};
    const Tensor rpb64 = rpb ? rpb->to_dtype(DType::f64) : Tensor();
    EXPECT_FALSE(na_cpu_forward_reads_owned(qp.to_dtype(DType::f64), k_holed.to_dtype(DType::f64),
                                            v_holed.to_dtype(DType::f64), rpb ? &rpb64 : nullptr,
                                            call.geometry, pieces, owned64, NaCpuForward::lanes));
    // Pieces cut on the innermost axis: the lane forward reads whole key rows.
    const int inner = static_cast<int>(spatial);
    std::vector<int64_t> cut_offset = offset;
    cut_offset.back() = 1;
    const NaOwnedKeys cut{owned.k.slice(inner, 1, owned.k.shape(inner)).contiguous(),
                          owned.v.slice(inner, 1, owned.v.shape(inner)).contiguous(), cut_offset};
    EXPECT_FALSE(na_cpu_forward_reads_owned(qp, k_holed, v_holed, rpb, call.geometry, pieces, cut,
                                            NaCpuForward::lanes));
    // Pieces that do not fit the tile: past its end, another D, v's shape not k's.
    std::vector<int64_t> past = offset;
    past[0] = kt.shape(1) - owned.k.shape(1) + 1;
    const NaOwnedKeys beyond{owned.k, owned.v, past};
    const NaOwnedKeys narrow{owned.k.slice(inner + 2, 0, 16).contiguous(),
                             owned.v.slice(inner + 2, 0, 16).contiguous(), offset};
    const NaOwnedKeys mismatched{owned.k, owned.v.slice(1, 0, 1).contiguous(), offset};
    for (const NaOwnedKeys* bad : {&beyond, &narrow, &mismatched})
      EXPECT_THROW(na_cpu_forward_reads_owned(qp, k_holed, v_holed, rpb, call.geometry, pieces,
                                              *bad, NaCpuForward::lanes),
                   InvalidArgument)
          << text;
  }
}

TEST(NaCpu, ThreadCountDoesNotChangeTheResult) {
  // Every output row is computed by one thread in a fixed order, so o, lse, dq, dk and dv are
  // identical for any thread count; d rpb is a sum of per-thread partial sums.
  std::mt19937_64 rng(505);
  for (int n = 0; n < 20; ++n) {
    const Case c = random_case(rng, DType::f32, n % 2 == 0);
    const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
    const NaForward one = na_cpu_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, 1);
    const NaForward many = na_cpu_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, 5);
    EXPECT_EQ(max_abs_diff(one.output, many.output), 0.0) << c.text;
    EXPECT_EQ(max_abs_diff(one.lse, many.lse), 0.0) << c.text;
    const NaGradients g1 =
        na_cpu_backward(c.q, c.k, c.v, rpb, c.grad_output, &c.grad_lse, c.geometry, c.pieces, 1);
    const NaGradients g5 =
        na_cpu_backward(c.q, c.k, c.v, rpb, c.grad_output, &c.grad_lse, c.geometry, c.pieces, 5);
    EXPECT_EQ(max_abs_diff(g1.dq, g5.dq), 0.0) << c.text;
    EXPECT_EQ(max_abs_diff(g1.dk, g5.dk), 0.0) << c.text;
    EXPECT_EQ(max_abs_diff(g1.dv, g5.dv), 0.0) << c.text;
    if (c.has_rpb) {
      EXPECT_LE(relative_error(g1.drpb, g5.drpb), 1e-5) << c.text;
    }
  }
}

TEST(NaCpu, LowPrecisionInputsComputeInF32) {
  // f16/bf16 inputs: the same call as the reference on the same rounded inputs, outputs rounded
  // to the input dtype once (so within one rounding of each other); lse is f32.
  std::mt19937_64 rng(606);
  for (DType dtype : {DType::f16, DType::bf16}) {
    for (int n = 0; n < 10; ++n) {
      const Case c = random_case(rng, dtype, n % 2 == 0);
      const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
      const NaForward fast = na_cpu_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, 2);
      const NaForward exact = na_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces);
      EXPECT_EQ(fast.output.dtype(), dtype);
      EXPECT_EQ(fast.lse.dtype(), DType::f32);
      const double rounding = dtype == DType::bf16 ? 1e-2 : 2e-3;
      EXPECT_LE(relative_error(fast.output, exact.output), rounding) << c.text;
      EXPECT_LE(relative_error(fast.lse, exact.lse), 1e-5) << c.text;
      const NaGradients fast_grads =
          na_cpu_backward(c.q, c.k, c.v, rpb, c.grad_output, &c.grad_lse, c.geometry, c.pieces, 2);
      const NaGradients exact_grads =
          na_backward(c.q, c.k, c.v, rpb, c.grad_output, &c.grad_lse, c.geometry, c.pieces);
      EXPECT_EQ(fast_grads.dk.dtype(), dtype);
      EXPECT_LE(relative_error(fast_grads.dq, exact_grads.dq), 2 * rounding) << c.text;
      EXPECT_LE(relative_error(fast_grads.dk, exact_grads.dk), 2 * rounding) << c.text;
      EXPECT_LE(relative_error(fast_grads.dv, exact_grads.dv), 2 * rounding) << c.text;
    }
  }
}

TEST(NaCpu, RejectsATileMissingKeysAndEmptyPiecesGiveEmptyOutputs) {
  std::mt19937_64 rng(707);
  const Tensor q = random_tensor({1, 10, 2, 4}, rng);
  const NaGeometry geometry{{10}, {5}, {1}, {0}, 1.0};
  // Queries [0, 2) read keys [0, 5); a tile [0, 4) lacks key 4.
  try {
    na_cpu_forward(q.slice(1, 0, 2), q.slice(1, 0, 4), q.slice(1, 0, 4), nullptr, geometry,
                   NaPieces{{0}, {0}});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("outside the key/value tile"), std::string::npos)
        << error.what();
  }
  const Tensor empty_q = q.slice(1, 3, 3);
  const NaForward result = na_cpu_forward(empty_q, q.slice(1, 0, 2), q.slice(1, 0, 2), nullptr,
                                          geometry, NaPieces{{3}, {0}}, 2);
  EXPECT_EQ(result.output.numel(), 0);
  const NaGradients grads = na_cpu_backward(empty_q, q.slice(1, 0, 2), q.slice(1, 0, 2), nullptr,
                                            empty_q, nullptr, geometry, NaPieces{{3}, {0}}, 2);
  EXPECT_EQ(grads.dq.numel(), 0);
  EXPECT_EQ(max_abs_diff(grads.dk, Tensor::zeros(grads.dk.shape(), DType::f64)), 0.0);
}

// bench na gives the forward as a share of the FMA peak at the level the kernels run with: a
// measured, positive rate where that level has FMAs (avx2, avx512), none at the generic level.
TEST(NaCpu, FmaPeakIsMeasuredAtTheKernelsLevel) {
  const double peak = cpu_fma_peak_gflops();
  if (cpu_isa_level() >= 3) {
    EXPECT_GT(peak, 0.5) << cpu_isa_name();
    EXPECT_LT(peak, 1e5) << cpu_isa_name();
  } else {
    EXPECT_EQ(peak, 0.0);
  }
}

}  // namespace
}  // namespace tessera::ops
