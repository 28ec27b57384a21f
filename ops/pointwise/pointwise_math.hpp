// The scalar functions of the pointwise ops and their derivatives (shared by cpu kernels and
// backward).
#pragma once

#include <cmath>

namespace tessera::ops {

/// A unary pointwise function: y = forward(x, a), dy/dx = derivative(x, y, a).
struct UnaryMath {
  const char* name;
  double (*forward)(double x, double a);
  double (*derivative)(double x, double y, double a);
  bool linear;  ///< true when f(sum of partials) = sum of f(partials) (keeps Partial layouts)
};

inline constexpr double kInvSqrt2 = 0.70710678118654752440;
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;

inline const UnaryMath unary_math[] = {
    {"relu", [](double x, double) { return x > 0 ? x : 0.0; },
     [](double x, double, double) { return x > 0 ? 1.0 : 0.0; }, false},
    {"gelu", [](double x, double) { return 0.5 * x * (1 + std::erf(x * kInvSqrt2)); },
     [](double x, double, double) {
       return 0.5 * (1 + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
     },
     false},
    {"silu", [](double x, double) { return x / (1 + std::exp(-x)); },
     [](double x, double, double) {
       const double sigmoid = 1 / (1 + std::exp(-x));
       return sigmoid * (1 + x * (1 - sigmoid));
     },
     false},
    {"tanh", [](double x, double) { return std::tanh(x); },
     [](double, double y, double) { return 1 - y * y; }, false},
    {"exp", [](double x, double) { return std::exp(x); },
     [](double, double y, double) { return y; }, false},
    {"scale", [](double x, double a) { return a * x; }, [](double, double, double a) { return a; },
     true},
};

/// A binary pointwise function: z = forward(x, y) with partial derivatives dx, dy.
struct BinaryMath {
  const char* name;
  double (*forward)(double x, double y);
  double (*dx)(double x, double y);
  double (*dy)(double x, double y);
  bool linear;  ///< add/sub: Partial operands of one layout stay Partial
};

inline const BinaryMath binary_math[] = {
    {"add", [](double x, double y) { return x + y; }, [](double, double) { return 1.0; },
     [](double, double) { return 1.0; }, true},
    {"sub", [](double x, double y) { return x - y; }, [](double, double) { return 1.0; },
     [](double, double) { return -1.0; }, true},
    {"mul", [](double x, double y) { return x * y; }, [](double, double y) { return y; },
     [](double x, double) { return x; }, false},
    {"div", [](double x, double y) { return x / y; }, [](double, double y) { return 1 / y; },
     [](double x, double y) { return -x / (y * y); }, false},
};

}  // namespace tessera::ops
