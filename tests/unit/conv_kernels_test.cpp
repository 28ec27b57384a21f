// Local conv kernels (ops/conv/conv_kernels.hpp): the reference against a direct-formula oracle,
// the backward kernels against the adjoint identities of the forward, oneDNN against the
// reference, both against PyTorch fixtures (tests/fixtures/make_conv_fixtures.py), empty
// problems, strided inputs and argument checks.
#include "ops/conv/conv_kernels.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.hpp"
#include "core/tensor.hpp"

namespace tessera::ops {
namespace {

// A dense row-major array of doubles: what the oracle and the fixtures work on.
struct Array {
  Shape shape;
  std::vector<double> values;
};

Array zeros_array(const Shape& shape) {
  return {shape, std::vector<double>(static_cast<size_t>(shape_numel(shape)), 0.0)};
}

Array random_array(const Shape& shape, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  Array array = zeros_array(shape);
  for (double& value : array.values) value = uniform(rng);
  return array;
}

Tensor to_tensor(const Array& array, DType dtype) {
  return Tensor::from_values<double>(array.shape, std::span<const double>(array.values))
      .to_dtype(dtype);
}

Array to_array(const Tensor& tensor) {
  const Tensor values = tensor.to_dtype(DType::f64).contiguous();
  const double* data = values.numel() > 0 ? values.data<double>() : nullptr;
  return {tensor.shape(), std::vector<double>(data, data + values.numel())};
}

double dot(const Array& a, const Array& b) {
  double sum = 0.0;
  for (size_t i = 0; i < a.values.size(); ++i) sum += a.values[i] * b.values[i];
  return sum;
}

double norm(const Array& a) {
  return std::sqrt(dot(a, a));
}

double max_abs(const Array& a) {
  double largest = 0.0;
  for (double value : a.values) largest = std::max(largest, std::abs(value));
  return largest;
}

// Shapes equal and max |actual - expected| <= tolerance * max(1, max |expected|).
void expect_close(const Array& actual, const Array& expected, double tolerance,
                  const std::string& what) {
  ASSERT_EQ(actual.shape, expected.shape) << what;
  double worst = 0.0;
  for (size_t i = 0; i < actual.values.size(); ++i)
    worst = std::max(worst, std::abs(actual.values[i] - expected.values[i]));
  EXPECT_LE(worst, tolerance * std::max(1.0, max_abs(expected)))
      << what << ": max abs difference " << worst << ", max |expected| " << max_abs(expected);
}

// Calls fn(index) for every multi-index of `extents` in row-major order.
template <typename Fn>
void for_each_index(const Shape& extents, Fn&& fn) {
  if (shape_numel(extents) == 0) return;
  std::vector<int64_t> index(extents.size(), 0);
  while (true) {
    fn(index);
    size_t dim = extents.size();
    while (dim > 0) {
      --dim;
      if (++index[dim] < extents[dim]) break;
      index[dim] = 0;
      if (dim == 0) return;
    }
    if (extents.empty()) return;
  }
}

// Row-major offset of (leading..., spatial...) in an array of `shape`.
int64_t offset_of(const Shape& shape, int64_t first, int64_t second,
                  const std::vector<int64_t>& spatial) {
  int64_t offset = first * shape[1] + second;
  for (size_t d = 0; d < spatial.size(); ++d) offset = offset * shape[2 + d] + spatial[d];
  return offset;
}

// A random or hand-made conv problem.
struct ConvCase {
  int64_t batch = 1, in_channels = 1, out_channels = 1, groups = 1;
  Shape input, kernel;
  std::vector<int64_t> stride, dilation;
  bool has_bias = false;

