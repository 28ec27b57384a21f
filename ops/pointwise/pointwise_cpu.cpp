// cpu bodies of the pointwise ops (see pointwise_cpu.hpp). Each op is a functor template over the
// element type, dispatched on once per call; the loops (cpu_loops.hpp) inline it, so a loop is
// branch-free straight-line code that GCC vectorises for the instruction set picked at run time.
// f32 transcendentals come from vector_math.hpp (within 2 ulp), f64 ones from <cmath> (the
// results of pointwise_math.hpp, which the f64 fixtures check).
#include "ops/pointwise/pointwise_cpu.hpp"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/errors.hpp"
#include "ops/cpu_loops.hpp"
#include "ops/cpu_stream.hpp"
#include "ops/pointwise/pointwise_math.hpp"
#include "ops/pointwise/vector_math.hpp"

namespace tessera::ops {

namespace {

// ----------------------------------------------------------------------------------------------
// Math per element type: vector_math in float, <cmath> in double.

TESSERA_VM_INLINE float exp_of(float x) {
  return vm::exp_f32(x);
}
TESSERA_VM_INLINE double exp_of(double x) {
  return std::exp(x);
}
TESSERA_VM_INLINE float log_of(float x) {
  return vm::log_f32(x);
}
TESSERA_VM_INLINE double log_of(double x) {
  return std::log(x);
}
TESSERA_VM_INLINE float tanh_of(float x) {
  return vm::tanh_f32(x);
}
TESSERA_VM_INLINE double tanh_of(double x) {
  return std::tanh(x);
}
TESSERA_VM_INLINE float erf_of(float x) {
  return vm::erf_f32(x);
}
TESSERA_VM_INLINE double erf_of(double x) {
  return std::erf(x);
}
TESSERA_VM_INLINE float sigmoid_of_t(float x) {
  return vm::sigmoid_f32(x);
}
TESSERA_VM_INLINE double sigmoid_of_t(double x) {
  return sigmoid_of(x);
}
TESSERA_VM_INLINE float sqrt_of(float x) {
  return std::sqrt(x);
}
TESSERA_VM_INLINE double sqrt_of(double x) {
  return std::sqrt(x);
}

// ----------------------------------------------------------------------------------------------
// Unary ops: forward(x) and backward(v, g) = f'(v) g (v: y when the derivative reads the
// output, x otherwise), with the formulas and conventions of pointwise_math.hpp.

template <typename T>
struct Relu {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return x > 0 ? x : T(0); }
  TESSERA_VM_INLINE T backward(T x, T g) const { return (x > 0 ? T(1) : T(0)) * g; }
};
// gelu(x) = x Phi(x), gelu'(x) = Phi(x) + x phi(x). f32 takes Phi from vm::normal_cdf_f32 (one
// range, the negative tail without cancellation), f64 the erf form of pointwise_math.hpp.
template <typename T>
struct Gelu {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const {
    if constexpr (std::is_same_v<T, float>) {
      return x * vm::normal_cdf_f32(x);
    } else {
      return T(0.5) * x * (1 + erf_of(x * T(kInvSqrt2)));
    }
  }
  TESSERA_VM_INLINE T backward(T x, T g) const {
    if constexpr (std::is_same_v<T, float>) {
      const float e = vm::normal_exp_f32(x);  // one exponential for both terms
      return (vm::normal_cdf_f32(x, e) + x * float(kInvSqrt2Pi) * e) * g;
    } else {
      return (T(0.5) * (1 + erf_of(x * T(kInvSqrt2))) +
              x * T(kInvSqrt2Pi) * exp_of(T(-0.5) * x * x)) *
             g;
    }
  }
};
template <typename T>
struct Silu {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return x * sigmoid_of_t(x); }
  TESSERA_VM_INLINE T backward(T x, T g) const {
    const T s = sigmoid_of_t(x);
    return s * (1 + x * (1 - s)) * g;
  }
};
template <typename T>
struct Tanh {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return tanh_of(x); }
  TESSERA_VM_INLINE T backward(T y, T g) const { return (1 - y * y) * g; }
};
template <typename T>
struct Exp {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return exp_of(x); }
  TESSERA_VM_INLINE T backward(T y, T g) const { return y * g; }
};
template <typename T>
struct Scale {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return a * x; }
  TESSERA_VM_INLINE T backward(T, T g) const { return a * g; }
};
template <typename T>
struct Sigmoid {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return sigmoid_of_t(x); }
  TESSERA_VM_INLINE T backward(T y, T g) const { return y * (1 - y) * g; }
};
// softplus(x) = log(1 + e^{beta x}) / beta (x where beta x > threshold). In f32 as
// (max(t, 0) + log1p(e^{-|t|})) / beta, t = beta x, which never overflows; f64 keeps the formula
// of pointwise_math.hpp.
template <typename T>
struct Softplus {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const {
    const T t = x * a;
    if constexpr (std::is_same_v<T, float>) {
      const float soft = ((t > 0 ? t : 0.0f) + vm::log1p_f32(vm::exp_f32(t < 0 ? t : -t))) / a;
      return t > b ? x : soft;
    } else {
      return t > b ? x : std::log1p(std::exp(t)) / a;
    }
  }
  TESSERA_VM_INLINE T backward(T x, T g) const {
    const T t = x * a;
    if constexpr (std::is_same_v<T, float>) {
      return (t > b ? 1.0f : vm::sigmoid_f32(t)) * g;
    } else {
      if (t > b) return g;
      const double z = std::exp(t);
      return z / (z + 1) * g;
    }
  }
};
template <typename T>
struct LeakyRelu {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return x > 0 ? x : x * a; }
  TESSERA_VM_INLINE T backward(T x, T g) const { return (x > 0 ? T(1) : a) * g; }
};
template <typename T>
struct Erf {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return erf_of(x); }
  TESSERA_VM_INLINE T backward(T x, T g) const { return T(kTwoOverSqrtPi) * exp_of(-x * x) * g; }
};
template <typename T>
struct Sqrt {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return sqrt_of(x); }
  TESSERA_VM_INLINE T backward(T y, T g) const { return 1 / (2 * y) * g; }
};
template <typename T>
struct Neg {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return -x; }
  TESSERA_VM_INLINE T backward(T, T g) const { return -g; }
};
template <typename T>
struct Abs {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return std::fabs(x); }
  TESSERA_VM_INLINE T backward(T x, T g) const {  // sgn(x) g, 0 at 0 (PyTorch's sgn)
    return (x > 0 ? T(1) : x < 0 ? T(-1) : T(0)) * g;
  }
};
template <typename T>
struct Log {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const { return log_of(x); }
  TESSERA_VM_INLINE T backward(T x, T g) const { return 1 / x * g; }
};
// clamp = min(max(x, min), max): max wins when min > max, NaN stays NaN; the gradient passes
// where min <= x <= max.
template <typename T>
struct Clamp {
  T a, b;
  TESSERA_VM_INLINE T forward(T x) const {
    const T low = x < a ? a : x;
    return low > b ? b : low;
  }
  TESSERA_VM_INLINE T backward(T x, T g) const { return (x >= a && x <= b ? T(1) : T(0)) * g; }
};

