// The branch-free f32 functions of ops/pointwise/vector_math.hpp against <cmath> in double: the
// error in ulps of the float result over a seeded sweep of every binade (both signs, subnormals
// included) and the special values (0, -0, +-inf, NaN, the smallest subnormal, the largest
// float, the ends of each function's ranges).
#include "ops/pointwise/vector_math.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace tessera::ops {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

/// The distance in ulps between `got` and the exact value `want` (double): |got - want| over the
/// float spacing at want (the subnormal spacing below the normals). Matching non-finite values
/// (same infinity, both NaN) count 0; a mismatch counts infinity.
double ulp_error(float got, double want) {
  if (std::isnan(want) || std::isnan(got))
    return std::isnan(want) && std::isnan(got) ? 0 : std::numeric_limits<double>::infinity();
  if (std::isinf(want) || std::isinf(got)) {
    // A finite want past the largest float rounds to infinity.
    const double rounded = std::fabs(want) > std::numeric_limits<float>::max() * (1 + 0x1p-25)
                               ? std::copysign(double(kInf), want)
                               : want;
    return double(got) == rounded ? 0 : std::numeric_limits<double>::infinity();
  }
  const double magnitude = std::max(std::fabs(want), double(std::numeric_limits<float>::min()));
  const double spacing = std::ldexp(1.0, std::ilogb(magnitude) - 23);
  return std::fabs(double(got) - want) / spacing;
}

/// Special values plus a seeded sweep: random floats of every binade in [2^lo, 2^hi), both
/// signs, subnormals included.
std::vector<float> sweep(int lo, int hi) {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               kInf,
                               -kInf,
                               kNaN,
                               std::numeric_limits<float>::denorm_min(),
                               -std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::min(),
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::max(),
                               1.0f,
                               -1.0f,
                               0.625f,
                               3.9f,
                               88.7f,
                               89.0f,
                               -87.0f,
                               -103.9f,
                               -104.0f,
                               1e-30f};
  std::mt19937_64 random(20261125);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  for (int e = lo; e < hi; ++e)
    for (int i = 0; i < 400; ++i) {
      const float v = std::ldexp(mantissa(random), e);
      values.push_back(v);
      values.push_back(-v);
    }
  for (int i = 0; i < 2000; ++i) {  // subnormals
    const float v = std::bit_cast<float>(static_cast<uint32_t>(random() % 0x7fffffu) + 1u);
    values.push_back(v);
    values.push_back(-v);
  }
  return values;
}

/// The largest ulp error of f against reference over `values` (and the first value reaching it).
template <typename F, typename R>
std::pair<double, float> worst(const std::vector<float>& values, F f, R reference) {
  std::pair<double, float> result{0, 0};
  for (float v : values) {
    const double error = ulp_error(f(v), reference(double(v)));
    if (!(error <= result.first)) result = {error, v};
  }
  return result;
}

