// Device code of the pointwise ops: one generic grid-stride kernel over an elementwise layout
// (per-dim strides, stride 0 where an operand broadcasts) and one over contiguous, 16-byte
// aligned operands that moves 128 bits per access with a scalar tail, both instantiated for
// every function below and every element type. Each kernel reads its inputs once and writes
// all of its outputs (the backward kernels fuse the derivative with the product by g).
#include <cstdint>
#include <type_traits>

#include "ops/cuda_elements.cuh"
#include "ops/pointwise/pointwise_cuda.cuh"

namespace tessera::ops::kernels {

namespace {

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kTwoOverSqrtPi = 1.12837916709551257390;

// Overloads picking the float or double math functions.
__device__ __forceinline__ float erf_of(float x) {
  return erff(x);
}
__device__ __forceinline__ double erf_of(double x) {
  return erf(x);
}
__device__ __forceinline__ float exp_of(float x) {
  return expf(x);
}
__device__ __forceinline__ double exp_of(double x) {
  return exp(x);
}
__device__ __forceinline__ float tanh_of(float x) {
  return tanhf(x);
}
__device__ __forceinline__ double tanh_of(double x) {
  return tanh(x);
}
__device__ __forceinline__ float log_of(float x) {
  return logf(x);
}
__device__ __forceinline__ double log_of(double x) {
  return log(x);
}
__device__ __forceinline__ float log1p_of(float x) {
  return log1pf(x);
}
__device__ __forceinline__ double log1p_of(double x) {
  return log1p(x);
}
__device__ __forceinline__ float sqrt_of(float x) {
  return sqrtf(x);
}
__device__ __forceinline__ double sqrt_of(double x) {
  return sqrt(x);
}
__device__ __forceinline__ float pow_of(float x, float y) {
  return powf(x, y);
}
__device__ __forceinline__ double pow_of(double x, double y) {
  return pow(x, y);
}
__device__ __forceinline__ float nan_of(float) {
  return __int_as_float(0x7fc00000);
}
__device__ __forceinline__ double nan_of(double) {
  return __longlong_as_double(0x7ff8000000000000LL);
}

/// f(x) of the unary functions (the formulas of pointwise_math.hpp) with parameters p0, p1.
template <UnaryKind K, typename C>
__device__ __forceinline__ C unary_value(C x, C p0, C p1) {
  if constexpr (K == UnaryKind::relu) {
    return x > C(0) ? x : C(0);
  } else if constexpr (K == UnaryKind::gelu) {
    return C(0.5) * x * (C(1) + erf_of(x * C(kInvSqrt2)));
  } else if constexpr (K == UnaryKind::silu) {
    return x / (C(1) + exp_of(-x));
  } else if constexpr (K == UnaryKind::tanh) {
    return tanh_of(x);
  } else if constexpr (K == UnaryKind::exp) {
    return exp_of(x);
  } else if constexpr (K == UnaryKind::scale) {
    return p0 * x;
  } else if constexpr (K == UnaryKind::sigmoid) {
    return C(1) / (C(1) + exp_of(-x));
  } else if constexpr (K == UnaryKind::softplus) {
    return x * p0 > p1 ? x : log1p_of(exp_of(x * p0)) / p0;
  } else if constexpr (K == UnaryKind::leaky_relu) {
    return x > C(0) ? x : x * p0;
  } else if constexpr (K == UnaryKind::erf) {
    return erf_of(x);
  } else if constexpr (K == UnaryKind::sqrt) {
    return sqrt_of(x);
  } else if constexpr (K == UnaryKind::neg) {
    return -x;
  } else if constexpr (K == UnaryKind::abs) {
    return x < C(0) ? -x : x;
  } else if constexpr (K == UnaryKind::log) {
    return log_of(x);
  } else {  // clamp: max wins when min > max, NaN stays NaN
    const C low = x < p0 ? p0 : x;
    return low > p1 ? p1 : low;
  }
}

/// f'(.) of the unary functions from what the backward saved: y for tanh, exp, sigmoid and
/// sqrt, x for the others.
template <UnaryKind K, typename C>
__device__ __forceinline__ C unary_derivative(C saved, C p0, C p1) {
  if constexpr (K == UnaryKind::relu) {
    return saved > C(0) ? C(1) : C(0);
  } else if constexpr (K == UnaryKind::gelu) {
    return C(0.5) * (C(1) + erf_of(saved * C(kInvSqrt2))) +
           saved * C(kInvSqrt2Pi) * exp_of(C(-0.5) * saved * saved);
  } else if constexpr (K == UnaryKind::silu) {
    const C sigmoid = C(1) / (C(1) + exp_of(-saved));
    return sigmoid * (C(1) + saved * (C(1) - sigmoid));
  } else if constexpr (K == UnaryKind::tanh) {
    return C(1) - saved * saved;
  } else if constexpr (K == UnaryKind::exp) {
    return saved;
  } else if constexpr (K == UnaryKind::scale) {
    return p0;
  } else if constexpr (K == UnaryKind::sigmoid) {
    return saved * (C(1) - saved);
  } else if constexpr (K == UnaryKind::softplus) {
    if (saved * p0 > p1) return C(1);
    const C z = exp_of(saved * p0);
    return z / (z + C(1));
  } else if constexpr (K == UnaryKind::leaky_relu) {
    return saved > C(0) ? C(1) : p0;
  } else if constexpr (K == UnaryKind::erf) {
    return C(kTwoOverSqrtPi) * exp_of(-saved * saved);
  } else if constexpr (K == UnaryKind::sqrt) {
    return C(1) / (C(2) * saved);
  } else if constexpr (K == UnaryKind::neg) {
    return C(-1);
  } else if constexpr (K == UnaryKind::abs) {
    return saved > C(0) ? C(1) : saved < C(0) ? C(-1) : C(0);
  } else if constexpr (K == UnaryKind::log) {
    return C(1) / saved;
  } else {  // clamp
    return saved >= p0 && saved <= p1 ? C(1) : C(0);
  }
}

template <BinaryKind K, typename C>
__device__ __forceinline__ C binary_value(C a, C b) {
  if constexpr (K == BinaryKind::add) return a + b;
  if constexpr (K == BinaryKind::sub) return a - b;
  if constexpr (K == BinaryKind::mul) return a * b;
  if constexpr (K == BinaryKind::div) return a / b;
  if constexpr (K == BinaryKind::pow) return pow_of(a, b);
  if constexpr (K == BinaryKind::maximum) return a != a || b != b ? nan_of(a) : a > b ? a : b;
  if constexpr (K == BinaryKind::minimum) return a != a || b != b ? nan_of(a) : a < b ? a : b;
}

/// d(a op b)/da and d(a op b)/db (PyTorch's conventions: see pointwise_math.hpp).
template <BinaryKind K, typename C>
__device__ __forceinline__ void binary_partials(C a, C b, C& da, C& db) {
  if constexpr (K == BinaryKind::add) {
    da = C(1);
    db = C(1);
  } else if constexpr (K == BinaryKind::sub) {
    da = C(1);
    db = C(-1);
  } else if constexpr (K == BinaryKind::mul) {
    da = b;
    db = a;
  } else if constexpr (K == BinaryKind::div) {
    da = C(1) / b;
    db = -a / (b * b);
  } else if constexpr (K == BinaryKind::pow) {
    da = b == C(0) ? C(0) : b * pow_of(a, b - C(1));
    db = a == C(0) && b >= C(0) ? C(0) : pow_of(a, b) * log_of(a);
  } else if constexpr (K == BinaryKind::maximum) {
    da = a > b ? C(1) : a == b ? C(0.5) : C(0);
    db = b > a ? C(1) : a == b ? C(0.5) : C(0);
  } else {
    da = a < b ? C(1) : a == b ? C(0.5) : C(0);
    db = b < a ? C(1) : a == b ? C(0.5) : C(0);
  }
}

// The functors of the kernels: in[] holds the inputs widened to the computation type, out[]
// receives the outputs.
template <UnaryKind K, typename T>
struct UnaryForward {
  static constexpr int inputs = 1, outputs = 1;
  Compute<T> p0, p1;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    out[0] = unary_value<K>(in[0], p0, p1);
  }
};

template <UnaryKind K, typename T>
struct UnaryBackward {
  static constexpr int inputs = 2, outputs = 1;
  Compute<T> p0, p1;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    out[0] = unary_derivative<K>(in[0], p0, p1) * in[1];
  }
};