template <template <typename> class Op>
struct UnaryTag {};

/// Calls fn(UnaryTag<Op>{}) for the functor of unary op `name`; false when there is none.
template <typename Fn>
bool visit_unary(const std::string& name, Fn&& fn) {
  if (name == "relu") return fn(UnaryTag<Relu>{}), true;
  if (name == "gelu") return fn(UnaryTag<Gelu>{}), true;
  if (name == "silu") return fn(UnaryTag<Silu>{}), true;
  if (name == "tanh") return fn(UnaryTag<Tanh>{}), true;
  if (name == "exp") return fn(UnaryTag<Exp>{}), true;
  if (name == "scale") return fn(UnaryTag<Scale>{}), true;
  if (name == "sigmoid") return fn(UnaryTag<Sigmoid>{}), true;
  if (name == "softplus") return fn(UnaryTag<Softplus>{}), true;
  if (name == "leaky_relu") return fn(UnaryTag<LeakyRelu>{}), true;
  if (name == "erf") return fn(UnaryTag<Erf>{}), true;
  if (name == "sqrt") return fn(UnaryTag<Sqrt>{}), true;
  if (name == "neg") return fn(UnaryTag<Neg>{}), true;
  if (name == "abs") return fn(UnaryTag<Abs>{}), true;
  if (name == "log") return fn(UnaryTag<Log>{}), true;
  if (name == "clamp") return fn(UnaryTag<Clamp>{}), true;
  return false;
}

