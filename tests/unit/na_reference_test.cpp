// Neighborhood attention reference (ops/attention/na_reference.hpp): the window helper checked
// exhaustively for small extents, k = L against dense attention, dilation against dilation 1
// on each sub-grid, query pieces with their key tiles against the whole call, the backward
// against finite differences, low-precision dtypes, argument checks, and PyTorch fixtures
// (tests/fixtures/na/make_na_fixtures.py).
#include "ops/attention/na_reference.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/errors.hpp"
#include "core/tensor.hpp"
#include "tests/common/fixtures.hpp"

namespace tessera::ops {
namespace {

using Json = nlohmann::json;

Tensor random_tensor(const Shape& shape, std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  Tensor tensor = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.data<double>()[i] = normal(rng);
  return tensor;
}

NaGeometry make_geometry(const std::vector<int64_t>& extent, const std::vector<int64_t>& kernel,
                         const std::vector<int64_t>& dilation, const std::vector<int64_t>& causal,
                         double scale) {
  return NaGeometry{extent, kernel, dilation, causal, scale};
}

/// Offsets of an unsharded call: the query piece and the tile are the whole tensor.
NaPieces whole(size_t spatial) {
  return NaPieces{std::vector<int64_t>(spatial, 0), std::vector<int64_t>(spatial, 0)};
}

/// Largest |a - b| relative to the largest |b| (at least 1).
double relative_error(const Tensor& a, const Tensor& b) {
  const Tensor reference = b.to_dtype(DType::f64).contiguous();
  double scale = 1.0;
  for (int64_t i = 0; i < reference.numel(); ++i)
    scale = std::max(scale, std::fabs(reference.data<double>()[i]));
  return max_abs_diff(a.to_dtype(DType::f64), reference) / scale;
}

/// The elements of `t` at indices `indices` along `dim`, as a contiguous tensor.
Tensor select(const Tensor& t, int dim, const std::vector<int64_t>& indices) {
  Shape shape = t.shape();
  shape[dim] = static_cast<int64_t>(indices.size());
  Tensor result = Tensor::empty(shape, t.dtype());
  for (size_t n = 0; n < indices.size(); ++n)
    result.slice(dim, static_cast<int64_t>(n), static_cast<int64_t>(n) + 1)
        .copy_from(t.slice(dim, indices[n], indices[n] + 1));
  return result;
}

TEST(NaWindow, EveryNonCausalQuerySeesExactlyKernelKeysOfItsGroup) {
  for (int64_t length = 1; length <= 17; ++length)
    for (int64_t dilation = 1; dilation <= length; ++dilation)
      for (int64_t kernel = 1; kernel * dilation <= length; ++kernel)
        for (int64_t i = 0; i < length; ++i) {
          const NaWindow w = na_window(i, length, kernel, dilation, false);
          const std::string where = fmt::format("L={} k={} d={} i={}", length, kernel, dilation, i);
          ASSERT_EQ(w.count, kernel) << where;
          ASSERT_EQ(w.step, dilation) << where;
          ASSERT_GE(w.first, 0) << where;
          ASSERT_LE(w.end(), length) << where;
          ASSERT_EQ(w.first % dilation, i % dilation) << where;
          // The query is in its own window, which is centred (left k//2, right k//2+k%2-1
          // neighbours) unless that would cross a global border, where it shifts.
          ASSERT_TRUE(i >= w.first && i < w.end()) << where;
          const int64_t centred = i - (kernel / 2) * dilation;
          const int64_t centred_end = i + (kernel / 2 + kernel % 2 - 1) * dilation + 1;
          if (centred >= 0 && centred_end <= length) {
            ASSERT_EQ(w.first, centred) << where;
          } else if (centred < 0) {
            ASSERT_EQ(w.first, i % dilation) << where;  // the group's first key
          } else {
            ASSERT_GT(w.end() + dilation, length) << where;  // ends at the group's last key
          }
        }
}

TEST(NaWindow, CausalQueriesSeeUpToKernelKeysEndingAtThemselves) {
  for (int64_t length = 1; length <= 17; ++length)
    for (int64_t dilation = 1; dilation <= length; ++dilation)
      for (int64_t kernel = 1; kernel * dilation <= length; ++kernel)
        for (int64_t i = 0; i < length; ++i) {
          const NaWindow w = na_window(i, length, kernel, dilation, true);
          const std::string where = fmt::format("L={} k={} d={} i={}", length, kernel, dilation, i);
          ASSERT_EQ(w.count, std::min(kernel, i / dilation + 1)) << where;
          ASSERT_EQ(w.end(), i + 1) << where;
          ASSERT_GE(w.first, 0) << where;
          ASSERT_EQ(w.first % dilation, i % dilation) << where;
        }
}

TEST(NaReference, FullKernelEqualsDenseAttention) {
  std::mt19937_64 rng(7);
  for (const Shape& extents : {Shape{6}, Shape{4, 5}, Shape{3, 2, 4}}) {
    const size_t spatial = extents.size();
    Shape shape{2};
    shape.insert(shape.end(), extents.begin(), extents.end());
    shape.insert(shape.end(), {2, 3});
    const Tensor q = random_tensor(shape, rng), k = random_tensor(shape, rng);
    const Tensor v = random_tensor(shape, rng);
    const NaGeometry geometry = make_geometry(extents, extents, std::vector<int64_t>(spatial, 1),
                                              std::vector<int64_t>(spatial, 0), 0.6);
    const NaForward result = na_forward(q, k, v, nullptr, geometry, whole(spatial));
    // Dense attention over every position.
    const int64_t batch = 2, positions = shape_numel(extents), heads = 2, dim = 3;
    const double* qd = q.data<double>();
    const double* kd = k.data<double>();
    const double* vd = v.data<double>();
    double worst = 0;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < positions; ++i)
        for (int64_t h = 0; h < heads; ++h) {
          std::vector<double> logits(positions);
          for (int64_t j = 0; j < positions; ++j) {
            double dot = 0;
            for (int64_t e = 0; e < dim; ++e)
              dot += qd[((b * positions + i) * heads + h) * dim + e] *
                     kd[((b * positions + j) * heads + h) * dim + e];
            logits[j] = 0.6 * dot;
          }
          double denominator = 0;
          for (double logit : logits) denominator += std::exp(logit);
          for (int64_t e = 0; e < dim; ++e) {
            double expected = 0;
            for (int64_t j = 0; j < positions; ++j)
              expected += std::exp(logits[j]) / denominator *
                          vd[((b * positions + j) * heads + h) * dim + e];
            worst = std::max(
                worst,
                std::fabs(
                    result.output.data<double>()[((b * positions + i) * heads + h) * dim + e] -
                    expected));
          }
          worst =
              std::max(worst, std::fabs(result.lse.data<double>()[(b * positions + i) * heads + h] -
                                        std::log(denominator)));
        }
    EXPECT_LT(worst, 1e-12) << "extents " << fmt::format("{}", extents);
  }
}

TEST(NaReference, DilationEqualsDilationOneOnEachSubGrid) {
  std::mt19937_64 rng(11);
  struct Case {
    Shape extents;
    std::vector<int64_t> kernel, dilation, causal;
  };
  const std::vector<Case> cases{{{13}, {3}, {3}, {0}},
                                {{14}, {2}, {4}, {1}},
                                {{11, 9}, {3, 2}, {2, 3}, {0, 0}},
                                {{10, 7}, {4, 3}, {2, 2}, {1, 0}},
                                {{7, 6, 5}, {2, 3, 2}, {2, 2, 1}, {0, 1, 0}}};
  for (const Case& c : cases) {
    const size_t spatial = c.extents.size();
    Shape shape{1};
    shape.insert(shape.end(), c.extents.begin(), c.extents.end());
    shape.insert(shape.end(), {2, 3});
    const Tensor q = random_tensor(shape, rng), k = random_tensor(shape, rng);
    const Tensor v = random_tensor(shape, rng);
    const NaForward full =
        na_forward(q, k, v, nullptr, make_geometry(c.extents, c.kernel, c.dilation, c.causal, 0.5),
                   whole(spatial));
    // Every combination of groups, one per axis.
    std::vector<int64_t> group(spatial, 0);
    while (true) {
      Tensor qs = q, ks = k, vs = v, os = full.output, lses = full.lse;
      Shape sub_extents;
      for (size_t a = 0; a < spatial; ++a) {
        std::vector<int64_t> indices;
        for (int64_t i = group[a]; i < c.extents[a]; i += c.dilation[a]) indices.push_back(i);
        sub_extents.push_back(static_cast<int64_t>(indices.size()));
        const int dim = static_cast<int>(1 + a);
        qs = select(qs, dim, indices);
        ks = select(ks, dim, indices);
        vs = select(vs, dim, indices);
        os = select(os, dim, indices);
        lses = select(lses, dim, indices);
      }
      const NaForward sub = na_forward(
          qs, ks, vs, nullptr,
          make_geometry(sub_extents, c.kernel, std::vector<int64_t>(spatial, 1), c.causal, 0.5),
          whole(spatial));
      EXPECT_LT(max_abs_diff(sub.output, os), 1e-13) << fmt::format("group {}", group);
      EXPECT_LT(max_abs_diff(sub.lse, lses), 1e-13) << fmt::format("group {}", group);
      size_t a = 0;
      while (a < spatial && ++group[a] == c.dilation[a]) group[a++] = 0;
      if (a == spatial) break;
    }
  }
}

TEST(NaReference, QueryPiecesWithTheirKeyTilesMatchTheWholeCall) {
  std::mt19937_64 rng(13);
  const Shape shape{2, 20, 2, 3};
  const Tensor q = random_tensor(shape, rng), k = random_tensor(shape, rng);
  const Tensor v = random_tensor(shape, rng), go = random_tensor(shape, rng);
  for (const int64_t causal : {0, 1}) {
    const NaGeometry geometry = make_geometry({20}, {7}, {2}, {causal}, 0.4);
    const NaForward full = na_forward(q, k, v, nullptr, geometry, whole(1));
    const NaGradients full_grads = na_backward(q, k, v, nullptr, go, nullptr, geometry, whole(1));
    Tensor dk_sum = Tensor::zeros(shape, DType::f64), dv_sum = Tensor::zeros(shape, DType::f64);
    for (const auto& [first, last] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 2}, {2, 3}, {3, 3}, {3, 11}, {11, 19}, {19, 20}}) {
      // The tile: the union of the piece's windows, grown by one spare row where possible.
      int64_t lo = 20, hi = 0;
      for (int64_t i = first; i < last; ++i) {
        const NaWindow w = na_window(i, 20, 7, 2, causal != 0);
        lo = std::min(lo, w.first);
        hi = std::max(hi, w.end());
      }
      if (first == last) lo = hi = first;
      lo = std::max<int64_t>(lo - 1, 0);
      hi = std::min<int64_t>(hi + 1, 20);
      const NaPieces pieces{{first}, {lo}};
      const Tensor qp = q.slice(1, first, last), gop = go.slice(1, first, last);
      const NaForward piece =
          na_forward(qp, k.slice(1, lo, hi), v.slice(1, lo, hi), nullptr, geometry, pieces);
      EXPECT_LT(max_abs_diff(piece.output, full.output.slice(1, first, last)), 1e-14);
      EXPECT_LT(max_abs_diff(piece.lse, full.lse.slice(1, first, last)), 1e-14);
      const NaGradients grads = na_backward(qp, k.slice(1, lo, hi), v.slice(1, lo, hi), nullptr,
                                            gop, nullptr, geometry, pieces);
      EXPECT_LT(max_abs_diff(grads.dq, full_grads.dq.slice(1, first, last)), 1e-13);
      // dk and dv of the pieces' tiles add up to the whole call's.
      for (auto [sum, part] : {std::pair{&dk_sum, &grads.dk}, std::pair{&dv_sum, &grads.dv}}) {
        Tensor target = sum->slice(1, lo, hi);
        Tensor total = target.clone();
        const Tensor addend = part->contiguous();
        for (int64_t i = 0; i < total.numel(); ++i)
          total.data<double>()[i] += addend.data<double>()[i];
        target.copy_from(total);
      }
    }
    EXPECT_LT(max_abs_diff(dk_sum, full_grads.dk), 1e-13);
    EXPECT_LT(max_abs_diff(dv_sum, full_grads.dv), 1e-13);
  }
}