  Shape x_shape() const {
    Shape shape{batch, in_channels};
    shape.insert(shape.end(), input.begin(), input.end());
    return shape;
  }
  Shape w_shape() const {
    Shape shape{out_channels, in_channels / groups};
    shape.insert(shape.end(), kernel.begin(), kernel.end());
    return shape;
  }
  // The output shape straight from the formula, independent of conv_output_shape.
  Shape y_shape() const {
    Shape shape{batch, out_channels};
    for (size_t d = 0; d < input.size(); ++d) {
      const int64_t span = dilation[d] * (kernel[d] - 1) + 1;
      shape.push_back(input[d] < span ? 0 : (input[d] - span) / stride[d] + 1);
    }
    return shape;
  }
  ConvGeometry geometry() const { return {stride, dilation, groups}; }
  std::string str() const {
    return fmt::format("x {} w {} stride {} dilation {} groups {} bias {}", x_shape(), w_shape(),
                       stride, dilation, groups, has_bias);
  }
};

// Random cases over conv1d/2d/3d, kernels 1..5, strides and dilations 1..3, groups 1..3, and
// inputs from a little smaller than the dilated kernel (empty output) to a few outputs more.
ConvCase random_case(std::mt19937_64& rng) {
  auto pick = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  ConvCase conv;
  const int dims = static_cast<int>(pick(1, 3));
  conv.groups = pick(1, 3);
  conv.batch = pick(0, 9) == 0 ? 0 : pick(1, 2);
  conv.in_channels = conv.groups * pick(1, 2);
  conv.out_channels = conv.groups * pick(1, 2);
  conv.has_bias = pick(0, 1) == 1;
  for (int d = 0; d < dims; ++d) {
    conv.kernel.push_back(pick(1, 5));
    conv.stride.push_back(pick(1, 3));
    conv.dilation.push_back(pick(1, 3));
    const int64_t span = conv.dilation[d] * (conv.kernel[d] - 1) + 1;
    const int64_t extra = dims == 3 ? 4 : 9;  // keeps 3-d cases small
    conv.input.push_back(std::max<int64_t>(0, span + pick(-2, extra)));
  }
  return conv;
}

// y[n, co, o] = sum over ci of the group and kernel taps k of x[n, ci, o*s + k*d] * w[co, ci, k]
// (+ b[co]), evaluated one output element at a time.
Array oracle_forward(const ConvCase& conv, const Array& x, const Array& w, const Array* bias) {
  Array y = zeros_array(conv.y_shape());
  const Shape out_extents(y.shape.begin() + 2, y.shape.end());
  const int64_t in_per_group = conv.in_channels / conv.groups;
  const int64_t out_per_group = conv.out_channels / conv.groups;
  std::vector<int64_t> position(conv.input.size());
  for (int64_t n = 0; n < conv.batch; ++n) {
    for (int64_t co = 0; co < conv.out_channels; ++co) {
      const int64_t group = co / out_per_group;
      for_each_index(out_extents, [&](const std::vector<int64_t>& out) {
        double sum = bias != nullptr ? bias->values[co] : 0.0;
        for (int64_t ci = 0; ci < in_per_group; ++ci) {
          for_each_index(conv.kernel, [&](const std::vector<int64_t>& tap) {
            for (size_t d = 0; d < position.size(); ++d)
              position[d] = out[d] * conv.stride[d] + tap[d] * conv.dilation[d];
            sum += x.values[offset_of(x.shape, n, group * in_per_group + ci, position)] *
                   w.values[offset_of(w.shape, co, ci, tap)];
          });
        }
        y.values[offset_of(y.shape, n, co, out)] = sum;
      });
    }
  }
  return y;
}

// Broadcasts bias[c] over y's shape (for the bias term of the adjoint identity).
Array broadcast_bias(const Array& bias, const Shape& y_shape) {
  Array y = zeros_array(y_shape);
  const int64_t plane =
      y_shape[0] * y_shape[1] == 0 ? 0 : shape_numel(y_shape) / (y_shape[0] * y_shape[1]);
  for (int64_t i = 0; i < static_cast<int64_t>(y.values.size()); ++i)
    y.values[i] = bias.values[(i / plane) % y_shape[1]];
  return y;
}

// db[c] = sum of g[n, c, ...] over n and every spatial position.
Array oracle_bias_gradient(const Array& g) {
  Array db = zeros_array({g.shape[1]});
  const int64_t plane =
      g.shape[0] * g.shape[1] == 0 ? 0 : shape_numel(g.shape) / (g.shape[0] * g.shape[1]);
  for (int64_t i = 0; i < static_cast<int64_t>(g.values.size()); ++i)
    db.values[(i / plane) % g.shape[1]] += g.values[i];
  return db;
}

std::vector<ConvCase> random_cases(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<ConvCase> cases;
  for (int i = 0; i < count; ++i) cases.push_back(random_case(rng));
  return cases;
}

TEST(ConvKernels, OutputShapeFollowsValidConvFormula) {
  EXPECT_EQ(conv_output_shape({2, 3, 10}, {4, 3, 3}, {{1}, {1}, 1}), (Shape{2, 4, 8}));
  EXPECT_EQ(conv_output_shape({2, 3, 10}, {4, 3, 3}, {{3}, {2}, 1}), (Shape{2, 4, 2}));
  EXPECT_EQ(conv_output_shape({1, 4, 9, 8}, {6, 2, 4, 2}, {{2, 1}, {1, 3}, 2}),
            (Shape{1, 6, 3, 5}));
  EXPECT_EQ(conv_output_shape({1, 1, 7, 7, 4}, {1, 1, 5, 3, 1}, {{1, 1, 1}, {2, 1, 1}, 1}),
            (Shape{1, 1, 0, 5, 4}));
  // Neither stride nor dilation given: unit ones, rank taken from the input.
  EXPECT_EQ(conv_output_shape({1, 2, 6, 5}, {3, 2, 3, 3}, {}), (Shape{1, 3, 4, 3}));
}

TEST(ConvKernels, ReferenceMatchesDirectFormulaOnRandomCases) {
  std::mt19937_64 rng(11);
  int empty_outputs = 0;
  for (const ConvCase& conv : random_cases(500, 1)) {
    SCOPED_TRACE(conv.str());
    const Array x = random_array(conv.x_shape(), rng);
    const Array w = random_array(conv.w_shape(), rng);
    const Array b = random_array({conv.out_channels}, rng);
    const Array expected = oracle_forward(conv, x, w, conv.has_bias ? &b : nullptr);
    if (shape_numel(Shape(expected.shape.begin() + 2, expected.shape.end())) == 0) ++empty_outputs;
    for (DType dtype : {DType::f64, DType::f32}) {
      const Tensor bias = to_tensor(b, dtype);
      const Tensor y =
          conv_forward(to_tensor(x, dtype), to_tensor(w, dtype), conv.has_bias ? &bias : nullptr,
                       conv.geometry(), ConvBackend::reference);
      EXPECT_EQ(y.dtype(), dtype);
      expect_close(to_array(y), expected, dtype == DType::f64 ? 1e-12 : 1e-5,
                   std::string("forward ") + std::string(dtype_name(dtype)));
    }
  }
  EXPECT_GT(empty_outputs, 5) << "the random cases should include empty outputs";
}

// <conv(x, w) + b, g> == <x, backward_data(g, w)> + <b, backward_bias(g)>
//                     == <w, backward_weight(x, g)> + <b, backward_bias(g)>
TEST(ConvKernels, ReferenceBackwardIsAdjointOfForward) {
  std::mt19937_64 rng(12);
  for (const ConvCase& conv : random_cases(500, 2)) {
    SCOPED_TRACE(conv.str());
    const Array x = random_array(conv.x_shape(), rng);
    const Array w = random_array(conv.w_shape(), rng);
    const Array b = random_array({conv.out_channels}, rng);
    const Array g = random_array(conv.y_shape(), rng);
    const Tensor xt = to_tensor(x, DType::f64), wt = to_tensor(w, DType::f64);
    const Tensor bt = to_tensor(b, DType::f64), gt = to_tensor(g, DType::f64);
    const Array y = to_array(conv_forward(xt, wt, &bt, conv.geometry(), ConvBackend::reference));
    const Array dx = to_array(
        conv_backward_data(gt, wt, conv.x_shape(), conv.geometry(), ConvBackend::reference));
    const Array dw = to_array(
        conv_backward_weight(xt, gt, conv.w_shape(), conv.geometry(), ConvBackend::reference));
    const Array db = to_array(conv_backward_bias(gt));
    ASSERT_EQ(dx.shape, conv.x_shape());
    ASSERT_EQ(dw.shape, conv.w_shape());
    ASSERT_EQ(db.shape, Shape{conv.out_channels});

    const double bias_term = dot(b, db);
    const double scale = std::max(norm(y) * norm(g), 1e-30);
    const double forward_side = dot(y, g);
    EXPECT_NEAR(dot(x, dx) + bias_term, forward_side, 1e-9 * scale);
    EXPECT_NEAR(dot(w, dw) + bias_term, forward_side, 1e-9 * scale);
    EXPECT_NEAR(bias_term, dot(broadcast_bias(b, conv.y_shape()), g), 1e-9 * scale);
  }
}

TEST(ConvKernels, OnednnMatchesReferenceOnRandomCases) {
  if (!conv_onednn_available()) GTEST_SKIP() << "built without oneDNN";
  std::mt19937_64 rng(13);
  for (const ConvCase& conv : random_cases(250, 3)) {
    SCOPED_TRACE(conv.str());
    const Tensor x = to_tensor(random_array(conv.x_shape(), rng), DType::f32);
    const Tensor w = to_tensor(random_array(conv.w_shape(), rng), DType::f32);
    const Tensor b = to_tensor(random_array({conv.out_channels}, rng), DType::f32);
    const Tensor g = to_tensor(random_array(conv.y_shape(), rng), DType::f32);
    const Tensor* bias = conv.has_bias ? &b : nullptr;
    const ConvGeometry geometry = conv.geometry();
    for (ConvBackend backend : {ConvBackend::onednn, ConvBackend::automatic}) {
      expect_close(to_array(conv_forward(x, w, bias, geometry, backend)),
                   to_array(conv_forward(x, w, bias, geometry, ConvBackend::reference)), 1e-4,
                   "forward");
      expect_close(
          to_array(conv_backward_data(g, w, conv.x_shape(), geometry, backend)),
          to_array(conv_backward_data(g, w, conv.x_shape(), geometry, ConvBackend::reference)),
          1e-4, "backward data");
      expect_close(
          to_array(conv_backward_weight(x, g, conv.w_shape(), geometry, backend)),
          to_array(conv_backward_weight(x, g, conv.w_shape(), geometry, ConvBackend::reference)),
          1e-4, "backward weight");
    }
  }
}

// Padding given to the kernels equals a conv of the input zero-padded by hand: oneDNN takes it
// itself, the reference through the dispatcher's padded copy; asymmetric padding, padding past
// the kernel, and inputs of extent 0 (all padding) included.
TEST(ConvKernels, PaddingEqualsConvOfTheZeroPaddedInput) {
  std::mt19937_64 rng(14);
  auto pick = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int all_padding = 0;
  for (ConvCase conv : random_cases(300, 4)) {
    ConvGeometry padded = conv.geometry();
    for (size_t d = 0; d < conv.input.size(); ++d) {
      if (pick(0, 5) == 0) conv.input[d] = 0;
      padded.pad_lo.push_back(pick(0, 3));
      padded.pad_hi.push_back(pick(0, 3));
    }
    SCOPED_TRACE(fmt::format("{} padding {} / {}", conv.str(), padded.pad_lo, padded.pad_hi));
    // The padded input written out, and where x sits in it.
    Shape big = conv.x_shape();
    Box inside = Box::of_shape(big);
    for (size_t d = 0; d < conv.input.size(); ++d) {
      big[2 + d] += padded.pad_lo[d] + padded.pad_hi[d];
      inside.lo[2 + d] += padded.pad_lo[d];
      inside.hi[2 + d] += padded.pad_lo[d];
      all_padding += conv.input[d] == 0 ? 1 : 0;
    }
    ConvCase big_conv = conv;
    big_conv.input.assign(big.begin() + 2, big.end());
    const Shape y_shape = big_conv.y_shape();
    ASSERT_EQ(conv_output_shape(conv.x_shape(), conv.w_shape(), padded), y_shape);
    std::vector<DType> dtypes{DType::f64};
    if (conv_onednn_available()) dtypes.push_back(DType::f32);
    for (DType dtype : dtypes) {
      const double tolerance = dtype == DType::f64 ? 1e-12 : 1e-4;
      const Tensor x = to_tensor(random_array(conv.x_shape(), rng), dtype);
      const Tensor w = to_tensor(random_array(conv.w_shape(), rng), dtype);
      const Tensor b = to_tensor(random_array({conv.out_channels}, rng), dtype);
      const Tensor g = to_tensor(random_array(y_shape, rng), dtype);
      const Tensor* bias = conv.has_bias ? &b : nullptr;
      Tensor x_big = Tensor::zeros(big, dtype);
      x_big.view_box(inside).copy_from(x);
      const ConvGeometry plain = conv.geometry();
      const ConvBackend backend =
          dtype == DType::f32 ? ConvBackend::onednn : ConvBackend::reference;
      expect_close(to_array(conv_forward(x, w, bias, padded, backend)),
                   to_array(conv_forward(x_big, w, bias, plain, ConvBackend::reference)), tolerance,
                   "forward");
      Tensor y_into = Tensor::empty(y_shape, dtype);
      conv_forward_into(x, w, bias, padded, y_into, backend);
      expect_close(to_array(y_into),
                   to_array(conv_forward(x_big, w, bias, plain, ConvBackend::reference)), tolerance,
                   "forward into");
      const Tensor dx_big = conv_backward_data(g, w, big, plain, ConvBackend::reference);
      expect_close(to_array(conv_backward_data(g, w, conv.x_shape(), padded, backend)),
                   to_array(dx_big.view_box(inside).contiguous()), tolerance, "backward data");
      expect_close(
          to_array(conv_backward_weight(x, g, conv.w_shape(), padded, backend)),
          to_array(conv_backward_weight(x_big, g, conv.w_shape(), plain, ConvBackend::reference)),
          tolerance, "backward weight");
    }
  }
  EXPECT_GT(all_padding, 10) << "the cases should include inputs that are all padding";
}

TEST(ConvKernels, StridedInputsGiveTheSameResultAsContiguousOnes) {
  std::mt19937_64 rng(14);
  ConvCase conv;
  conv.batch = 2, conv.in_channels = 4, conv.out_channels = 6, conv.groups = 2;
  conv.input = {7, 9}, conv.kernel = {3, 2}, conv.stride = {2, 1}, conv.dilation = {1, 2};
  // Views that skip the first and last columns of larger tensors.
  Shape big_x = conv.x_shape(), big_w = conv.w_shape(), big_g = conv.y_shape();
  big_x.back() += 2, big_w.back() += 2, big_g.back() += 2;
  const Tensor x =
      to_tensor(random_array(big_x, rng), DType::f64).slice(3, 1, 1 + conv.input.back());
  const Tensor w =
      to_tensor(random_array(big_w, rng), DType::f64).slice(3, 1, 1 + conv.kernel.back());
  const Tensor g =
      to_tensor(random_array(big_g, rng), DType::f64).slice(3, 1, 1 + conv.y_shape().back());
  ASSERT_FALSE(x.is_contiguous());
  std::vector<ConvBackend> backends{ConvBackend::reference};
  if (conv_onednn_available()) backends.push_back(ConvBackend::onednn);
  for (ConvBackend backend : backends) {
    const DType dtype = backend == ConvBackend::onednn ? DType::f32 : DType::f64;
    const Tensor xs = x.to_dtype(dtype), ws = w.to_dtype(dtype), gs = g.to_dtype(dtype);
    const ConvGeometry geometry = conv.geometry();
    EXPECT_TRUE(bitwise_equal(conv_forward(xs, ws, nullptr, geometry, backend),
                              conv_forward(xs.clone(), ws.clone(), nullptr, geometry, backend)));
    EXPECT_TRUE(bitwise_equal(
        conv_backward_data(gs, ws, conv.x_shape(), geometry, backend),
        conv_backward_data(gs.clone(), ws.clone(), conv.x_shape(), geometry, backend)));
    EXPECT_TRUE(bitwise_equal(
        conv_backward_weight(xs, gs, conv.w_shape(), geometry, backend),
        conv_backward_weight(xs.clone(), gs.clone(), conv.w_shape(), geometry, backend)));
    EXPECT_TRUE(bitwise_equal(conv_backward_bias(gs), conv_backward_bias(gs.clone())));
  }
}

// Local-backend ranks are threads that call the kernels at the same time; the oneDNN path keeps
// its engine, stream and primitive cache per thread.
TEST(ConvKernels, ConcurrentCallsFromSeveralThreadsMatchSerialOnes) {
  std::vector<ConvCase> cases = random_cases(40, 4);
  std::erase_if(cases, [](const ConvCase& conv) { return shape_numel(conv.y_shape()) == 0; });
  std::mt19937_64 rng(16);
  std::vector<Tensor> xs, ws, expected;
  for (const ConvCase& conv : cases) {
    xs.push_back(to_tensor(random_array(conv.x_shape(), rng), DType::f32));
    ws.push_back(to_tensor(random_array(conv.w_shape(), rng), DType::f32));
    expected.push_back(conv_forward(xs.back(), ws.back(), nullptr, conv.geometry()));
  }
  constexpr int kThreads = 4;
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Every thread runs every case, each starting at a different one.
      for (int round = 0; round < 3; ++round)
        for (size_t k = 0; k < cases.size(); ++k) {
          const size_t i = (k + 7 * t) % cases.size();
          const Tensor y = conv_forward(xs[i], ws[i], nullptr, cases[i].geometry());
          if (!bitwise_equal(y, expected[i])) ++mismatches[t];
        }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

// Every backend and dtype combination that can run.
std::vector<std::pair<ConvBackend, DType>> runnable_backends() {
  std::vector<std::pair<ConvBackend, DType>> result{{ConvBackend::reference, DType::f64},
                                                    {ConvBackend::reference, DType::f32},
                                                    {ConvBackend::automatic, DType::f64},
                                                    {ConvBackend::automatic, DType::f32}};
  if (conv_onednn_available()) result.emplace_back(ConvBackend::onednn, DType::f32);
  return result;
}

TEST(ConvKernels, EmptyProblemsGiveCorrectlyShapedZeroResults) {
  std::vector<ConvCase> cases;
  ConvCase base;
  base.batch = 2, base.in_channels = 2, base.out_channels = 3, base.input = {6, 5},
  base.kernel = {3, 2}, base.stride = {1, 2}, base.dilation = {2, 1}, base.has_bias = true;
  cases.push_back(base);
  cases.back().batch = 0;  // no batch items
  cases.push_back(base);
  cases.back().input = {4, 5};  // input smaller than the dilated kernel: output extent 0
  cases.push_back(base);
  cases.back().input = {6, 0};  // empty input
  cases.push_back(base);
  cases.back().in_channels = 0;  // no input channels: y is the bias
  cases.push_back(base);
  cases.back().out_channels = 0;  // no output channels
  cases.push_back(base);
  cases.back().input = {1}, cases.back().kernel = {5}, cases.back().stride = {3},
  cases.back().dilation = {3};  // conv1d with an empty output
  cases.push_back(base);
  cases.back().input = {2, 9, 9}, cases.back().kernel = {3, 1, 1}, cases.back().stride = {1, 1, 1},
  cases.back().dilation = {1, 1, 1};  // conv3d, empty depth

  std::mt19937_64 rng(15);
  for (const ConvCase& conv : cases) {
    SCOPED_TRACE(conv.str());
    const Array x = random_array(conv.x_shape(), rng);
    const Array w = random_array(conv.w_shape(), rng);
    const Array b = random_array({conv.out_channels}, rng);
    const Array g = random_array(conv.y_shape(), rng);
    const Array expected_y = oracle_forward(conv, x, w, &b);
    for (auto [backend, dtype] : runnable_backends()) {
      const Tensor xt = to_tensor(x, dtype), wt = to_tensor(w, dtype);
      const Tensor bt = to_tensor(b, dtype), gt = to_tensor(g, dtype);
      expect_close(to_array(conv_forward(xt, wt, &bt, conv.geometry(), backend)), expected_y, 1e-5,
                   "forward");
      const Tensor dx = conv_backward_data(gt, wt, conv.x_shape(), conv.geometry(), backend);
      const Tensor dw = conv_backward_weight(xt, gt, conv.w_shape(), conv.geometry(), backend);
      EXPECT_EQ(dx.dtype(), dtype);
      EXPECT_EQ(dw.dtype(), dtype);
      expect_close(to_array(dx), zeros_array(conv.x_shape()), 0.0, "backward data");
      expect_close(to_array(dw), zeros_array(conv.w_shape()), 0.0, "backward weight");
      expect_close(to_array(conv_backward_bias(gt)), oracle_bias_gradient(g), 1e-5,
                   "backward bias");
    }
  }
}

// Expects `call` to throw `ErrorType` with exactly `message`.
template <typename ErrorType, typename Call>
void expect_error(Call&& call, const std::string& message) {
  try {
    call();
    ADD_FAILURE() << "expected an error: " << message;
  } catch (const ErrorType& error) {
    EXPECT_EQ(std::string(error.what()), message);
  }
}

TEST(ConvKernels, RejectsNegativeOrMisshapedPadding) {
  const Tensor x = Tensor::zeros({1, 1, 5}, DType::f64);
  const Tensor w = Tensor::zeros({1, 1, 3}, DType::f64);
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x, w, nullptr, {{1}, {1}, 1, {-1}, {0}});
      },
      "[conv] padding (-1, 0) along spatial dim 0 must be >= 0");
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x, w, nullptr, {{1}, {1}, 1, {1, 1}, {1, 1}});
      },
      "[conv] padding has 2 entries, expected 1 (one per spatial dim)");
}