/// Calls fn(T{}) for f32 (float) and f64 (double); false for other dtypes.
template <typename Fn>
bool visit_float_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::f32) return fn(float{}), true;
  if (dtype == DType::f64) return fn(double{}), true;
  return false;
}

// ----------------------------------------------------------------------------------------------
// Binary ops: forward(x, y) and backward(x, y, g, dx, dy), pointwise_math.hpp's formulas.

template <typename T>
struct Add {
  TESSERA_VM_INLINE T forward(T x, T y) const { return x + y; }
  TESSERA_VM_INLINE void backward(T, T, T g, T& dx, T& dy) const { dx = g, dy = g; }
};
template <typename T>
struct Sub {
  TESSERA_VM_INLINE T forward(T x, T y) const { return x - y; }
  TESSERA_VM_INLINE void backward(T, T, T g, T& dx, T& dy) const { dx = g, dy = -g; }
};
template <typename T>
struct Mul {
  TESSERA_VM_INLINE T forward(T x, T y) const { return x * y; }
  TESSERA_VM_INLINE void backward(T x, T y, T g, T& dx, T& dy) const { dx = y * g, dy = x * g; }
};
template <typename T>
struct Div {
  TESSERA_VM_INLINE T forward(T x, T y) const { return x / y; }
  TESSERA_VM_INLINE void backward(T x, T y, T g, T& dx, T& dy) const {
    dx = 1 / y * g;
    dy = -x / (y * y) * g;
  }
};
// pow: f64 through std::pow; f32 through vm::pow_f32 (std::pow's special values, the double
// result rounded once), its backward with the exponent y - 1 formed in double as before.
template <typename T>
struct Pow {
  TESSERA_VM_INLINE T forward(T x, T y) const {
    if constexpr (std::is_same_v<T, float>) {
      return vm::pow_f32(x, y);
    } else {
      return std::pow(x, y);
    }
  }
  TESSERA_VM_INLINE void backward(T x, T y, T g, T& dx, T& dy) const {
    if constexpr (std::is_same_v<T, float>) {
      dx = (y == 0.0f ? 0.0f : y * vm::pow_f32_d(x, double(y) - 1.0)) * g;
      dy = ((x == 0.0f) & (y >= 0.0f) ? 0.0f : vm::pow_f32(x, y) * vm::log_f32(x)) * g;
    } else {
      dx = (y == 0 ? 0.0 : y * std::pow(x, y - 1)) * g;
      dy = (x == 0 && y >= 0 ? 0.0 : std::pow(x, y) * std::log(x)) * g;
    }
  }
};

/// f32 x^c for a constant exponent c of 2, 3, 0.5 or -1 into o[0, length) through products, a
/// square root or a quotient: each equals pow_f32's result (the double result rounded once: x^2
/// and x^3 are exact or rounded once in double, and double rounding of a quotient or a square root
/// to float is innocuous), with std::pow's special values (sqrt(-0) is -0 and sqrt(-inf) NaN, pow
/// gives +0 and +inf). False for other exponents.
TESSERA_VM_INLINE bool pow_constant_exponent_f32(const float* x, float c, float* o,
                                                 int64_t length) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  if (c == 2.0f) {
    for (int64_t j = 0; j < length; ++j) o[j] = x[j] * x[j];
  } else if (c == 3.0f) {
    for (int64_t j = 0; j < length; ++j)
      o[j] = static_cast<float>(double(x[j]) * double(x[j]) * double(x[j]));
  } else if (c == 0.5f) {
    for (int64_t j = 0; j < length; ++j) {
      const float root = std::sqrt(x[j]);
      o[j] = x[j] == 0.0f ? 0.0f : (x[j] == -kInf ? kInf : root);
    }
  } else if (c == -1.0f) {
    for (int64_t j = 0; j < length; ++j) o[j] = 1.0f / x[j];
  } else {
    return false;
  }
  return true;
}