/// sum(o * go) + sum(lse * glse) for the finite-difference check.
double loss_of(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
               const Tensor& go, const Tensor& glse, const NaGeometry& geometry) {
  const NaForward result = na_forward(q, k, v, rpb, geometry, whole(geometry.extent.size()));
  double loss = 0;
  for (int64_t i = 0; i < go.numel(); ++i)
    loss += result.output.data<double>()[i] * go.data<double>()[i];
  for (int64_t i = 0; i < glse.numel(); ++i)
    loss += result.lse.data<double>()[i] * glse.data<double>()[i];
  return loss;
}

TEST(NaReference, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(17);
  struct Case {
    Shape extents;
    std::vector<int64_t> kernel, dilation, causal;
    bool rpb;
  };
  const std::vector<Case> cases{{{5, 4}, {3, 3}, {1, 1}, {0, 0}, true},
                                {{7}, {4}, {1}, {1}, false},
                                {{6, 5}, {2, 2}, {2, 1}, {0, 1}, false},
                                {{3, 4, 5}, {3, 1, 3}, {1, 2, 1}, {0, 0, 0}, true}};
  for (const Case& c : cases) {
    Shape shape{1};
    shape.insert(shape.end(), c.extents.begin(), c.extents.end());
    shape.insert(shape.end(), {2, 3});
    Shape lse_shape = shape;
    lse_shape.pop_back();
    const NaGeometry geometry = make_geometry(c.extents, c.kernel, c.dilation, c.causal, 0.7);
    std::vector<Tensor> inputs{random_tensor(shape, rng), random_tensor(shape, rng),
                               random_tensor(shape, rng),
                               random_tensor(na_rpb_shape(2, geometry), rng)};
    const Tensor go = random_tensor(shape, rng), glse = random_tensor(lse_shape, rng);
    const Tensor* rpb = c.rpb ? &inputs[3] : nullptr;
    const NaGradients grads = na_backward(inputs[0], inputs[1], inputs[2], rpb, go, &glse, geometry,
                                          whole(c.extents.size()));
    const Tensor* analytic[] = {&grads.dq, &grads.dk, &grads.dv, &grads.drpb};
    const double step = 1e-5;
    for (int which = 0; which < (c.rpb ? 4 : 3); ++which) {
      double worst = 0;
      for (int64_t i = 0; i < inputs[which].numel(); ++i) {
        std::vector<Tensor> plus = inputs, minus = inputs;
        plus[which] = inputs[which].clone();
        minus[which] = inputs[which].clone();
        plus[which].data<double>()[i] += step;
        minus[which].data<double>()[i] -= step;
        const double numeric =
            (loss_of(plus[0], plus[1], plus[2], c.rpb ? &plus[3] : nullptr, go, glse, geometry) -
             loss_of(minus[0], minus[1], minus[2], c.rpb ? &minus[3] : nullptr, go, glse,
                     geometry)) /
            (2 * step);
        worst = std::max(worst, std::fabs(numeric - analytic[which]->data<double>()[i]));
      }
      EXPECT_LT(worst, 1e-7) << "input " << which << " extents " << fmt::format("{}", c.extents);
    }
  }
}