// cpu convs of f16 and bf16 tensors run through f32: forward and the three backward kernels
// equal the f32 kernels on the half values (converted exactly), rounded to the dtype once.
TEST(ConvKernels, HalfDtypesOnCpuEqualTheF32KernelsRoundedOnce) {
  std::mt19937_64 rng(11);
  const ConvGeometry geometry{{1, 2}, {1, 1}, 1, {1, 0}, {1, 2}};
  for (DType half : {DType::bf16, DType::f16}) {
    const Tensor x = to_tensor(random_array({2, 4, 7, 9}, rng), half);
    const Tensor w = to_tensor(random_array({3, 4, 3, 2}, rng), half);
    const Tensor b = to_tensor(random_array({3}, rng), half);
    const Tensor y = conv_forward(x, w, &b, geometry);
    const Tensor b32 = b.to_dtype(DType::f32);
    const Tensor expected =
        conv_forward(x.to_dtype(DType::f32), w.to_dtype(DType::f32), &b32, geometry).to_dtype(half);
    ASSERT_EQ(y.dtype(), half);
    EXPECT_EQ(to_array(y).values, to_array(expected).values) << dtype_name(half);
    const Tensor dy = to_tensor(random_array(y.shape(), rng), half);
    EXPECT_EQ(to_array(conv_backward_data(dy, w, x.shape(), geometry)).values,
              to_array(conv_backward_data(dy.to_dtype(DType::f32), w.to_dtype(DType::f32),
                                          x.shape(), geometry)
                           .to_dtype(half))
                  .values);
    EXPECT_EQ(to_array(conv_backward_weight(x, dy, w.shape(), geometry)).values,
              to_array(conv_backward_weight(x.to_dtype(DType::f32), dy.to_dtype(DType::f32),
                                            w.shape(), geometry)
                           .to_dtype(half))
                  .values);
    EXPECT_EQ(to_array(conv_backward_bias(dy)).values,
              to_array(conv_backward_bias(dy.to_dtype(DType::f32)).to_dtype(half)).values);
  }
}