// maximum/minimum propagate NaN; a tie splits the gradient in halves (PyTorch).
template <typename T>
struct Maximum {
  TESSERA_VM_INLINE T forward(T x, T y) const {
    return x != x ? x : (y != y ? y : (x > y ? x : y));
  }
  TESSERA_VM_INLINE void backward(T x, T y, T g, T& dx, T& dy) const {
    dx = (x > y ? T(1) : x == y ? T(0.5) : T(0)) * g;
    dy = (y > x ? T(1) : x == y ? T(0.5) : T(0)) * g;
  }
};
template <typename T>
struct Minimum {
  TESSERA_VM_INLINE T forward(T x, T y) const {
    return x != x ? x : (y != y ? y : (x < y ? x : y));
  }
  TESSERA_VM_INLINE void backward(T x, T y, T g, T& dx, T& dy) const {
    dx = (x < y ? T(1) : x == y ? T(0.5) : T(0)) * g;
    dy = (y < x ? T(1) : x == y ? T(0.5) : T(0)) * g;
  }
};

template <template <typename> class Op>
struct BinaryTag {};

/// Ops of one or two operations per element, whose loops are bound by memory traffic: they run
/// with 256-bit vectors (parallel_ranges<true>, see cpu_loops.hpp).
template <template <typename> class Op>
constexpr bool kStreaming =
    std::is_same_v<Op<float>, Relu<float>> || std::is_same_v<Op<float>, Scale<float>> ||
    std::is_same_v<Op<float>, LeakyRelu<float>> || std::is_same_v<Op<float>, Neg<float>> ||
    std::is_same_v<Op<float>, Abs<float>> || std::is_same_v<Op<float>, Clamp<float>> ||
    std::is_same_v<Op<float>, Add<float>> || std::is_same_v<Op<float>, Sub<float>> ||
    std::is_same_v<Op<float>, Mul<float>> || std::is_same_v<Op<float>, Maximum<float>> ||
    std::is_same_v<Op<float>, Minimum<float>>;

/// Ops whose outputs are streamed past the caches when large (cpu_stream.hpp): the loops bound
/// by memory traffic, div and sqrt (one division or root per element). The compute-heavy ones
/// (exp, sigmoid, pow, ...) ran 15-20% slower through the stream buffer and keep plain stores.
template <template <typename> class Op>
constexpr bool kStreamsOutput = kStreaming<Op> || std::is_same_v<Op<float>, Div<float>> ||
                                std::is_same_v<Op<float>, Sqrt<float>>;

template <typename Fn>
bool visit_binary(const std::string& name, Fn&& fn) {
  if (name == "add" || name == "bias_add") return fn(BinaryTag<Add>{}), true;
  if (name == "sub") return fn(BinaryTag<Sub>{}), true;
  if (name == "mul") return fn(BinaryTag<Mul>{}), true;
  if (name == "div") return fn(BinaryTag<Div>{}), true;
  if (name == "pow") return fn(BinaryTag<Pow>{}), true;
  if (name == "maximum") return fn(BinaryTag<Maximum>{}), true;
  if (name == "minimum") return fn(BinaryTag<Minimum>{}), true;
  return false;
}

// ----------------------------------------------------------------------------------------------
// Walking a contiguous lead with a strided operand: the merged layout's rows.

/// The merged layout of a contiguous tensor of `shape` (operand 0) and an operand read through
/// `strides` (operand 1).
ElementwiseLayout lead_and_view_layout(const Shape& shape, const std::vector<int64_t>& strides) {
  return elementwise_layout(shape, {contiguous_strides(shape), strides});
}