TEST(NaReference, LowPrecisionDtypesComputeInHigherPrecision) {
  std::mt19937_64 rng(19);
  const Shape shape{1, 6, 5, 2, 4};
  const NaGeometry geometry = make_geometry({6, 5}, {3, 2}, {2, 1}, {0, 0}, 0.5);
  const Tensor q = random_tensor(shape, rng), k = random_tensor(shape, rng);
  const Tensor v = random_tensor(shape, rng);
  const NaForward exact = na_forward(q, k, v, nullptr, geometry, whole(2));
  for (const auto& [dtype, tolerance] : std::vector<std::pair<DType, double>>{
           {DType::f32, 1e-6}, {DType::bf16, 5e-2}, {DType::f16, 5e-3}}) {
    // Inputs rounded to the dtype, so the only other error is the rounding of the outputs.
    const Tensor ql = q.to_dtype(dtype), kl = k.to_dtype(dtype), vl = v.to_dtype(dtype);
    const NaForward low = na_forward(ql, kl, vl, nullptr, geometry, whole(2));
    const NaForward rounded = na_forward(ql.to_dtype(DType::f64), kl.to_dtype(DType::f64),
                                         vl.to_dtype(DType::f64), nullptr, geometry, whole(2));
    EXPECT_EQ(low.output.dtype(), dtype);
    EXPECT_EQ(low.lse.dtype(), DType::f32);  // f32 stays f32; f16/bf16 give f32
    EXPECT_LT(relative_error(low.output, rounded.output), tolerance) << dtype_name(dtype);
    EXPECT_LT(relative_error(low.lse, rounded.lse), 1e-6) << dtype_name(dtype);
    EXPECT_LT(relative_error(low.output, exact.output), 20 * tolerance) << dtype_name(dtype);
  }
  EXPECT_EQ(na_forward(q, k, v, nullptr, geometry, whole(2)).lse.dtype(), DType::f64);
}