/// a (op) b, or b (op) a when `swapped` (the broadcast operand is always operand 1).
template <BinaryKind K, typename T>
struct BinaryForward {
  static constexpr int inputs = 2, outputs = 1;
  bool swapped;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    out[0] = swapped ? binary_value<K>(in[1], in[0]) : binary_value<K>(in[0], in[1]);
  }
};

/// The gradients of operands 0 and 1 (see BinaryForward), each times g (operand 2).
template <BinaryKind K, typename T>
struct BinaryBackward {
  static constexpr int inputs = 3, outputs = 2;
  bool swapped;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    using C = Compute<T>;
    const C g = in[2];
    C dx, dy;
    if (swapped) {
      binary_partials<K>(in[1], in[0], dx, dy);
      out[0] = dy * g;
      out[1] = dx * g;
    } else {
      binary_partials<K>(in[0], in[1], dx, dy);
      out[0] = dx * g;
      out[1] = dy * g;
    }
  }
};

template <typename T>
struct WhereForward {
  static constexpr int inputs = 3, outputs = 1;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    out[0] = in[0] != Compute<T>(0) ? in[1] : in[2];
  }
};

template <typename T>
struct WhereBackward {
  static constexpr int inputs = 2, outputs = 2;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    const bool chosen = in[0] != Compute<T>(0);
    out[0] = chosen ? in[1] : Compute<T>(0);
    out[1] = chosen ? Compute<T>(0) : in[1];
  }
};

