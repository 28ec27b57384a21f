// Launch interface of the cuda backend's elementwise kernels (device code in backend_kernels.cu,
// C++17 for nvcc). Arguments come prepared by the host (core/backend/strided_plan.hpp: merged
// dims, word widths); every launch is queued on the given stream and returns the launch status.
//
// Arithmetic follows the cpu backend: f16 and bf16 compute in float and round to nearest even;
// accumulate computes in the element type otherwise (integers wrap as C++ does after promotion);
// scale multiplies f32 by the factor rounded to float, f64 in double, integers in double and
// rounds toward zero; max and min keep the first operand unless the second compares greater
// (smaller).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tessera::gpu::kernels {

/// Most dims of a strided launch (after the host merged what it could).
constexpr int kMaxBackendDims = 8;

/// Element types, in the order of tessera::DType.
enum class ElementKind : int { f32, f64, f16, bf16, i32, i64, u8 };

/// How accumulate combines dst and src (avg accumulates as sum).
enum class CombineKind : int { sum, max, min, prod };

/// Shape and strides (in elements or words) of one or two operands.
struct StridedLayout {
  int ndim = 0;
  int64_t count = 0;
  int64_t shape[kMaxBackendDims] = {};
  int64_t dst_strides[kMaxBackendDims] = {};
  int64_t src_strides[kMaxBackendDims] = {};
};

/// Sets every word of dst (words of `word_bytes` = 1, 2, 4, 8 or 16 bytes) to the first
/// `word_bytes` bytes of `pattern` (little-endian: pattern[0] holds bytes 0..7).
cudaError_t launch_fill(void* dst, const StridedLayout& layout, size_t word_bytes,
                        const uint64_t pattern[2], cudaStream_t stream);

/// dst = combine(dst, src) elementwise over `layout`.
cudaError_t launch_accumulate(void* dst, const void* src, const StridedLayout& layout,
                              ElementKind kind, CombineKind combine, cudaStream_t stream);

/// dst = factor * dst elementwise over `layout` (dst strides only).
cudaError_t launch_scale(void* dst, const StridedLayout& layout, ElementKind kind, double factor,
                         cudaStream_t stream);

/// dst[i] = src[i] converted, for `count` contiguous elements.
cudaError_t launch_convert(void* dst, ElementKind dst_kind, const void* src, ElementKind src_kind,
                           int64_t count, cudaStream_t stream);

/// Deterministic sum of `count` contiguous elements in double: pass one reduces block b's fixed
/// range into workspace[b] (b < partial_count, `threads` threads per block, a fixed tree), pass
/// two reduces the partials in one block into workspace[partial_count]. The order depends only
/// on count, partial_count and threads. `workspace` holds partial_count + 1 doubles.
cudaError_t launch_sum(const void* data, int64_t count, ElementKind kind, int partial_count,
                       int threads, double* workspace, cudaStream_t stream);

}  // namespace tessera::gpu::kernels