/// Calls row(flat, offset, length, stride) for the pieces of the flat range [lo, hi) of `layout`
/// that lie in one innermost row: `flat` is the lead's (contiguous) index of the piece's first
/// element, `offset` operand 1's, `stride` operand 1's step along the row.
template <typename Row>
TESSERA_VM_INLINE void for_rows(const ElementwiseLayout& layout, int64_t lo, int64_t hi,
                                const Row& row) {
  // Nothing to visit (an empty shard has zero-length rows: no division by their length).
  if (lo >= hi) return;
  if (layout.ndim == 0) {
    row(lo, int64_t{0}, hi - lo, int64_t{0});
    return;
  }
  const int inner = layout.ndim - 1;
  const int64_t length = layout.extent[inner];
  const int64_t stride = layout.stride[1][inner];
  int64_t index[kMaxKernelDims] = {};
  int64_t rest = lo / length;
  for (int d = inner - 1; d >= 0; --d) {
    index[d] = rest % layout.extent[d];
    rest /= layout.extent[d];
  }
  int64_t column = lo % length;
  for (int64_t flat = lo; flat < hi;) {
    int64_t offset = column * stride;
    for (int d = 0; d < inner; ++d) offset += index[d] * layout.stride[1][d];
    const int64_t piece = std::min(length - column, hi - flat);
    row(flat, offset, piece, stride);
    flat += piece;
    column = 0;
    for (int d = inner - 1; d >= 0; --d) {
      if (++index[d] < layout.extent[d]) break;
      index[d] = 0;
    }
  }
}

}  // namespace

std::optional<Tensor> unary_forward_cpu(const std::string& name, const Tensor& x, double a,
                                        double b) {
  std::optional<Tensor> result;
  visit_float_dtype(x.dtype(), [&]<typename T>(T) {
    visit_unary(name, [&]<template <typename> class Op>(UnaryTag<Op>) {
      const Tensor source = x.contiguous();
      Tensor out = Tensor::empty(source.shape(), source.dtype());
      const T* in = source.data<T>();
      T* y = out.data<T>();
      const Op<T> op{static_cast<T>(a), static_cast<T>(b)};
      const bool stream =
          kStreamsOutput<Op> && streams_output(2 * source.numel() * int64_t(sizeof(T)));
      parallel_ranges<kStreaming<Op>>(
          source.numel(), [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
            const Op<T> f = op;  // a local copy: stores through y cannot change its parameters
            write_output(stream, y, lo, hi, [&](T* o, int64_t from, int64_t to) TESSERA_LOOP_BODY {
              for (int64_t i = from; i < to; ++i) o[i - from] = f.forward(in[i]);
            });
          });
      result = out;
    });
  });
  return result;
}

std::optional<Tensor> unary_backward_cpu(const std::string& name, const Tensor& v, const Tensor& g,
                                         double a, double b) {
  if (v.dtype() != g.dtype() || v.shape() != g.shape()) return std::nullopt;
  std::optional<Tensor> result;
  visit_float_dtype(v.dtype(), [&]<typename T>(T) {
    visit_unary(name, [&]<template <typename> class Op>(UnaryTag<Op>) {
      const Tensor values = v.contiguous(), grads = g.contiguous();
      Tensor out = Tensor::empty(values.shape(), values.dtype());
      const T* in = values.data<T>();
      const T* gv = grads.data<T>();
      T* dx = out.data<T>();
      const Op<T> op{static_cast<T>(a), static_cast<T>(b)};
      const bool stream =
          kStreamsOutput<Op> && streams_output(3 * values.numel() * int64_t(sizeof(T)));
      parallel_ranges<kStreaming<Op>>(
          values.numel(), [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
            const Op<T> f = op;  // a local copy: stores through dx cannot change its parameters
            write_output(stream, dx, lo, hi, [&](T* o, int64_t from, int64_t to) TESSERA_LOOP_BODY {
              for (int64_t i = from; i < to; ++i) o[i - from] = f.backward(in[i], gv[i]);
            });
          });
      result = out;
    });
  });
  return result;
}