template <typename T>
struct ScaledCopy {
  static constexpr int inputs = 1, outputs = 1;
  Compute<T> factor;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    out[0] = factor * in[0];
  }
};

template <typename T>
struct MseBackward {
  static constexpr int inputs = 2, outputs = 2;
  const T* g;  // one element
  Compute<T> factor;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    const Compute<T> grad = factor * to_compute(*g) * (in[0] - in[1]);
    out[0] = grad;
    out[1] = -grad;
  }
};

template <typename T, int NIn, int NOut>
struct Pointers {
  const T* in[NIn];
  T* out[NOut];
};

/// One element per iteration; input k at the strided offset of flat index i, outputs at i.
template <typename T, typename Op>
__global__ void strided_kernel(Pointers<T, Op::inputs, Op::outputs> p, ElementwiseLayout layout,
                               Op op) {
  using C = Compute<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < layout.count;
       i += step) {
    int64_t offset[Op::inputs] = {};
    int64_t rest = i;
    for (int d = layout.ndim - 1; d >= 0; --d) {
      const int64_t index = rest % layout.extent[d];
      rest /= layout.extent[d];
#pragma unroll
      for (int k = 0; k < Op::inputs; ++k) offset[k] += index * layout.stride[k][d];
    }
    C in[Op::inputs], out[Op::outputs];
#pragma unroll
    for (int k = 0; k < Op::inputs; ++k) in[k] = to_compute(p.in[k][offset[k]]);
    op(in, out);
#pragma unroll
    for (int k = 0; k < Op::outputs; ++k) p.out[k][i] = from_compute<T>(out[k]);
  }
}

/// V elements of T in one 16-byte access.
template <typename T, int V>
struct alignas(kVectorBytes) Pack {
  T lane[V];
};

/// Contiguous, aligned operands: packs of V elements per iteration, then a scalar tail.
template <typename T, int V, typename Op>
__global__ void vector_kernel(Pointers<T, Op::inputs, Op::outputs> p, int64_t count, Op op) {
  using C = Compute<T>;
  using P = Pack<T, V>;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t packs = count / V;
  for (int64_t q = first; q < packs; q += step) {
    P in_pack[Op::inputs], out_pack[Op::outputs];
#pragma unroll
    for (int k = 0; k < Op::inputs; ++k) in_pack[k] = reinterpret_cast<const P*>(p.in[k])[q];
#pragma unroll
    for (int lane = 0; lane < V; ++lane) {
      C in[Op::inputs], out[Op::outputs];
#pragma unroll
      for (int k = 0; k < Op::inputs; ++k) in[k] = to_compute(in_pack[k].lane[lane]);
      op(in, out);
#pragma unroll
      for (int k = 0; k < Op::outputs; ++k) out_pack[k].lane[lane] = from_compute<T>(out[k]);
    }
#pragma unroll
    for (int k = 0; k < Op::outputs; ++k) reinterpret_cast<P*>(p.out[k])[q] = out_pack[k];
  }
  for (int64_t i = packs * V + first; i < count; i += step) {
    C in[Op::inputs], out[Op::outputs];
#pragma unroll
    for (int k = 0; k < Op::inputs; ++k) in[k] = to_compute(p.in[k][i]);
    op(in, out);
#pragma unroll
    for (int k = 0; k < Op::outputs; ++k) p.out[k][i] = from_compute<T>(out[k]);
  }
}

