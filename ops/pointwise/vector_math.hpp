// Branch-free f32 versions of exp, log, log1p, tanh, sigmoid, erf and pow for the cpu elementwise
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

/// Half of erfc(|x| / sqrt 2): the standard normal's tail beyond |x|, P(X >= |x|), never by
/// cancellation. erfc(a) = e^{-a^2} t U(t) with t = 1 / (1 + a/2) over all a >= 0 (t in (0, 1]);
/// U is a degree-10 polynomial in s = 2t - 1 fitted here (least squares in relative terms,
/// reweighted to the maximum) to erfc(a) e^{a^2} / t: 1.1e-8 relative. `e` is e^{-x^2/2}
/// (= e^{-a^2}), which the caller computes (gelu's backward needs it for the density as well); it
/// does not wait for the division and the polynomial (the two run side by side in every lane).
/// The rounding of x^2 in the exponent adds about 2e-7 x^2 relative (1e-6 at |x| = 5, where the
/// tail is 3e-7). One range, one division and one exponential for every lane. NaN gives NaN;
/// +-inf give 0.
TESSERA_VM_INLINE float normal_tail_f32(float x, float e) {
  const float a = (x < 0.0f ? -x : x) * 0.707106781f;
  const float t = 1.0f / (1.0f + 0.5f * a);
  const float s = 2.0f * t - 1.0f;  // (-1, 1]: the terms fall off, little rounding to add up
  float u = 4.13597361e-05f;
  u = u * s - 3.72942045e-05f;
  u = u * s - 0.000297709657f;
  u = u * s + 0.000432094038f;
  u = u * s + 0.00152801283f;
  u = u * s - 0.0032444059f;
  u = u * s - 0.010751343f;
  u = u * s + 0.0182218988f;
  u = u * s + 0.139735715f;
  u = u * s + 0.343580305f;
  u = u * s + 0.510791357f;
  return 0.5f * e * (t * u);
}

/// The standard normal's distribution function P(X <= x) = erfc(-x / sqrt 2) / 2 from
/// normal_tail_f32: the tail itself below 0 (accurate in relative terms however small), one minus
/// it above. Within 1.8e-7 absolute (3 ulp near 1/2, where the rounding of t is amplified about
/// twice). gelu(x) = x P(X <= x). `e` is e^{-x^2/2}, as normal_tail_f32 takes it.
TESSERA_VM_INLINE float normal_cdf_f32(float x, float e) {
  const float tail = normal_tail_f32(x, e);
  return x < 0.0f ? tail : 1.0f - tail;
}

/// e^{-x^2/2}: the standard normal's density times sqrt(2 pi), and normal_cdf_f32's `e`.
TESSERA_VM_INLINE float normal_exp_f32(float x) {
  return exp_f32(-0.5f * x * x);
}

TESSERA_VM_INLINE float normal_cdf_f32(float x) {
  return normal_cdf_f32(x, normal_exp_f32(x));
}