TEST(VectorMath, ExpWithinTwoUlpEverywhere) {
  const auto [error, at] = worst(
      sweep(-149, 8), [](float x) { return vm::exp_f32(x); }, [](double x) { return std::exp(x); });
  EXPECT_LE(error, 2.0) << "at x = " << at;
  EXPECT_EQ(vm::exp_f32(-kInf), 0.0f);
  EXPECT_EQ(vm::exp_f32(kInf), kInf);
  EXPECT_EQ(vm::exp_f32(-0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(vm::exp_f32(kNaN)));
}

TEST(VectorMath, LogWithinTwoUlpEverywhere) {
  const auto [error, at] = worst(
      sweep(-149, 128), [](float x) { return vm::log_f32(x); },
      [](double x) { return std::log(x); });
  EXPECT_LE(error, 2.0) << "at x = " << at;
  EXPECT_EQ(vm::log_f32(0.0f), -kInf);
  EXPECT_EQ(vm::log_f32(-0.0f), -kInf);
  EXPECT_EQ(vm::log_f32(kInf), kInf);
  EXPECT_EQ(vm::log_f32(1.0f), 0.0f);
  EXPECT_TRUE(std::isnan(vm::log_f32(-1.0f)));
  EXPECT_TRUE(std::isnan(vm::log_f32(-kInf)));
}

TEST(VectorMath, Log1pWithinTwoUlpEverywhere) {
  std::vector<float> values;
  for (float v : sweep(-149, 128))
    if (!(v < -1.0f)) values.push_back(v);
  const auto [error, at] = worst(
      values, [](float x) { return vm::log1p_f32(x); }, [](double x) { return std::log1p(x); });
  EXPECT_LE(error, 2.0) << "at x = " << at;
  EXPECT_EQ(vm::log1p_f32(-1.0f), -kInf);
  EXPECT_TRUE(std::signbit(vm::log1p_f32(-0.0f)));
}

TEST(VectorMath, SigmoidWithinTwoUlpEverywhere) {
  const auto [error, at] = worst(
      sweep(-149, 8), [](float x) { return vm::sigmoid_f32(x); },
      [](double x) { return 1 / (1 + std::exp(-x)); });
  EXPECT_LE(error, 2.0) << "at x = " << at;
  EXPECT_EQ(vm::sigmoid_f32(kInf), 1.0f);
  EXPECT_EQ(vm::sigmoid_f32(-kInf), 0.0f);
}

TEST(VectorMath, TanhWithinTwoUlpEverywhere) {
  const auto [error, at] = worst(
      sweep(-149, 128), [](float x) { return vm::tanh_f32(x); },
      [](double x) { return std::tanh(x); });
  EXPECT_LE(error, 2.0) << "at x = " << at;
  EXPECT_TRUE(std::signbit(vm::tanh_f32(-0.0f)));
  EXPECT_EQ(vm::tanh_f32(-kInf), -1.0f);
}

TEST(VectorMath, ErfWithinTwoUlpEverywhere) {
  const auto [error, at] = worst(
      sweep(-149, 128), [](float x) { return vm::erf_f32(x); },
      [](double x) { return std::erf(x); });
  EXPECT_LE(error, 2.0) << "at x = " << at;
  EXPECT_TRUE(std::signbit(vm::erf_f32(-0.0f)));
  EXPECT_EQ(vm::erf_f32(kInf), 1.0f);
  EXPECT_EQ(vm::erf_f32(-kInf), -1.0f);
}

// The standard normal's distribution function (gelu's f32 body): within 2e-7 absolute everywhere
// (about 3 ulp of values near 1/2) and, below 0, relative to the tail however small (4.5e-7 plus
// the rounding of x^2 in the exponent, about 2.5e-7 x^2), against erfc in double.
TEST(VectorMath, NormalCdfAbsolutelyAndInItsTailRelativelyAccurate) {
  std::vector<float> values = sweep(-149, 128);
  for (float x = -14.0f; x <= 14.0f; x += 1.0f / 1024) values.push_back(x);
  double worst_abs = 0, worst_rel = 0;
  float at_abs = 0, at_rel = 0;
  for (float x : values) {
    if (std::isnan(x)) continue;
    const double want = 0.5 * std::erfc(-double(x) / std::sqrt(2.0));
    const double got = vm::normal_cdf_f32(x);
    const double absolute = std::fabs(got - want);
    if (absolute > worst_abs) worst_abs = absolute, at_abs = x;
    if (want > double(std::numeric_limits<float>::min())) {
      const double relative = absolute / want / (4.5e-7 + 2.5e-7 * double(x) * x);
      if (relative > worst_rel) worst_rel = relative, at_rel = x;
    }
  }
  EXPECT_LE(worst_abs, 2e-7) << "at x = " << at_abs;
  EXPECT_LE(worst_rel, 1.0) << "at x = " << at_rel;
  EXPECT_TRUE(std::isnan(vm::normal_cdf_f32(kNaN)));
  EXPECT_EQ(vm::normal_cdf_f32(kInf), 1.0f);
  EXPECT_EQ(vm::normal_cdf_f32(-kInf), 0.0f);
  EXPECT_EQ(vm::normal_cdf_f32(0.0f), 0.5f);
}

/// x^y's special values, the table of std::pow (C99 Annex F): bit for bit, signs of zeros and
/// infinities included (any NaN for NaN), on every pair of these bases and exponents.
TEST(VectorMath, PowSpecialValuesAreThoseOfStdPow) {
  const std::vector<float> values = {
      0.0f,    -0.0f, kInf,   -kInf,       kNaN,         1.0f,       -1.0f,      2.0f,  -2.0f,
      0.5f,    -0.5f, 3.0f,   -3.0f,       0.25f,        -7.0f,      1.5f,       -1.5f, 1e-45f,
      -1e-45f, 3e38f, -3e38f, 16777216.0f, -16777215.0f, 8388609.0f, -8388609.5f};
  for (float x : values)
    for (float y : values) {
      const float want = static_cast<float>(std::pow(double(x), double(y)));
      const float got = vm::pow_f32(x, y);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << x << " ^ " << y;
      } else {
        EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
            << x << " ^ " << y << " = " << got << ", want " << want;
      }
    }
  EXPECT_EQ(vm::pow_f32(kNaN, 0.0f), 1.0f);  // x^0 = 1 for any x
  EXPECT_EQ(vm::pow_f32(1.0f, kNaN), 1.0f);  // 1^y = 1 for any y
  EXPECT_EQ(vm::pow_f32(-1.0f, -kInf), 1.0f);
  EXPECT_EQ(vm::pow_f32(-0.0f, -3.0f), -kInf);  // 0^negative odd: inf with x's sign
  EXPECT_EQ(vm::pow_f32(0.0f, -2.0f), kInf);
  EXPECT_TRUE(std::signbit(vm::pow_f32(-2.0f, -149.0f)));  // negative base, odd integer
  EXPECT_TRUE(std::isnan(vm::pow_f32(-2.0f, 0.5f)));       // negative base, non-integer
  // pow_f32_d's double exponent: y - 1 for pow's backward, exact where the float is not.
  EXPECT_EQ(vm::pow_f32_d(-2.0f, 16777216.0 - 1.0), -kInf);
}

