// The typed cpu loops of the pointwise ops (ops/pointwise/pointwise_cpu.hpp): f32 results
// within float rounding of the f64 ones for every unary op forward and backward, the conventions
// at special values in f32 (NaN, infinities, kinks), and broadcast operands read through stride 0
// equal to the same op on the expanded operand, with the broadcast gradient summed exactly.
#include "ops/pointwise/pointwise_cpu.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ops/pointwise/broadcast.hpp"
#include "ops/pointwise/pointwise_math.hpp"

namespace tessera::ops {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// Values in [-6, 6] (seeded) plus 0, -0 and the kinks of relu and clamp.
std::vector<double> sample_values(bool positive) {
  std::mt19937_64 random(7);
  std::uniform_real_distribution<double> uniform(positive ? 0.01 : -6.0, 6.0);
  std::vector<double> values = {0.0, -0.0, 0.25, -0.25, 1.0, -1.0};
  if (positive) values = {0.01, 0.25, 1.0, 4.0};
  for (int i = 0; i < 5000; ++i) values.push_back(uniform(random));
  return values;
}

Tensor tensor_of(const std::vector<double>& values, DType dtype) {
  return Tensor::from_values<double>({static_cast<int64_t>(values.size())}, values).to_dtype(dtype);
}

std::vector<double> values_of(const Tensor& t) {
  const Tensor wide = t.to_dtype(DType::f64);
  return {wide.data<double>(), wide.data<double>() + wide.numel()};
}

TEST(PointwiseCpu, UnaryF32WithinFloatRoundingOfF64) {
  for (const UnaryMath& math : unary_math) {
    const std::string name = math.name;
    const bool positive = name == "sqrt" || name == "log";
    const double a = name == "clamp"        ? -0.25
                     : name == "softplus"   ? 1.0
                     : name == "scale"      ? 1.5
                     : name == "leaky_relu" ? 0.01
                                            : 0.0;
    const double b = name == "clamp" ? 0.25 : name == "softplus" ? 20.0 : 0.0;
    const std::vector<double> xs = sample_values(positive);
    std::vector<double> gs = sample_values(false);
    gs.resize(xs.size());
    for (DType dtype : {DType::f64, DType::f32}) {
      const Tensor x = tensor_of(xs, dtype), g = tensor_of(gs, dtype);
      const std::vector<double> y = values_of(*unary_forward_cpu(name, x, a, b));
      const Tensor v = math.reads_output ? unary_forward_cpu(name, x, a, b)->to_dtype(dtype) : x;
      const std::vector<double> dx = values_of(*unary_backward_cpu(name, v, g, a, b));
      // f64: pointwise_math's formulas up to contractions into fused multiply-adds; f32: within a
      // few float roundings of them (relative, or absolute next to zeros of the function).
      const double tolerance = dtype == DType::f64 ? 1e-15 : 4e-7;
      for (size_t i = 0; i < xs.size(); ++i) {
        const double x64 = dtype == DType::f64 ? xs[i] : double(float(xs[i]));
        const double g64 = dtype == DType::f64 ? gs[i] : double(float(gs[i]));
        const UnaryParams p{dtype == DType::f64 ? a : double(float(a)),
                            dtype == DType::f64 ? b : double(float(b))};
        const double want = math.forward(x64, p);
        const double y64 =
            math.reads_output ? (dtype == DType::f64 ? want : double(float(want))) : 0.0;
        const double want_dx = math.derivative(x64, y64, p) * g64;
        EXPECT_LE(std::fabs(y[i] - want), tolerance * (1 + std::fabs(want)))
            << name << " f" << (dtype == DType::f64 ? 64 : 32) << " x = " << x64;
        EXPECT_LE(std::fabs(dx[i] - want_dx), 2 * tolerance * (1 + std::fabs(want_dx)))
            << name << " backward f" << (dtype == DType::f64 ? 64 : 32) << " x = " << x64;
      }
    }
  }
}

TEST(PointwiseCpu, F32SpecialValuesKeepTheirConventions) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto f32 = [](const std::string& name, double x, double a = 0, double b = 0) {
    return values_of(*unary_forward_cpu(name, tensor_of({x}, DType::f32), a, b))[0];
  };
  EXPECT_TRUE(std::isnan(f32("exp", nan)));
  EXPECT_EQ(f32("exp", -kInf), 0.0);
  EXPECT_EQ(f32("exp", 100.0), kInf);
  EXPECT_EQ(f32("log", 0.0), -kInf);
  EXPECT_TRUE(std::isnan(f32("log", -1.0)));
  EXPECT_EQ(f32("tanh", kInf), 1.0);
  EXPECT_EQ(f32("sigmoid", -kInf), 0.0);
  EXPECT_TRUE(std::isnan(f32("clamp", nan, -1, 1)));
  EXPECT_EQ(f32("clamp", 5.0, -kInf, 1), 1.0);
  EXPECT_EQ(f32("clamp", -5.0, -kInf, kInf), -5.0);
  EXPECT_EQ(f32("clamp", 0.0, 1, -1), -1.0);         // min > max: max wins
  EXPECT_EQ(f32("softplus", 100.0, 1, 200), 100.0);  // no overflow inside the threshold
  EXPECT_NEAR(f32("softplus", -100.0, 1, 20), std::exp(-100.0), 1.5e-45);  // a subnormal
  // maximum propagates NaN from either side and splits a tie's gradient.
  const Tensor a = tensor_of({nan, 1.0, 2.0}, DType::f32),
               b = tensor_of({1.0, nan, 2.0}, DType::f32);
  const OperandView same{a.strides(), 0};
  const std::vector<double> z = values_of(*binary_forward_cpu("maximum", a, b, same, false));
  EXPECT_TRUE(std::isnan(z[0]) && std::isnan(z[1]));
  EXPECT_EQ(z[2], 2.0);
  const auto grads =
      binary_backward_cpu("maximum", a, b, same, tensor_of({1, 1, 1}, DType::f32), false);
  EXPECT_EQ(values_of(grads->first)[2], 0.5);
  EXPECT_EQ(values_of(grads->second)[2], 0.5);
  // pow's zero cases: d/dx is 0 where the exponent is 0, d/dy 0 where the base is 0.
  const Tensor base = tensor_of({0.0, 2.0}, DType::f32),
               exponent = tensor_of({2.0, 0.0}, DType::f32);
  const auto pow_grads = binary_backward_cpu("pow", base, exponent, OperandView{base.strides(), 0},
                                             tensor_of({1, 1}, DType::f32), false);
  EXPECT_EQ(values_of(pow_grads->first)[1], 0.0);
  EXPECT_EQ(values_of(pow_grads->second)[0], 0.0);
}

