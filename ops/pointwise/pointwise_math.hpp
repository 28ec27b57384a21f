// The scalar functions of the pointwise ops and their derivatives (shared by cpu kernels and
// backward), with PyTorch's formulas, including its conventions at kinks and ties.
#pragma once

#include <cmath>
#include <limits>

namespace tessera::ops {

/// The attributes of a unary function: scale's factor, leaky_relu's negative_slope, softplus's
/// beta and threshold, clamp's min and max (absent bounds as -inf/+inf).
struct UnaryParams {
  double a = 0;
  double b = 0;
};

/// A unary pointwise function: y = forward(x, p), dy/dx = derivative(x, y, p).
struct UnaryMath {
  const char* name;
  const char* summary;
  double (*forward)(double x, UnaryParams p);
  double (*derivative)(double x, double y, UnaryParams p);
  bool linear;        ///< true when f(sum of partials) = sum of f(partials) (keeps Partial layouts)
  bool reads_output;  ///< the derivative is a function of y alone (the backward saves y, not x)
};

inline constexpr double kInvSqrt2 = 0.70710678118654752440;
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;
inline constexpr double kTwoOverSqrtPi = 1.12837916709551257390;

/// 1 / (1 + e^-x).
inline double sigmoid_of(double x) {
  return 1 / (1 + std::exp(-x));
}

inline const UnaryMath unary_math[] = {
    {"relu", "Elementwise max(x, 0)", [](double x, UnaryParams) { return x > 0 ? x : 0.0; },
     [](double x, double, UnaryParams) { return x > 0 ? 1.0 : 0.0; }, false, false},
    {"gelu", "Elementwise GELU (exact, erf form)",
     [](double x, UnaryParams) { return 0.5 * x * (1 + std::erf(x * kInvSqrt2)); },
     [](double x, double, UnaryParams) {
       return 0.5 * (1 + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
     },
     false, false},
    {"silu", "Elementwise x * sigmoid(x)", [](double x, UnaryParams) { return x * sigmoid_of(x); },
     [](double x, double, UnaryParams) {
       const double sigmoid = sigmoid_of(x);
       return sigmoid * (1 + x * (1 - sigmoid));
     },
     false, false},
    {"tanh", "Elementwise tanh", [](double x, UnaryParams) { return std::tanh(x); },
     [](double, double y, UnaryParams) { return 1 - y * y; }, false, true},
    {"exp", "Elementwise exp", [](double x, UnaryParams) { return std::exp(x); },
     [](double, double y, UnaryParams) { return y; }, false, true},
    {"scale", "Elementwise factor * x (keeps Partial layouts)",
     [](double x, UnaryParams p) { return p.a * x; },
     [](double, double, UnaryParams p) { return p.a; }, true, false},
    {"sigmoid", "Elementwise 1 / (1 + exp(-x))",
     [](double x, UnaryParams) { return sigmoid_of(x); },
     [](double, double y, UnaryParams) { return y * (1 - y); }, false, true},
    // softplus(x) = log(1 + exp(beta x)) / beta, and x itself where beta x > threshold.
    {"softplus", "Elementwise log(1 + exp(beta x)) / beta (x where beta x > threshold)",
     [](double x, UnaryParams p) {
       return x * p.a > p.b ? x : std::log1p(std::exp(x * p.a)) / p.a;
     },
     [](double x, double, UnaryParams p) {
       if (x * p.a > p.b) return 1.0;
       const double z = std::exp(x * p.a);
       return z / (z + 1);
     },
     false, false},
    {"leaky_relu", "Elementwise x where x > 0, negative_slope * x elsewhere",
     [](double x, UnaryParams p) { return x > 0 ? x : x * p.a; },
     [](double x, double, UnaryParams p) { return x > 0 ? 1.0 : p.a; }, false, false},
    {"erf", "Elementwise error function", [](double x, UnaryParams) { return std::erf(x); },
     [](double x, double, UnaryParams) { return kTwoOverSqrtPi * std::exp(-x * x); }, false, false},
    {"sqrt", "Elementwise square root", [](double x, UnaryParams) { return std::sqrt(x); },
     [](double, double y, UnaryParams) { return 1 / (2 * y); }, false, true},
    {"neg", "Elementwise -x (keeps Partial layouts)", [](double x, UnaryParams) { return -x; },
     [](double, double, UnaryParams) { return -1.0; }, true, false},
    // abs' = sign(x), 0 at 0 (PyTorch's sgn).
    {"abs", "Elementwise |x|", [](double x, UnaryParams) { return std::fabs(x); },
     [](double x, double, UnaryParams) { return x > 0   ? 1.0
                                                : x < 0 ? -1.0
                                                        : 0.0; }, false, false},
    {"log", "Elementwise natural logarithm", [](double x, UnaryParams) { return std::log(x); },
     [](double x, double, UnaryParams) { return 1 / x; }, false, false},
    // clamp = min(max(x, min), max) (so max wins when min > max; NaN stays NaN); the gradient
    // passes where min <= x <= max.
    {"clamp", "Elementwise min(max(x, min), max)",
     [](double x, UnaryParams p) {
       const double low = x < p.a ? p.a : x;
       return low > p.b ? p.b : low;
     },
     [](double x, double, UnaryParams p) { return x >= p.a && x <= p.b ? 1.0 : 0.0; }, false,
     false},
};

/// A binary pointwise function: z = forward(x, y) with partial derivatives dx, dy.
struct BinaryMath {
  const char* name;
  double (*forward)(double x, double y);
  double (*dx)(double x, double y);
  double (*dy)(double x, double y);
  bool linear;  ///< add/sub: Partial operands of one layout stay Partial
};

/// max(x, y) propagating NaN (torch.maximum).
inline double maximum_of(double x, double y) {
  if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::quiet_NaN();
  return x > y ? x : y;
}
/// min(x, y) propagating NaN (torch.minimum).
inline double minimum_of(double x, double y) {
  if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::quiet_NaN();
  return x < y ? x : y;
}

inline const BinaryMath binary_math[] = {
    {"add", [](double x, double y) { return x + y; }, [](double, double) { return 1.0; },
     [](double, double) { return 1.0; }, true},
    {"sub", [](double x, double y) { return x - y; }, [](double, double) { return 1.0; },
     [](double, double) { return -1.0; }, true},
    {"mul", [](double x, double y) { return x * y; }, [](double, double y) { return y; },
     [](double x, double) { return x; }, false},
    {"div", [](double x, double y) { return x / y; }, [](double, double y) { return 1 / y; },
     [](double x, double y) { return -x / (y * y); }, false},
    // PyTorch's pow gradients: 0 for the base where the exponent is 0, 0 for the exponent
    // where the base is 0 and the exponent >= 0.
    {"pow", [](double x, double y) { return std::pow(x, y); },
     [](double x, double y) { return y == 0 ? 0.0 : y * std::pow(x, y - 1); },
     [](double x, double y) { return x == 0 && y >= 0 ? 0.0 : std::pow(x, y) * std::log(x); },
     false},
    // maximum/minimum: a tie splits the gradient in halves, as PyTorch does.
    {"maximum", maximum_of, [](double x, double y) { return x > y    ? 1.0
                                                            : x == y ? 0.5
                                                                     : 0.0; },
     [](double x, double y) { return y > x    ? 1.0
                                     : x == y ? 0.5
                                              : 0.0; }, false},
    {"minimum", minimum_of, [](double x, double y) { return x < y    ? 1.0
                                                            : x == y ? 0.5
                                                                     : 0.0; },
     [](double x, double y) { return y < x    ? 1.0
                                     : x == y ? 0.5
                                              : 0.0; }, false},
};

}  // namespace tessera::ops