TEST(ConvKernels, RejectsBadArgumentsWithMessagesNamingTheValues) {
  const Tensor x3 = Tensor::zeros({2, 6, 8, 8, 8}, DType::f32);
  const Tensor w3 = Tensor::zeros({4, 3, 3, 3, 3}, DType::f32);
  const ConvGeometry conv3d{{1, 1, 1}, {1, 1, 1}, 1};
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(Tensor::zeros({2, 3, 4}, DType::f32), w3, nullptr, conv3d);
      },
      "[conv] expected a 5-d input for conv3d, got shape (2,3,4)");
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x3, Tensor::zeros({4, 3, 3}, DType::f32), nullptr, conv3d);
      },
      "[conv] expected a 5-d weight for conv3d, got shape (4,3,3)");
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x3, Tensor::zeros({4, 1, 3, 3, 3}, DType::f32), nullptr,
                     {{1, 1, 1}, {1, 1, 1}, 4});
      },
      "[conv] input channels 6 not divisible by groups 4");
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x3, Tensor::zeros({5, 3, 3, 3, 3}, DType::f32), nullptr,
                     {{1, 1, 1}, {1, 1, 1}, 2});
      },
      "[conv] output channels 5 not divisible by groups 2");
  expect_error<InvalidArgument>(
      [&] { conv_forward(x3, w3, nullptr, conv3d); },
      "[conv] weight shape (4,3,3,3,3) has 3 input channels per group, expected 6 (input "
      "channels 6 / groups 1)");
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x3, w3, nullptr, {{1, 0, 1}, {1, 1, 1}, 2});
      },
      "[conv] stride 0 along spatial dim 1 must be >= 1");
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x3, w3, nullptr, {{1, 1, 1}, {1, 1, -2}, 2});
      },
      "[conv] dilation -2 along spatial dim 2 must be >= 1");
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x3, w3, nullptr, {{1, 1}, {1, 1, 1}, 2});
      },
      "[conv] dilation has 3 entries, expected 2 (one per spatial dim)");
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x3, Tensor::zeros({4, 3, 3, 3, 3}, DType::f64), nullptr,
                     {{1, 1, 1}, {1, 1, 1}, 2});
      },
      "[conv] x is f32 but w is f64");
  const Tensor bad_bias = Tensor::zeros({3}, DType::f32);
  expect_error<InvalidArgument>(
      [&] {
        conv_forward(x3, w3, &bad_bias, {{1, 1, 1}, {1, 1, 1}, 2});
      },
      "[conv] bias has shape (3), expected (4) (one entry per output channel)");
  expect_error<InvalidArgument>(
      [&] {
        conv_backward_data(Tensor::zeros({2, 4, 6, 6, 5}, DType::f32), w3, x3.shape(),
                           {{1, 1, 1}, {1, 1, 1}, 2});
      },
      "[conv] dy has shape (2,4,6,6,5), expected (2,4,6,6,6) (the output of input "
      "(2,6,8,8,8) and weight (4,3,3,3,3))");
  // A valid conv of an input smaller than the dilated kernel is legal: its output is empty.
  EXPECT_EQ(conv_forward(x3, w3, nullptr, {{1, 1, 1}, {1, 4, 1}, 2}).shape(),
            (Shape{2, 4, 6, 0, 6}));
}

