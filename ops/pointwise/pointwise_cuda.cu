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

/// f(x) of the unary functions (the formulas of pointwise_math.hpp).
template <UnaryKind K, typename C>
__device__ __forceinline__ C unary_value(C x, C factor) {
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
  } else {
    return factor * x;
  }
}

/// f'(.) of the unary functions from what the backward saved: x for relu, gelu and silu; y for
/// tanh and exp.
template <UnaryKind K, typename C>
__device__ __forceinline__ C unary_derivative(C saved, C factor) {
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
  } else {
    return factor;
  }
}

template <BinaryKind K, typename C>
__device__ __forceinline__ C binary_value(C a, C b) {
  if constexpr (K == BinaryKind::add) return a + b;
  if constexpr (K == BinaryKind::sub) return a - b;
  if constexpr (K == BinaryKind::mul) return a * b;
  if constexpr (K == BinaryKind::div) return a / b;
}

// The functors of the kernels: in[] holds the inputs widened to the computation type, out[]
// receives the outputs.
template <UnaryKind K, typename T>
struct UnaryForward {
  static constexpr int inputs = 1, outputs = 1;
  Compute<T> factor;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    out[0] = unary_value<K>(in[0], factor);
  }
};

template <UnaryKind K, typename T>
struct UnaryBackward {
  static constexpr int inputs = 2, outputs = 1;
  Compute<T> factor;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    out[0] = unary_derivative<K>(in[0], factor) * in[1];
  }
};

template <BinaryKind K, typename T>
struct BinaryForward {
  static constexpr int inputs = 2, outputs = 1;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    out[0] = binary_value<K>(in[0], in[1]);
  }
};

template <BinaryKind K, typename T>
struct BinaryBackward {
  static constexpr int inputs = 3, outputs = 2;
  __device__ void operator()(const Compute<T>* in, Compute<T>* out) const {
    const Compute<T> a = in[0], b = in[1], g = in[2];
    if constexpr (K == BinaryKind::add) {
      out[0] = g;
      out[1] = g;
    } else if constexpr (K == BinaryKind::sub) {
      out[0] = g;
      out[1] = -g;
    } else if constexpr (K == BinaryKind::mul) {
      out[0] = b * g;
      out[1] = a * g;
    } else {
      out[0] = g / b;
      out[1] = -a / (b * b) * g;
    }
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
                     const void* x, void* y, double factor, cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {x};
    void* out[] = {y};
    return run<T>(layout, vector_width, in, out,
                  UnaryForward<K, T>{static_cast<Compute<T>>(factor)}, stream);
  });
}

template <UnaryKind K>
cudaError_t unary_backward_of(ElementType type, const ElementwiseLayout& layout, int vector_width,
                              const void* saved, const void* g, void* dx, double factor,
                              cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {saved, g};
    void* out[] = {dx};
    return run<T>(layout, vector_width, in, out,
                  UnaryBackward<K, T>{static_cast<Compute<T>>(factor)}, stream);
  });
}

template <BinaryKind K>
cudaError_t binary_of(ElementType type, const ElementwiseLayout& layout, int vector_width,
                      const void* a, const void* b, void* result, cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {a, b};
    void* out[] = {result};
    return run<T>(layout, vector_width, in, out, BinaryForward<K, T>{}, stream);
  });
}

template <BinaryKind K>
cudaError_t binary_backward_of(ElementType type, const ElementwiseLayout& layout, int vector_width,
                               const void* a, const void* b, const void* g, void* da, void* db,
                               cudaStream_t stream) {
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    const void* in[] = {a, b, g};
    void* out[] = {da, db};
    return run<T>(layout, vector_width, in, out, BinaryBackward<K, T>{}, stream);
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
                   UnaryKind::exp, UnaryKind::scale>(kind, fn);
}

template <typename Fn>
cudaError_t with_binary_kind(BinaryKind kind, Fn&& fn) {
  return with_kind<BinaryKind, BinaryKind::add, BinaryKind::sub, BinaryKind::mul, BinaryKind::div>(
      kind, fn);
}

}  // namespace

cudaError_t launch_unary(UnaryKind kind, ElementType type, const ElementwiseLayout& layout,
                         int vector_width, const void* x, void* y, double factor,
                         cudaStream_t stream) {
  return with_unary_kind(kind, [&](auto k) {
    return unary_of<decltype(k)::value>(type, layout, vector_width, x, y, factor, stream);
  });
}

cudaError_t launch_unary_backward(UnaryKind kind, ElementType type, const ElementwiseLayout& layout,
                                  int vector_width, const void* saved, const void* g, void* dx,
                                  double factor, cudaStream_t stream) {
  if (kind == UnaryKind::scale) {
    // dx = factor * g: only g is read (operand 1 of the layout).
    ElementwiseLayout g_layout = layout;
    for (int d = 0; d < layout.ndim; ++d) g_layout.stride[0][d] = layout.stride[1][d];
    g_layout.operands = 1;
    return launch_scaled_copy(type, g_layout, vector_width, g, dx, factor, stream);
  }
  // The other kinds read the saved tensor and g (no kernel is made for scale here).
  return with_kind<UnaryKind, UnaryKind::relu, UnaryKind::gelu, UnaryKind::silu, UnaryKind::tanh,
                   UnaryKind::exp>(kind, [&](auto k) {
    return unary_backward_of<decltype(k)::value>(type, layout, vector_width, saved, g, dx, factor,
                                                 stream);
  });
}

cudaError_t launch_binary(BinaryKind kind, ElementType type, const ElementwiseLayout& layout,
                          int vector_width, const void* a, const void* b, void* out,
                          cudaStream_t stream) {
  return with_binary_kind(kind, [&](auto k) {
    return binary_of<decltype(k)::value>(type, layout, vector_width, a, b, out, stream);
  });
}

cudaError_t launch_binary_backward(BinaryKind kind, ElementType type,
                                   const ElementwiseLayout& layout, int vector_width, const void* a,
                                   const void* b, const void* g, void* da, void* db,
                                   cudaStream_t stream) {
  return with_binary_kind(kind, [&](auto k) {
    return binary_backward_of<decltype(k)::value>(type, layout, vector_width, a, b, g, da, db,
                                                  stream);
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