/// x^y for a float base and a double exponent (pow_f32 below; pow's backward passes y - 1, exact
/// in double), rounded once to float. |x|^y = 2^(y log2|x|) evaluated in double: log2 of the
/// mantissa m in [sqrt(1/2), sqrt(2)) as 2 atanh(s) / ln2, s = (m - 1) / (m + 1), |s| < 0.172 (the
/// atanh series to s^13: relative error below 1e-11), then 2^t as 2^n e^{r ln2}, |r| <= 1/2 (the
/// Taylor series to degree 10: relative error below 1e-12). The product's error stays below
/// 1e-8 ulp of float for every t that does not overflow or underflow, so the float result is the
/// correctly rounded pow but in the rarest halfway cases. The special values are those of
/// std::pow (C99 Annex F), folded in as the body describes.
TESSERA_VM_INLINE float pow_f32_d(float x, double y) {
  constexpr double kInfD = std::numeric_limits<double>::infinity();
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  // The special values are folded in without a select after the first division or conversion
  // (the compiler would move those, which may trap, into a branch, and the loops would not
  // vectorise): the cases equal to 1 (x^0, 1^y, (-1)^+-inf) become 1^0 on the way in, 0, inf and
  // NaN bases add their log2 to a finite one, and the sign and NaN of negative bases come last as
  // a factor and a term. x's class comes from its bits: an ordered comparison may trap too.
  const double y_magnitude = y < 0.0 ? -y : y;
  const double x_magnitude = x < 0.0f ? -double(x) : double(x);
  const bool one = (y == 0.0) | (x == 1.0f) | ((x_magnitude == 1.0) & (y_magnitude == kInfD));
  const double ax = one ? 1.0 : x_magnitude;
  const double ay = one ? 0.0 : y_magnitude;
  // (Three separate terms: one select of four values is more than the loops' if-conversion takes.)
  const double special_log2 =
      (ax == 0.0 ? -kInfD : 0.0) + (ax == kInfD ? kInfD : 0.0) + (ax != ax ? ax : 0.0);
  // Every float, subnormals included, is a normal double: the exponent comes from its bits (for
  // 0 and inf it is finite and m = 1, for NaN m is finite: the division cannot trap).
  const uint64_t bits = std::bit_cast<uint64_t>(ax);
  const int64_t e = static_cast<int64_t>(bits - 0x3fe6a09e667f3bcdull) >> 52;
  const double m = std::bit_cast<double>(bits - (static_cast<uint64_t>(e) << 52));
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double q = 1.0 / 13;
  q = q * s2 + 1.0 / 11;
  q = q * s2 + 1.0 / 9;
  q = q * s2 + 1.0 / 7;
  q = q * s2 + 1.0 / 5;
  q = q * s2 + 1.0 / 3;
  const double log2_m = (s + s * s2 * q) * 2.8853900817779268;  // 2 / ln2
  // e as a double through the shifter's bits: AVX2 has no int64 -> double conversion.
  const double e_d =
      std::bit_cast<double>(std::bit_cast<uint64_t>(kShifter) + static_cast<uint64_t>(e)) -
      kShifter;
  const double log2_ax = (e_d + log2_m) + special_log2;
  // 2^t; past +-200 the float result is already inf or 0 (NaN fails both tests and stays NaN).
  // The bounds carry e_d * 0 (always +-0: e_d is finite) so that the clamped cases do not fold to
  // constants either.
  const double opaque_zero = e_d * 0.0;
  double t = (y < 0.0 ? -ay : ay) * log2_ax;
  t = t < -200.0 ? -200.0 + opaque_zero : t;
  t = t > 200.0 ? 200.0 + opaque_zero : t;
  const double shifted = t + kShifter;
  const double n = shifted - kShifter;
  const double r = (t - n) * 0.69314718055994531;
  double p = 1.0 / 3628800;
  p = p * r + 1.0 / 362880;
  p = p * r + 1.0 / 40320;
  p = p * r + 1.0 / 5040;
  p = p * r + 1.0 / 720;
  p = p * r + 1.0 / 120;
  p = p * r + 1.0 / 24;
  p = p * r + 1.0 / 6;
  p = p * r + 0.5;
  p = p * r * r + r + 1.0;
  const uint64_t k = std::bit_cast<uint64_t>(shifted) - std::bit_cast<uint64_t>(kShifter);
  const float magnitude = static_cast<float>(p * std::bit_cast<double>((k + 1023) << 52));
  // y an integer (+-inf counts as an even one), and odd: every double from 2^53 on is even.
  const bool integer =
      (y_magnitude >= 4503599627370496.0) | (((y_magnitude + kShifter) - kShifter) == y_magnitude);
  const double half = y_magnitude * 0.5;
  const bool odd =
      (y_magnitude < 9007199254740992.0) & integer & (((half + kShifter) - kShifter) != half);
  const uint32_t x_bits = std::bit_cast<uint32_t>(x);
  const bool negative = x_bits >= 0x80000000u;                                   // -0, -inf too
  const bool negative_finite = (x_bits > 0x80000000u) & (x_bits < 0xff800000u);  // not -0
  const float sign = negative & odd ? -1.0f : 1.0f;
  // -0 when no NaN is due: adding it keeps the sign of a zero result.
  const float nan_term =
      negative_finite & !integer ? std::numeric_limits<float>::quiet_NaN() : -0.0f;
  return magnitude * sign + nan_term;
}

/// x^y with std::pow's special values (see pow_f32_d), correctly rounded but in rare cases.
TESSERA_VM_INLINE float pow_f32(float x, float y) {
  return pow_f32_d(x, static_cast<double>(y));
}

}  // namespace tessera::ops::vm