/// Launches `op` over `layout`: the vector kernel when the host chose vector accesses, else the
/// strided one.
template <typename T, typename Op>
cudaError_t run(const ElementwiseLayout& layout, int vector_width, const void* const* in,
                void* const* out, Op op, cudaStream_t stream) {
  if (layout.count == 0) return cudaSuccess;
  if (layout.operands < Op::inputs) return cudaErrorInvalidValue;
  Pointers<T, Op::inputs, Op::outputs> pointers;
  for (int k = 0; k < Op::inputs; ++k) pointers.in[k] = static_cast<const T*>(in[k]);
  for (int k = 0; k < Op::outputs; ++k) pointers.out[k] = static_cast<T*>(out[k]);
  constexpr int V = kVectorBytes / static_cast<int>(sizeof(T));
  if (vector_width == V && layout.contiguous) {
    const int64_t packs = layout.count / V;
    vector_kernel<T, V, Op>
        <<<grid_blocks(packs > 0 ? packs : layout.count), kBlockThreads, 0, stream>>>(
            pointers, layout.count, op);
  } else if (vector_width == 1) {
    strided_kernel<T, Op>
        <<<grid_blocks(layout.count), kBlockThreads, 0, stream>>>(pointers, layout, op);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

/// Calls fn(T{}) with T the device type of `type`.
template <typename Fn>
cudaError_t with_type(ElementType type, Fn&& fn) {
  switch (type) {
    case ElementType::f32: return fn(float{});
    case ElementType::f64: return fn(double{});
    case ElementType::f16: return fn(__half{});
    case ElementType::bf16: return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

template <UnaryKind K>
cudaError_t unary_of(ElementType type, const ElementwiseLayout& layout, int vector_width,
                     const void* x, void* y, double p0, double p1, cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {x};
    void* out[] = {y};
    return run<T>(layout, vector_width, in, out,
                  UnaryForward<K, T>{static_cast<Compute<T>>(p0), static_cast<Compute<T>>(p1)},
                  stream);
  });
}

template <UnaryKind K>
cudaError_t unary_backward_of(ElementType type, const ElementwiseLayout& layout, int vector_width,
                              const void* saved, const void* g, void* dx, double p0, double p1,
                              cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {saved, g};
    void* out[] = {dx};
    return run<T>(layout, vector_width, in, out,
                  UnaryBackward<K, T>{static_cast<Compute<T>>(p0), static_cast<Compute<T>>(p1)},
                  stream);
  });
}

template <BinaryKind K>
cudaError_t binary_of(ElementType type, const ElementwiseLayout& layout, int vector_width,
                      const void* a, const void* b, void* result, bool swapped,
                      cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {a, b};
    void* out[] = {result};
    return run<T>(layout, vector_width, in, out, BinaryForward<K, T>{swapped}, stream);
  });
}

template <BinaryKind K>
cudaError_t binary_backward_of(ElementType type, const ElementwiseLayout& layout, int vector_width,
                               const void* a, const void* b, const void* g, void* da, void* db,
                               bool swapped, cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {a, b, g};
    void* out[] = {da, db};
    return run<T>(layout, vector_width, in, out, BinaryBackward<K, T>{swapped}, stream);
  });
}

/// fn(std::integral_constant<Kind, K>{}) for the K among `Kinds` equal to `kind`;
/// cudaErrorInvalidValue when none is.
template <typename Kind, Kind... Kinds, typename Fn>
cudaError_t with_kind(Kind kind, Fn&& fn) {
  cudaError_t result = cudaErrorInvalidValue;
  (void)((kind == Kinds ? (result = fn(std::integral_constant<Kind, Kinds>{}), true) : false) ||
         ...);
  return result;
}

template <typename Fn>
cudaError_t with_unary_kind(UnaryKind kind, Fn&& fn) {
  return with_kind<UnaryKind, UnaryKind::relu, UnaryKind::gelu, UnaryKind::silu, UnaryKind::tanh,
                   UnaryKind::exp, UnaryKind::scale, UnaryKind::sigmoid, UnaryKind::softplus,
                   UnaryKind::leaky_relu, UnaryKind::erf, UnaryKind::sqrt, UnaryKind::neg,
                   UnaryKind::abs, UnaryKind::log, UnaryKind::clamp>(kind, fn);
}