/// x^y within 1 ulp of std::pow in double over a seeded sweep: bases of every binade (both
/// signs, subnormals), exponents from 2^-30 to 2^10 in magnitude, every 7th an integer (so that
/// negative bases give numbers), results from subnormal to overflowing.
TEST(VectorMath, PowWithinOneUlpEverywhere) {
  std::mt19937_64 random(20261126);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> base_exponent(-149, 127), exponent_exponent(-30, 10);
  double worst_error = 0;
  float worst_x = 0, worst_y = 0;
  for (int i = 0; i < 400000; ++i) {
    float x = std::ldexp(mantissa(random), base_exponent(random));
    float y = std::ldexp(mantissa(random), exponent_exponent(random));
    if (i % 2) x = -x;
    if (i % 4 >= 2) y = -y;
    if (i % 7 == 0) y = std::round(y * 64);
    const double error = ulp_error(vm::pow_f32(x, y), std::pow(double(x), double(y)));
    if (!(error <= worst_error)) worst_error = error, worst_x = x, worst_y = y;
  }
  for (float x : sweep(-149, 128)) {  // exponents near 1 and small integers on every base
    for (float y : {1.0f, -1.0f, 2.0f, 0.5f, 3.0f, -2.5f, 1.0000001f}) {
      const double error = ulp_error(vm::pow_f32(x, y), std::pow(double(x), double(y)));
      if (!(error <= worst_error)) worst_error = error, worst_x = x, worst_y = y;
    }
  }
  EXPECT_LE(worst_error, 1.0) << "at " << worst_x << " ^ " << worst_y;
}

}  // namespace
}  // namespace tessera::ops
