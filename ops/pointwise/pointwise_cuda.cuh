// Launch interface of the pointwise cuda kernels (device code in pointwise_cuda.cu, C++17 for
// nvcc): unary and binary forward, their fused backward, and the scaled broadcast copy of a
// reduction's gradient. Every launch is queued on `stream` and returns the launch status; none
// synchronizes. Elements are f32, f64, f16 or bf16; f16/bf16 compute in float, f32 in float,
// f64 in double. Outputs are contiguous; inputs are read through the layout's strides (or with
// vector_width elements per 128-bit access when the layout is contiguous and aligned).
#pragma once

#include <cuda_runtime.h>

#include "ops/pointwise/elementwise_plan.hpp"

namespace tessera::ops::kernels {

/// Element type of a kernel's operands.
enum class ElementType : int { f32, f64, f16, bf16 };
/// The unary pointwise functions (ops/pointwise/pointwise_math.hpp).
enum class UnaryKind : int {
  relu,
  gelu,
  silu,
  tanh,
  exp,
  scale,
  sigmoid,
  softplus,
  leaky_relu,
  erf,
  sqrt,
  neg,
  abs,
  log,
  clamp
};
/// The binary pointwise functions.
enum class BinaryKind : int { add, sub, mul, div, pow, maximum, minimum };

/// y = f(x) with the function's parameters p0, p1 (scale: factor; leaky_relu: negative slope;
/// softplus: beta, threshold; clamp: min, max). Layout operand 0 is x.
cudaError_t launch_unary(UnaryKind kind, ElementType type, const ElementwiseLayout& layout,
                         int vector_width, const void* x, void* y, double p0, double p1,
                         cudaStream_t stream);

/// dx = f'(x, y) * g in one pass. Operand 0 is what the derivative reads (y for tanh, exp,
/// sigmoid and sqrt, x for the others; g itself for scale and neg, where dx = p0 * g or -g),
/// operand 1 is g.
cudaError_t launch_unary_backward(UnaryKind kind, ElementType type, const ElementwiseLayout& layout,
                                  int vector_width, const void* saved, const void* g, void* dx,
                                  double p0, double p1, cudaStream_t stream);

/// out = a (op) b, or b (op) a when `swapped`. Operands 0 and 1 are a and b (b's strides 0
/// along broadcast dims).
cudaError_t launch_binary(BinaryKind kind, ElementType type, const ElementwiseLayout& layout,
                          int vector_width, const void* a, const void* b, void* out, bool swapped,
                          cudaStream_t stream);

/// The gradients of operands 0 and 1 (a and b) of a (op) b (of b (op) a when `swapped`) times g,
/// in one pass over a, b, g (operands 0, 1, 2; both outputs have the layout's shape).
cudaError_t launch_binary_backward(BinaryKind kind, ElementType type,
                                   const ElementwiseLayout& layout, int vector_width, const void* a,
                                   const void* b, const void* g, void* da, void* db, bool swapped,
                                   cudaStream_t stream);

/// out = cond != 0 ? a : b (operands 0, 1, 2: cond, a, b, all of the element type).
cudaError_t launch_where(ElementType type, const ElementwiseLayout& layout, int vector_width,
                         const void* cond, const void* a, const void* b, void* out,
                         cudaStream_t stream);

/// da = cond != 0 ? g : 0, db = cond != 0 ? 0 : g (operands 0, 1: cond, g).
cudaError_t launch_where_backward(ElementType type, const ElementwiseLayout& layout,
                                  int vector_width, const void* cond, const void* g, void* da,
                                  void* db, cudaStream_t stream);

/// out = factor * g, g read through operand 0 (stride 0 along the dims it is broadcast over).
cudaError_t launch_scaled_copy(ElementType type, const ElementwiseLayout& layout, int vector_width,
                               const void* g, void* out, double factor, cudaStream_t stream);

/// The mse_loss gradient in one pass: da = factor * (a - b) * g, db = -da, with g the one
/// element at `g_scalar` (read on the device; factor is 2 / the global element count).
cudaError_t launch_mse_backward(ElementType type, const ElementwiseLayout& layout, int vector_width,
                                const void* a, const void* b, const void* g_scalar, void* da,
                                void* db, double factor, cudaStream_t stream);

}  // namespace tessera::ops::kernels