TEST(NaReference, RejectsBadArgumentsWithMessagesNamingTheValues) {
  std::mt19937_64 rng(23);
  const Shape shape{1, 10, 1, 2};
  const Tensor q = random_tensor(shape, rng);
  auto message_of = [](auto&& call) {
    try {
      call();
    } catch (const InvalidArgument& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  // A tile that misses keys of the piece's windows.
  const NaGeometry geometry = make_geometry({10}, {5}, {1}, {0}, 1.0);
  const std::string outside = message_of([&] {
    na_forward(q.slice(1, 0, 2), q.slice(1, 0, 4), q.slice(1, 0, 4), nullptr, geometry,
               NaPieces{{0}, {0}});
  });
  EXPECT_NE(outside.find("outside the key/value tile [0, 4)"), std::string::npos) << outside;
  // Kernel larger than the extent.
  const std::string too_big = message_of(
      [&] { na_forward(q, q, q, nullptr, make_geometry({10}, {4}, {3}, {0}, 1.0), whole(1)); });
  EXPECT_NE(too_big.find("kernel size 4 with dilation 3"), std::string::npos) << too_big;
  // rpb only with non-causal odd kernels.
  const Tensor rpb = random_tensor({1, 9}, rng);
  const std::string causal_rpb = message_of(
      [&] { na_forward(q, q, q, &rpb, make_geometry({10}, {5}, {1}, {1}, 1.0), whole(1)); });
  EXPECT_NE(causal_rpb.find("relative positional bias"), std::string::npos) << causal_rpb;
  const Tensor rpb_even = random_tensor({1, 7}, rng);
  const std::string even_rpb = message_of(
      [&] { na_forward(q, q, q, &rpb_even, make_geometry({10}, {4}, {1}, {0}, 1.0), whole(1)); });
  EXPECT_NE(even_rpb.find("relative positional bias"), std::string::npos) << even_rpb;
  const std::string wrong_rpb = message_of(
      [&] { na_forward(q, q, q, &rpb_even, make_geometry({10}, {5}, {1}, {0}, 1.0), whole(1)); });
  EXPECT_NE(wrong_rpb.find("rpb of shape [1, 7], expected [1, 9]"), std::string::npos) << wrong_rpb;
}

TEST(NaReference, EmptyQueryPiecesGiveEmptyOutputs) {
  std::mt19937_64 rng(29);
  const Tensor q = random_tensor({2, 0, 3, 1, 2}, rng);
  const Tensor kv = random_tensor({2, 0, 3, 1, 2}, rng);
  const NaGeometry geometry = make_geometry({5, 3}, {3, 3}, {1, 1}, {0, 0}, 1.0);
  const NaForward result = na_forward(q, kv, kv, nullptr, geometry, NaPieces{{2, 0}, {2, 0}});
  EXPECT_EQ(result.output.shape(), (Shape{2, 0, 3, 1, 2}));
  EXPECT_EQ(result.lse.shape(), (Shape{2, 0, 3, 1}));
  const NaGradients grads =
      na_backward(q, kv, kv, nullptr, q, nullptr, geometry, NaPieces{{2, 0}, {2, 0}});
  EXPECT_EQ(grads.dk.shape(), kv.shape());
}

// --- PyTorch fixtures ---------------------------------------------------------------------

const std::string kFixtureDir = testing::fixture_dir("na");

Tensor read_fixture(const std::string& file, const Shape& shape) {
  return testing::read_fixture(kFixtureDir, file, shape);
}

void check_fixtures(DType dtype, double forward_tolerance, double dkv_tolerance,
                    double dq_tolerance) {
  const Json manifest = testing::read_manifest(kFixtureDir);
  int cases = 0;
  for (const Json& fixture : manifest["cases"]) {
    const std::string name = fixture["name"];
    const Shape shape = fixture["q_shape"].get<Shape>();
    Shape lse_shape = shape;
    lse_shape.pop_back();
    const Json& files = fixture["files"];
    const size_t spatial = fixture["dims"];
    const NaGeometry geometry =
        make_geometry(Shape(shape.begin() + 1, shape.begin() + 1 + spatial),
                      fixture["kernel_size"].get<std::vector<int64_t>>(),
                      fixture["dilation"].get<std::vector<int64_t>>(),
                      fixture["causal"].get<std::vector<int64_t>>(), fixture["scale"]);
    const Tensor q = read_fixture(files["q"], shape).to_dtype(dtype);
    const Tensor k = read_fixture(files["k"], shape).to_dtype(dtype);
    const Tensor v = read_fixture(files["v"], shape).to_dtype(dtype);
    const Tensor go = read_fixture(files["go"], shape).to_dtype(dtype);
    std::optional<Tensor> rpb;
    if (fixture["has_rpb"])
      rpb = read_fixture(files["rpb"], fixture["rpb_shape"].get<Shape>()).to_dtype(dtype);
    const Tensor* bias = rpb ? &*rpb : nullptr;
    const NaForward result = na_forward(q, k, v, bias, geometry, whole(spatial));
    const NaGradients grads = na_backward(q, k, v, bias, go, nullptr, geometry, whole(spatial));
    const std::string where = fmt::format("{} in {}", name, dtype_name(dtype));
    EXPECT_LT(max_abs_diff(result.output.to_dtype(DType::f64), read_fixture(files["o"], shape)),
              forward_tolerance)
        << where;
    EXPECT_LT(max_abs_diff(result.lse.to_dtype(DType::f64), read_fixture(files["lse"], lse_shape)),
              forward_tolerance)
        << where;
    EXPECT_LT(max_abs_diff(grads.dq.to_dtype(DType::f64), read_fixture(files["gq"], shape)),
              dq_tolerance)
        << where;
    EXPECT_LT(max_abs_diff(grads.dk.to_dtype(DType::f64), read_fixture(files["gk"], shape)),
              dkv_tolerance)
        << where;
    EXPECT_LT(max_abs_diff(grads.dv.to_dtype(DType::f64), read_fixture(files["gv"], shape)),
              dkv_tolerance)
        << where;
    if (rpb) {
      EXPECT_LT(max_abs_diff(grads.drpb.to_dtype(DType::f64),
                             read_fixture(files["grpb"], fixture["rpb_shape"].get<Shape>())),
                dq_tolerance)
          << where;
    }
    ++cases;
  }
  EXPECT_GE(cases, 12);
}

TEST(NaReference, F64MatchesPyTorchFixtures) {
  check_fixtures(DType::f64, 1e-12, 1e-12, 1e-12);
}

TEST(NaReference, F32MatchesPyTorchFixtures) {
  check_fixtures(DType::f32, 1e-5, 1e-5, 1e-4);
}

}  // namespace
}  // namespace tessera::ops