std::optional<Tensor> binary_forward_cpu(const std::string& name, const Tensor& lead,
                                         const Tensor& other, const OperandView& view,
                                         bool swapped) {
  if (lead.dtype() != other.dtype()) return std::nullopt;
  std::optional<Tensor> result;
  visit_float_dtype(lead.dtype(), [&]<typename T>(T) {
    visit_binary(name, [&]<template <typename> class Op>(BinaryTag<Op>) {
      const Tensor source = lead.contiguous();
      Tensor out = Tensor::empty(source.shape(), source.dtype());
      const ElementwiseLayout layout = lead_and_view_layout(source.shape(), view.strides);
      const T* a = source.data<T>();
      const T* b = other.data<T>() + view.start;
      T* z = out.data<T>();
      const Op<T> op;
      const bool stream =
          kStreamsOutput<Op> && streams_output(3 * layout.count * int64_t(sizeof(T)));
      // The values of n elements from the lead's `flat` and the other's `offset` (its step
      // `stride`: 0 for a constant, 1 for contiguous) into o.
      auto piece = [&](T* o, int64_t flat, int64_t offset, int64_t stride,
                       int64_t n) TESSERA_LOOP_BODY {
        const T* x = a + flat;
        const T* y = b + offset;
        if (stride == 0) {
          const T c = *y;
          if constexpr (std::is_same_v<Op<T>, Pow<float>>) {
            if (!swapped && pow_constant_exponent_f32(x, c, o, n)) return;
          }
          if (swapped)
            for (int64_t j = 0; j < n; ++j) o[j] = op.forward(c, x[j]);
          else
            for (int64_t j = 0; j < n; ++j) o[j] = op.forward(x[j], c);
        } else if (stride == 1) {
          if (swapped)
            for (int64_t j = 0; j < n; ++j) o[j] = op.forward(y[j], x[j]);
          else
            for (int64_t j = 0; j < n; ++j) o[j] = op.forward(x[j], y[j]);
        } else {
          for (int64_t j = 0; j < n; ++j)
            o[j] = swapped ? op.forward(y[j * stride], x[j]) : op.forward(x[j], y[j * stride]);
        }
      };
      // A row, its output through write_output (streamed in blocks when the op is large).
      auto row = [&](int64_t flat, int64_t offset, int64_t length,
                     int64_t stride) TESSERA_LOOP_BODY {
        write_output(stream, z + flat, 0, length,
                     [&](T* o, int64_t from, int64_t to) TESSERA_LOOP_BODY {
                       piece(o, flat + from, offset + from * stride, stride, to - from);
                     });
      };
      parallel_ranges<kStreaming<Op>>(layout.count, [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
        for_rows(layout, lo, hi, row);
      });
      result = out;
    });
  });
  return result;
}

std::optional<std::pair<Tensor, Tensor>> binary_backward_cpu(const std::string& name,
                                                             const Tensor& lead,
                                                             const Tensor& other,
                                                             const OperandView& view,
                                                             const Tensor& g, bool swapped) {
  if (lead.dtype() != other.dtype() || lead.dtype() != g.dtype() || lead.shape() != g.shape())
    return std::nullopt;
  std::optional<std::pair<Tensor, Tensor>> result;
  visit_float_dtype(lead.dtype(), [&]<typename T>(T) {
    visit_binary(name, [&]<template <typename> class Op>(BinaryTag<Op>) {
      const Tensor source = lead.contiguous(), grads = g.contiguous();
      Tensor d_lead = Tensor::empty(source.shape(), source.dtype());
      Tensor d_other = Tensor::empty(source.shape(), source.dtype());
      const ElementwiseLayout layout = lead_and_view_layout(source.shape(), view.strides);
      const T* a = source.data<T>();
      const T* b = other.data<T>() + view.start;
      const T* gv = grads.data<T>();
      T* da = d_lead.data<T>();
      T* db = d_other.data<T>();
      const Op<T> op;
      const bool stream =
          kStreamsOutput<Op> && streams_output(5 * layout.count * int64_t(sizeof(T)));
      // The gradients of n elements (as binary_forward_cpu's piece) into dl and dr.
      auto piece = [&](T* dl, T* dr, int64_t flat, int64_t offset, int64_t stride, int64_t n)
                       TESSERA_LOOP_BODY {
                         const T* x = a + flat;
                         const T* y = b + offset;
                         const T* gr = gv + flat;
                         if (stride == 0) {
                           const T c = *y;
                           if (swapped)
                             for (int64_t j = 0; j < n; ++j)
                               op.backward(c, x[j], gr[j], dr[j], dl[j]);
                           else
                             for (int64_t j = 0; j < n; ++j)
                               op.backward(x[j], c, gr[j], dl[j], dr[j]);
                         } else if (stride == 1) {
                           if (swapped)
                             for (int64_t j = 0; j < n; ++j)
                               op.backward(y[j], x[j], gr[j], dr[j], dl[j]);
                           else
                             for (int64_t j = 0; j < n; ++j)
                               op.backward(x[j], y[j], gr[j], dl[j], dr[j]);
                         } else {
                           for (int64_t j = 0; j < n; ++j) {
                             if (swapped)
                               op.backward(y[j * stride], x[j], gr[j], dr[j], dl[j]);
                             else
                               op.backward(x[j], y[j * stride], gr[j], dl[j], dr[j]);
                           }
                         }
                       };
      auto row = [&](int64_t flat, int64_t offset, int64_t length,
                     int64_t stride) TESSERA_LOOP_BODY {
        write_outputs(stream, da + flat, db + flat, 0, length,
                      [&](T* dl, T* dr, int64_t from, int64_t to) TESSERA_LOOP_BODY {
                        piece(dl, dr, flat + from, offset + from * stride, stride, to - from);
                      });
      };
      parallel_ranges<kStreaming<Op>>(layout.count, [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
        for_rows(layout, lo, hi, row);
      });
      result = std::make_pair(d_lead, d_other);
    });
  });
  return result;
}

