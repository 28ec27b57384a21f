// Branch-free f32 versions of exp, log, log1p, tanh, sigmoid and erf for the cpu elementwise
// loops: no calls and no branches (special values are selected, not branched to), so a loop over
// them vectorises. Each is within about 2 ulp of the correctly rounded result over the whole
// float range, subnormal inputs and results included, and keeps the C library's special values
// (NaN propagates, exp(-inf) = 0, log(0) = -inf, log(-1) = NaN, tanh(-0) = -0, ...). The
// polynomials are least-squares fits (Chebyshev nodes, reweighted towards minimax) of the
// functions' smooth parts on the reduced ranges named at each one; vector_math_test.cpp checks
// the ulp errors against the double functions of <cmath>.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

#if defined(__GNUC__)
#define TESSERA_VM_INLINE [[gnu::always_inline]] inline
#else
#define TESSERA_VM_INLINE inline
#endif

namespace tessera::ops::vm {

/// 2^k for an integer k in [-126, 127] (as a float bit pattern).
TESSERA_VM_INLINE float pow2_f32(uint32_t k_plus_127) {
  return std::bit_cast<float>(k_plus_127 << 23);
}

/// e^x. x = n ln2 + r with |r| <= ln2/2; e^r = 1 + r + r^2 P(r) (degree 5, fitted on
/// [-ln2/2, ln2/2]); 2^n applied in two halves so that results down to the subnormals round once.
TESSERA_VM_INLINE float exp_f32(float x) {
  // Past 89 the result overflows to inf and below -104 it rounds to 0 through the product;
  // clamping keeps n within the two halves' range. NaN fails both tests and stays NaN.
  float c = x < -104.0f ? -104.0f : x;
  c = c > 89.0f ? 89.0f : c;
  constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = c * 1.44269504088896341f + kShifter;
  const float n = shifted - kShifter;
  float r = c - n * 0.693359375f;  // ln2 in two parts: the first exact times n
  r = r - n * -2.12194440e-4f;
  float p = 1.98577822e-4f;
  p = p * r + 1.39335974e-3f;
  p = p * r + 8.33336078e-3f;
  p = p * r + 4.16664667e-2f;
  p = p * r + 1.66666672e-1f;
  p = p * r + 5.0e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t k = std::bit_cast<uint32_t>(shifted) - std::bit_cast<uint32_t>(kShifter);
  const uint32_t half = static_cast<uint32_t>(static_cast<int32_t>(k) >> 1);
  return p * pow2_f32(half + 127) * pow2_f32(k - half + 127);
}

/// log(x). x = 2^e m with m in [sqrt(1/2), sqrt(2)); log(m) = f - f^2/2 + f^3 Q(f), f = m - 1
/// (Q of degree 8, fitted on that range); subnormal x scaled by 2^23 first.
TESSERA_VM_INLINE float log_f32(float x) {
  const bool subnormal = x < 1.17549435e-38f;
  const float scaled = subnormal ? x * 8388608.0f : x;
  const uint32_t bits = std::bit_cast<uint32_t>(scaled);
  // The exponent that puts the mantissa in [sqrt(1/2), sqrt(2)): offset by sqrt(1/2)'s bits.
  const int32_t e = static_cast<int32_t>(bits - 0x3f3504f3u) >> 23;
  const float m = std::bit_cast<float>(bits - (static_cast<uint32_t>(e) << 23));
  const float f = m - 1.0f;
  float q = 7.037299126e-2f;
  q = q * f - 1.151441485e-1f;
  q = q * f + 1.167705134e-1f;
  q = q * f - 1.242017224e-1f;
  q = q * f + 1.424932033e-1f;
  q = q * f - 1.666805595e-1f;
  q = q * f + 2.000071406e-1f;
  q = q * f - 2.499999404e-1f;
  q = q * f + 3.333333135e-1f;
  const float f2 = f * f;
  const float ef = static_cast<float>(e) - (subnormal ? 23.0f : 0.0f);
  float result = f2 * f * q - 0.5f * f2;
  result = (result + ef * -2.12194440e-4f) + f;
  result = result + ef * 0.693359375f;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  result = x == kInf ? kInf : result;
  result = x == 0.0f ? -kInf : result;
  result = x < 0.0f ? std::numeric_limits<float>::quiet_NaN() : result;
  return x != x ? x : result;
}

/// log(1 + x), accurate for small x: log(u) + (x - (u - 1)) / u with u = 1 + x rounded (the
/// second term is u's rounding error, exact, over u); x itself where u rounds to 1 (keeps -0).
TESSERA_VM_INLINE float log1p_f32(float x) {
  const float u = 1.0f + x;
  const float d = u - 1.0f;
  float result = log_f32(u) + (x - d) / u;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  result = x == kInf ? kInf : result;
  result = u == 0.0f ? -kInf : result;
  return d == 0.0f ? x : result;
}

/// 1 / (1 + e^-x) from e = e^-|x| (never overflows): 1/(1+e) for x >= 0, e/(1+e) below.
TESSERA_VM_INLINE float sigmoid_f32(float x) {
  const float e = exp_f32(x < 0.0f ? x : -x);
  const float inverse = 1.0f / (1.0f + e);
  return x < 0.0f ? e * inverse : (x != x ? x : inverse);
}

/// tanh(x): x + x^3 Q(x^2) below |x| = 0.625 (Q of degree 4, fitted on [0, 0.625]); above,
/// 1 - 2 / (e^{2|x|} + 1) with x's sign (e^{2|x|} may overflow to inf: the result is then 1).
TESSERA_VM_INLINE float tanh_f32(float x) {
  const float a = x < 0.0f ? -x : x;
  const float z = x * x;
  float q = -6.097385660e-3f;
  q = q * z + 2.099774964e-2f;
  q = q * z - 5.385106802e-2f;
  q = q * z + 1.333277076e-1f;
  q = q * z - 3.333332837e-1f;
  const float small = x + x * z * q;
  const float large = 1.0f - 2.0f / (exp_f32(2.0f * a) + 1.0f);
  const float signed_large = x < 0.0f ? -large : large;
  // z == 0: x itself, so that tanh(-0) = -0.
  return a < 0.625f ? (z == 0.0f ? x : small) : (x != x ? x : signed_large);
}

/// erf(x): x + x P(x^2) below |x| = 1 (P of degree 5, fitted on [0, 1]); from 1 to 3.9,
/// 1 - e^{-x^2} R(1/|x|) with x's sign (R of degree 8, fitting erfc(x) e^{x^2} on [1, 3.9]);
/// beyond, +-1 (erfc(3.9) is below half an ulp of 1).
TESSERA_VM_INLINE float erf_f32(float x) {
  const float a = x < 0.0f ? -x : x;
  const float z = x * x;
  float p = -5.63175709e-4f;
  p = p * z + 4.91764443e-3f;
  p = p * z - 2.67114043e-2f;
  p = p * z + 1.12801842e-1f;
  p = p * z - 3.76123279e-1f;
  p = p * z + 1.28379107e-1f;  // 2/sqrt(pi) - 1: x + x p keeps the leading term exact
  const float small = x + x * p;
  const float t = 1.0f / (a < 1.0f ? 1.0f : a);
  float r = -1.01222154e-2f;
  r = r * t + 3.16611901e-2f;
  r = r * t + 1.77278537e-2f;
  r = r * t - 2.35561803e-1f;
  r = r * t + 4.93010938e-1f;
  r = r * t - 4.70159441e-1f;
  r = r * t + 4.16744351e-2f;
  r = r * t + 5.59084535e-1f;
  r = r * t + 2.68048112e-4f;
  const float clipped = a > 3.9f ? 3.9f : a;
  float large = 1.0f - exp_f32(-clipped * clipped) * r;
  large = a > 3.9f ? 1.0f : large;
  const float signed_large = x < 0.0f ? -large : large;
  return a < 1.0f ? small : (x != x ? x : signed_large);
}

}  // namespace tessera::ops::vm