TEST(ConvKernels, OnednnBackendRejectsF64AndMissingBuild) {
  const Tensor x = Tensor::zeros({1, 2, 5}, DType::f64);
  const Tensor w = Tensor::zeros({2, 2, 3}, DType::f64);
  const ConvGeometry geometry{{1}, {1}, 1};
  if (conv_onednn_available()) {
    expect_error<InvalidArgument>(
        [&] { conv_forward(x, w, nullptr, geometry, ConvBackend::onednn); },
        "[conv] backend onednn supports f32 only, got f64");
  } else {
    expect_error<NotAvailable>(
        [&] {
          conv_forward(x.to_dtype(DType::f32), w.to_dtype(DType::f32), nullptr, geometry,
                       ConvBackend::onednn);
        },
        "[conv] backend onednn requested but Tessera was built without oneDNN");
  }
  // f64 under automatic always takes the reference path.
  EXPECT_EQ(conv_forward(x, w, nullptr, geometry).shape(), (Shape{1, 2, 3}));
}

// ---- PyTorch fixtures -------------------------------------------------------------------

using Json = nlohmann::json;
using Padding = std::vector<std::pair<int64_t, int64_t>>;  // [lo, hi] per spatial dim

const std::string kFixtureDir = std::string(TESSERA_FIXTURE_DIR) + "/conv/";