template <typename Fn>
cudaError_t with_binary_kind(BinaryKind kind, Fn&& fn) {
  return with_kind<BinaryKind, BinaryKind::add, BinaryKind::sub, BinaryKind::mul, BinaryKind::div,
                   BinaryKind::pow, BinaryKind::maximum, BinaryKind::minimum>(kind, fn);
}

}  // namespace

cudaError_t launch_unary(UnaryKind kind, ElementType type, const ElementwiseLayout& layout,
                         int vector_width, const void* x, void* y, double p0, double p1,
                         cudaStream_t stream) {
  return with_unary_kind(kind, [&](auto k) {
    return unary_of<decltype(k)::value>(type, layout, vector_width, x, y, p0, p1, stream);
  });
}

cudaError_t launch_unary_backward(UnaryKind kind, ElementType type, const ElementwiseLayout& layout,
                                  int vector_width, const void* saved, const void* g, void* dx,
                                  double p0, double p1, cudaStream_t stream) {
  if (kind == UnaryKind::scale || kind == UnaryKind::neg) {
    // dx = p0 * g or -g: only g is read (operand 1 of the layout).
    ElementwiseLayout g_layout = layout;
    for (int d = 0; d < layout.ndim; ++d) g_layout.stride[0][d] = layout.stride[1][d];
    g_layout.operands = 1;
    return launch_scaled_copy(type, g_layout, vector_width, g, dx,
                              kind == UnaryKind::neg ? -1.0 : p0, stream);
  }
  // The other kinds read the saved tensor and g (no kernel is made for scale and neg here).
  return with_kind<UnaryKind, UnaryKind::relu, UnaryKind::gelu, UnaryKind::silu, UnaryKind::tanh,
                   UnaryKind::exp, UnaryKind::sigmoid, UnaryKind::softplus, UnaryKind::leaky_relu,
                   UnaryKind::erf, UnaryKind::sqrt, UnaryKind::abs, UnaryKind::log,
                   UnaryKind::clamp>(kind, [&](auto k) {
    return unary_backward_of<decltype(k)::value>(type, layout, vector_width, saved, g, dx, p0, p1,
                                                 stream);
  });
}

cudaError_t launch_binary(BinaryKind kind, ElementType type, const ElementwiseLayout& layout,
                          int vector_width, const void* a, const void* b, void* out, bool swapped,
                          cudaStream_t stream) {
  return with_binary_kind(kind, [&](auto k) {
    return binary_of<decltype(k)::value>(type, layout, vector_width, a, b, out, swapped, stream);
  });
}

cudaError_t launch_binary_backward(BinaryKind kind, ElementType type,
                                   const ElementwiseLayout& layout, int vector_width, const void* a,
                                   const void* b, const void* g, void* da, void* db, bool swapped,
                                   cudaStream_t stream) {
  return with_binary_kind(kind, [&](auto k) {
    return binary_backward_of<decltype(k)::value>(type, layout, vector_width, a, b, g, da, db,
                                                  swapped, stream);
  });
}

cudaError_t launch_where(ElementType type, const ElementwiseLayout& layout, int vector_width,
                         const void* cond, const void* a, const void* b, void* out,
                         cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {cond, a, b};
    void* outputs[] = {out};
    return run<T>(layout, vector_width, in, outputs, WhereForward<T>{}, stream);
  });
}

cudaError_t launch_where_backward(ElementType type, const ElementwiseLayout& layout,
                                  int vector_width, const void* cond, const void* g, void* da,
                                  void* db, cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {cond, g};
    void* outputs[] = {da, db};
    return run<T>(layout, vector_width, in, outputs, WhereBackward<T>{}, stream);
  });
}

cudaError_t launch_scaled_copy(ElementType type, const ElementwiseLayout& layout, int vector_width,
                               const void* g, void* out, double factor, cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {g};
    void* outputs[] = {out};
    return run<T>(layout, vector_width, in, outputs, ScaledCopy<T>{static_cast<Compute<T>>(factor)},
                  stream);
  });
}

cudaError_t launch_mse_backward(ElementType type, const ElementwiseLayout& layout, int vector_width,
                                const void* a, const void* b, const void* g_scalar, void* da,
                                void* db, double factor, cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {a, b};
    void* out[] = {da, db};
    return run<T>(layout, vector_width, in, out,
                  MseBackward<T>{static_cast<const T*>(g_scalar), static_cast<Compute<T>>(factor)},
                  stream);
  });
}

}  // namespace tessera::ops::kernels