TEST(PointwiseCpu, BroadcastOperandThroughStrideZeroEqualsExpanded) {
  // x [2, 3, 4, 5] and b [3] aligned with dim 1 (bias_add), on the local box [1, 1:3, 0:4, 2:5].
  const Box box{{1, 1, 0, 2}, {2, 3, 4, 5}};
  std::mt19937_64 random(3);
  std::uniform_real_distribution<double> uniform(-1, 1);
  std::vector<double> xs(static_cast<size_t>(shape_numel(box.shape()))), bs(3), gs(xs.size());
  for (double& v : xs) v = uniform(random);
  for (double& v : bs) v = uniform(random);
  for (double& v : gs) v = uniform(random);
  for (DType dtype : {DType::f64, DType::f32}) {
    const Tensor x = Tensor::from_values<double>(box.shape(), xs).to_dtype(dtype);
    const Tensor b = Tensor::from_values<double>({3}, bs).to_dtype(dtype);
    const Tensor g = Tensor::from_values<double>(box.shape(), gs).to_dtype(dtype);
    const OperandView view = broadcast_operand_view(b.shape(), b.strides(), box.lo, 1);
    const Tensor expanded = expand_to_box(b, box, 1);
    const OperandView dense{x.strides(), 0};
    for (const char* name : {"add", "mul", "div", "maximum"}) {
      for (bool swapped : {false, true}) {
        EXPECT_EQ(values_of(*binary_forward_cpu(name, x, b, view, swapped)),
                  values_of(*binary_forward_cpu(name, x, expanded, dense, swapped)))
            << name;
        const auto strided = binary_backward_cpu(name, x, b, view, g, swapped);
        const auto full = binary_backward_cpu(name, x, expanded, dense, g, swapped);
        EXPECT_EQ(values_of(strided->first), values_of(full->first)) << name;
        EXPECT_EQ(values_of(strided->second), values_of(full->second)) << name;
        // The broadcast gradient summed onto b's shape equals the general reduction.
        const OperandView sums_view =
            broadcast_operand_view({3}, contiguous_strides({3}), box.lo, 1);
        const std::vector<double> summed =
            values_of(*reduce_to_view_cpu(strided->second, {3}, sums_view));
        const std::vector<double> reference =
            values_of(reduce_to_operand(strided->second, {3}, box, 1));
        for (size_t i = 0; i < summed.size(); ++i)
          EXPECT_NEAR(summed[i], reference[i],
                      (dtype == DType::f64 ? 1e-12 : 1e-6) * (1 + std::fabs(reference[i])))
              << name;
        EXPECT_EQ(summed[0], 0.0);  // outside the box: other ranks' part
      }
    }
  }
}

TEST(PointwiseCpu, PowConstantExponentFastPathsEqualStdPow) {
  // A constant exponent (an operand read through stride 0) of 2, 3, 0.5 or -1 takes a product,
  // square root or quotient in f32: bit for bit std::pow in double rounded to float, special
  // values and signs of zeros included.
  std::vector<double> xs = sample_values(false);
  for (double v : {kInf, -kInf, std::numeric_limits<double>::quiet_NaN(), 1e-45, -1e-45, 3e38,
                   -3e38, 1e20, -1e-20, 1.000244140625})  // the last: x^2 a float midpoint
    xs.push_back(v);
  const Tensor x = tensor_of(xs, DType::f32);
  for (double c : {2.0, 3.0, 0.5, -1.0}) {
    const Tensor fast = *binary_forward_cpu("pow", x, tensor_of({c}, DType::f32), {{0}, 0}, false);
    for (size_t i = 0; i < xs.size(); ++i) {
      const float base = x.data<float>()[i];
      const float want = static_cast<float>(std::pow(double(base), c));
      const float got = fast.data<float>()[i];
      if (std::isnan(want))
        EXPECT_TRUE(std::isnan(got)) << base << " ^ " << c;
      else
        EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
            << base << " ^ " << c;
    }
  }
}

}  // namespace
}  // namespace tessera::ops