Array read_fixture(const std::string& file, const Shape& shape) {
  Array array = zeros_array(shape);
  std::ifstream in(kFixtureDir + file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open fixture " + kFixtureDir + file);
  in.read(reinterpret_cast<char*>(array.values.data()),
          static_cast<std::streamsize>(array.values.size() * sizeof(double)));
  if (in.gcount() != static_cast<std::streamsize>(array.values.size() * sizeof(double)))
    throw std::runtime_error("fixture " + file + " is shorter than its shape");
  return array;
}

// The padded index `padded` of a dim with extent `extent` and low padding `lo` maps to this
// input index, or -1 when it lies in zero padding.
int64_t source_index(int64_t padded, int64_t lo, int64_t extent, bool circular) {
  const int64_t index = padded - lo;
  if (circular) return ((index % extent) + extent) % extent;
  return index >= 0 && index < extent ? index : -1;
}

// x padded along its spatial dims with zeros or circularly.
Array pad_input(const Array& x, const Padding& padding, bool circular) {
  Shape padded_shape = x.shape;
  for (size_t d = 0; d < padding.size(); ++d)
    padded_shape[2 + d] += padding[d].first + padding[d].second;
  Array padded = zeros_array(padded_shape);
  std::vector<int64_t> source(padding.size());
  for_each_index(padded_shape, [&](const std::vector<int64_t>& index) {
    for (size_t d = 0; d < padding.size(); ++d) {
      source[d] = source_index(index[2 + d], padding[d].first, x.shape[2 + d], circular);
      if (source[d] < 0) return;
    }
    padded.values[offset_of(padded_shape, index[0], index[1],
                            std::vector<int64_t>(index.begin() + 2, index.end()))] =
        x.values[offset_of(x.shape, index[0], index[1], source)];
  });
  return padded;
}

// The adjoint of pad_input: the gradient of the padded input folded back onto the input
// (zero padding is dropped, circular padding adds into the wrapped positions).
Array fold_padding(const Array& padded, const Shape& x_shape, const Padding& padding,
                   bool circular) {
  Array folded = zeros_array(x_shape);
  std::vector<int64_t> source(padding.size());
  for_each_index(padded.shape, [&](const std::vector<int64_t>& index) {
    for (size_t d = 0; d < padding.size(); ++d) {
      source[d] = source_index(index[2 + d], padding[d].first, x_shape[2 + d], circular);
      if (source[d] < 0) return;
    }
    folded.values[offset_of(x_shape, index[0], index[1], source)] += padded.values[offset_of(
        padded.shape, index[0], index[1], std::vector<int64_t>(index.begin() + 2, index.end()))];
  });
  return folded;
}

void check_against_pytorch(ConvBackend backend, DType dtype, double tolerance) {
  std::ifstream manifest_file(kFixtureDir + "manifest.json");
  ASSERT_TRUE(manifest_file) << "missing " << kFixtureDir << "manifest.json";
  const Json manifest = Json::parse(manifest_file);
  ASSERT_GE(manifest["cases"].size(), 20u);
  for (const Json& fixture : manifest["cases"]) {
    SCOPED_TRACE(fixture["name"].get<std::string>());
    const Shape x_shape = fixture["x_shape"].get<Shape>();
    const Shape w_shape = fixture["w_shape"].get<Shape>();
    const Shape y_shape = fixture["y_shape"].get<Shape>();
    const Padding padding = fixture["padding"].get<Padding>();
    const bool circular = fixture["padding_mode"].get<std::string>() == "circular";
    const bool has_bias = fixture["has_bias"].get<bool>();
    const ConvGeometry geometry{fixture["stride"].get<std::vector<int64_t>>(),
                                fixture["dilation"].get<std::vector<int64_t>>(),
                                fixture["groups"].get<int64_t>()};
    const Json& files = fixture["files"];
    const Array x = read_fixture(files["x"], x_shape);
    const Array w = read_fixture(files["w"], w_shape);
    const Array gy = read_fixture(files["gy"], y_shape);

    const Array padded_x = pad_input(x, padding, circular);
    const Tensor xt = to_tensor(padded_x, dtype), wt = to_tensor(w, dtype);
    const Tensor gyt = to_tensor(gy, dtype);
    Tensor bt;
    if (has_bias) bt = to_tensor(read_fixture(files["b"], {w_shape[0]}), dtype);

    expect_close(to_array(conv_forward(xt, wt, has_bias ? &bt : nullptr, geometry, backend)),
                 read_fixture(files["y"], y_shape), tolerance, "y");
    const Array padded_gx =
        to_array(conv_backward_data(gyt, wt, padded_x.shape, geometry, backend));
    expect_close(fold_padding(padded_gx, x_shape, padding, circular),
                 read_fixture(files["gx"], x_shape), tolerance, "gx");
    expect_close(to_array(conv_backward_weight(xt, gyt, w_shape, geometry, backend)),
                 read_fixture(files["gw"], w_shape), tolerance, "gw");
    if (has_bias)
      expect_close(to_array(conv_backward_bias(gyt)), read_fixture(files["gb"], {w_shape[0]}),
                   tolerance, "gb");
  }
}

TEST(ConvKernels, ReferenceF64MatchesPyTorchFixtures) {
  check_against_pytorch(ConvBackend::reference, DType::f64, 1e-10);
}

TEST(ConvKernels, ReferenceF32MatchesPyTorchFixtures) {
  check_against_pytorch(ConvBackend::reference, DType::f32, 1e-4);
}

TEST(ConvKernels, OnednnF32MatchesPyTorchFixtures) {
  if (!conv_onednn_available()) GTEST_SKIP() << "built without oneDNN";
  check_against_pytorch(ConvBackend::onednn, DType::f32, 1e-4);
}

}  // namespace
}  // namespace tessera::ops
