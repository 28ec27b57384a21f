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
enum class UnaryKind : int { relu, gelu, silu, tanh, exp, scale };
/// The binary pointwise functions.
enum class BinaryKind : int { add, sub, mul, div };

/// y = f(x) (scale: factor * x). Layout operand 0 is x.
cudaError_t launch_unary(UnaryKind kind, ElementType type, const ElementwiseLayout& layout,
                         int vector_width, const void* x, void* y, double factor,
                         cudaStream_t stream);

/// dx = f'(x, y) * g in one pass. Operand 0 is what the derivative reads (x for relu, gelu and
/// silu; y for tanh and exp; g itself for scale, where dx = factor * g), operand 1 is g.
cudaError_t launch_unary_backward(UnaryKind kind, ElementType type, const ElementwiseLayout& layout,
                                  int vector_width, const void* saved, const void* g, void* dx,
                                  double factor, cudaStream_t stream);

/// out = a (op) b. Operands 0 and 1 are a and b (b's strides 0 along broadcast dims).
cudaError_t launch_binary(BinaryKind kind, ElementType type, const ElementwiseLayout& layout,
                          int vector_width, const void* a, const void* b, void* out,
                          cudaStream_t stream);

/// da = d(a op b)/da * g and db = d(a op b)/db * g in one pass over a, b, g (operands 0, 1, 2;
/// both outputs have the layout's shape).
cudaError_t launch_binary_backward(BinaryKind kind, ElementType type,
                                   const ElementwiseLayout& layout, int vector_width, const void* a,
                                   const void* b, const void* g, void* da, void* db,
                                   cudaStream_t stream);

/// out = factor * g, g read through operand 0 (stride 0 along the dims it is broadcast over).
cudaError_t launch_scaled_copy(ElementType type, const ElementwiseLayout& layout, int vector_width,
                               const void* g, void* out, double factor, cudaStream_t stream);

/// The mse_loss gradient in one pass: da = factor * (a - b) * g, db = -da, with g the one
/// element at `g_scalar` (read on the device; factor is 2 / the global element count).
cudaError_t launch_mse_backward(ElementType type, const ElementwiseLayout& layout, int vector_width,
                                const void* a, const void* b, const void* g_scalar, void* da,
                                void* db, double factor, cudaStream_t stream);

}  // namespace tessera::ops::kernels