std::optional<Tensor> reduce_to_view_cpu(const Tensor& grad, const Shape& operand_shape,
                                         const OperandView& view) {
  if (grad.dtype() != DType::f32 && grad.dtype() != DType::f64) return std::nullopt;
  const Tensor source = grad.contiguous();
  Tensor sums = Tensor::zeros(operand_shape, DType::f64);
  const ElementwiseLayout layout = lead_and_view_layout(source.shape(), view.strides);
  double* out = sums.data<double>() + view.start;
  // Rows in order on one thread: each output element's sum has one order whatever the threads.
  // A row along which the operand is constant is summed with 16 independent lanes first.
  visit_float_dtype(source.dtype(), [&]<typename T>(T) {
    const T* in = source.data<T>();
    auto row = [&](int64_t flat, int64_t offset, int64_t length, int64_t stride) TESSERA_LOOP_BODY {
      const T* x = in + flat;
      if (stride == 0) {
        constexpr int kLanes = 16;
        double lanes[kLanes] = {};
        int64_t j = 0;
        for (; j + kLanes <= length; j += kLanes)
          for (int l = 0; l < kLanes; ++l) lanes[l] += double(x[j + l]);
        double total = 0;
        for (int l = 0; l < kLanes; ++l) total += lanes[l];
        for (; j < length; ++j) total += double(x[j]);
        out[offset] += total;
      } else {
        for (int64_t j = 0; j < length; ++j) out[offset + j * stride] += double(x[j]);
      }
    };
    run_with_isa([&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY { for_rows(layout, lo, hi, row); },
                 0, layout.count);
  });
  return sums.to_dtype(grad.dtype());
}

std::optional<Tensor> select_typed_cpu(const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (cond.dtype() != a.dtype() || a.dtype() != b.dtype() || cond.shape() != a.shape() ||
      a.shape() != b.shape())
    return std::nullopt;
  std::optional<Tensor> result;
  visit_float_dtype(a.dtype(), [&]<typename T>(T) {
    const Tensor mask = cond.contiguous(), left = a.contiguous(), right = b.contiguous();
    Tensor out = Tensor::empty(left.shape(), left.dtype());
    const T* m = mask.data<T>();
    const T* x = left.data<T>();
    const T* y = right.data<T>();
    T* o = out.data<T>();
    const bool stream = streams_output(4 * out.numel() * int64_t(sizeof(T)));
    parallel_ranges<true>(out.numel(), [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
      write_output(stream, o, lo, hi, [&](T* w, int64_t from, int64_t to) TESSERA_LOOP_BODY {
        // Both values read before the choice (a select, not a branch: the loop vectorises).
        const T* mask_at = m + from;
        const T* x_at = x + from;
        const T* y_at = y + from;
        for (int64_t i = 0; i < to - from; ++i) {
          const T if_true = x_at[i], if_false = y_at[i];
          w[i] = mask_at[i] != 0 ? if_true : if_false;
        }
      });
    });
    result = out;
  });
  return result;
}

}  // namespace tessera::ops
