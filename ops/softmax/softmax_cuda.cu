// Device code of softmax and log_softmax (see softmax_cuda.cuh).
#include <cstdint>

#include "ops/cuda_elements.cuh"
#include "ops/softmax/softmax_cuda.cuh"
#include "ops/softmax/softmax_rows.cuh"

namespace tessera::ops::kernels {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

/// The first element of slot `slot` and the stride along the dim.
__device__ __forceinline__ int64_t slot_base(const SoftmaxSlots& s, int64_t slot) {
  const int64_t o = slot / s.inner, i = slot % s.inner;
  return o * s.length * s.inner + i;
}

using rows::widen;

template <typename T>
__device__ __forceinline__ T narrow(double v) {
  return from_compute<T>(static_cast<Compute<T>>(v));
}

template <typename T>
__global__ void peak_kernel(SoftmaxSlots s, const T* x, double* peak) {
  const int64_t slots = s.outer * s.inner;
  for (int64_t slot = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; slot < slots;
       slot += int64_t{gridDim.x} * blockDim.x) {
    const int64_t base = slot_base(s, slot);
    double best = -INFINITY;
    for (int64_t l = 0; l < s.length; ++l) {
      const double v = widen(x[base + l * s.inner]);
      if (isnan(v) || v > best) best = v;
    }
    peak[slot] = best;
  }
}

template <typename T>
__global__ void total_kernel(SoftmaxSlots s, const T* x, const double* peak, double* total) {
  const int64_t slots = s.outer * s.inner;
  for (int64_t slot = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; slot < slots;
       slot += int64_t{gridDim.x} * blockDim.x) {
    const int64_t base = slot_base(s, slot);
    double sum = 0;
    for (int64_t l = 0; l < s.length; ++l) sum += exp(widen(x[base + l * s.inner]) - peak[slot]);
    total[slot] = sum;
  }
}

/// The slot of element `at` of the piece.
__device__ __forceinline__ int64_t slot_of(const SoftmaxSlots& s, int64_t at) {
  return at / (s.length * s.inner) * s.inner + at % s.inner;
}

// The outputs element by element (adjacent threads on adjacent elements, whatever the layout).
// `norm` holds each slot's total, or its log for log_softmax (log_kernel, once per slot).
template <typename T>
__global__ void output_kernel(SoftmaxSlots s, const T* x, const double* peak, const double* norm,
                              bool log_output, T* y) {
  const int64_t count = s.outer * s.length * s.inner;
  for (int64_t at = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; at < count;
       at += int64_t{gridDim.x} * blockDim.x) {
    const int64_t slot = slot_of(s, at);
    const double shifted = widen(x[at]) - peak[slot];
    y[at] = narrow<T>(log_output ? shifted - norm[slot] : exp(shifted) / norm[slot]);
  }
}

__global__ void log_kernel(double* values, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    values[i] = log(values[i]);
}

template <typename T>
__global__ void grad_total_kernel(SoftmaxSlots s, const T* y, const T* g, bool log_output,
                                  double* total) {
  const int64_t slots = s.outer * s.inner;
  for (int64_t slot = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; slot < slots;
       slot += int64_t{gridDim.x} * blockDim.x) {
    const int64_t base = slot_base(s, slot);
    double sum = 0;
    for (int64_t l = 0; l < s.length; ++l) {
      const int64_t at = base + l * s.inner;
      sum += log_output ? widen(g[at]) : widen(g[at]) * widen(y[at]);
    }
    total[slot] = sum;
  }
}

template <typename T>
__global__ void grad_kernel(SoftmaxSlots s, const T* y, const T* g, const double* total,
                            bool log_output, T* dx) {
  const int64_t count = s.outer * s.length * s.inner;
  for (int64_t at = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; at < count;
       at += int64_t{gridDim.x} * blockDim.x) {
    const double t = total[slot_of(s, at)];
    const double yv = widen(y[at]), gv = widen(g[at]);
    dx[at] = narrow<T>(log_output ? gv - exp(yv) * t : yv * (gv - t));
  }
}

// Along a contiguous dim (inner == 1) the statistics come from softmax_rows.cuh: a warp per row.
using rows::row_grad_total_kernel;
using rows::row_peak_kernel;
using rows::row_total_kernel;

/// Blocks for one warp per row.
int row_blocks_for(int64_t rows) {
  return blocks_for(rows * 32);
}

__global__ void combine_kernel(const double* gathered, int64_t ranks, int64_t count, bool max,
                               double* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    double result = gathered[i];
    for (int64_t r = 1; r < ranks; ++r) {
      const double v = gathered[r * count + i];
      result = max ? (isnan(v) || v > result ? v : result) : result + v;
    }
    out[i] = result;
  }
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

}  // namespace

cudaError_t launch_softmax_peak(ElementType type, SoftmaxSlots s, const void* x, double* peak,
                                cudaStream_t stream) {
  const int64_t slots = s.outer * s.inner;
  if (slots == 0) return cudaSuccess;
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    if (s.inner == 1)
      row_peak_kernel<T>
          <<<row_blocks_for(s.outer), kThreads, 0, stream>>>(s, static_cast<const T*>(x), peak);
    else
      peak_kernel<T><<<blocks_for(slots), kThreads, 0, stream>>>(s, static_cast<const T*>(x), peak);
    return cudaGetLastError();
  });
}

cudaError_t launch_softmax_total(ElementType type, SoftmaxSlots s, const void* x,
                                 const double* peak, double* total, cudaStream_t stream) {
  const int64_t slots = s.outer * s.inner;
  if (slots == 0) return cudaSuccess;
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    if (s.inner == 1)
      row_total_kernel<T><<<row_blocks_for(s.outer), kThreads, 0, stream>>>(
          s, static_cast<const T*>(x), peak, total);
    else
      total_kernel<T>
          <<<blocks_for(slots), kThreads, 0, stream>>>(s, static_cast<const T*>(x), peak, total);
    return cudaGetLastError();
  });
}

cudaError_t launch_softmax_output(ElementType type, SoftmaxSlots s, const void* x,
                                  const double* peak, const double* norm, bool log, void* y,
                                  cudaStream_t stream) {
  const int64_t slots = s.outer * s.inner;
  if (slots == 0) return cudaSuccess;
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    output_kernel<T><<<blocks_for(slots * s.length), kThreads, 0, stream>>>(
        s, static_cast<const T*>(x), peak, norm, log, static_cast<T*>(y));
    return cudaGetLastError();
  });
}

cudaError_t launch_softmax_grad_total(ElementType type, SoftmaxSlots s, const void* y,
                                      const void* g, bool log, double* total, cudaStream_t stream) {
  const int64_t slots = s.outer * s.inner;
  if (slots == 0) return cudaSuccess;
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    if (s.inner == 1)
      row_grad_total_kernel<T><<<row_blocks_for(s.outer), kThreads, 0, stream>>>(
          s, static_cast<const T*>(y), static_cast<const T*>(g), log, total);
    else
      grad_total_kernel<T><<<blocks_for(slots), kThreads, 0, stream>>>(
          s, static_cast<const T*>(y), static_cast<const T*>(g), log, total);
    return cudaGetLastError();
  });
}

cudaError_t launch_softmax_grad(ElementType type, SoftmaxSlots s, const void* y, const void* g,
                                const double* total, bool log, void* dx, cudaStream_t stream) {
  const int64_t slots = s.outer * s.inner;
  if (slots == 0) return cudaSuccess;
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    grad_kernel<T><<<blocks_for(slots * s.length), kThreads, 0, stream>>>(
        s, static_cast<const T*>(y), static_cast<const T*>(g), total, log, static_cast<T*>(dx));
    return cudaGetLastError();
  });
}

cudaError_t launch_softmax_log_totals(double* total, int64_t slots, cudaStream_t stream) {
  if (slots == 0) return cudaSuccess;
  log_kernel<<<blocks_for(slots), kThreads, 0, stream>>>(total, slots);
  return cudaGetLastError();
}

cudaError_t launch_combine_rows(const double* gathered, int64_t ranks, int64_t count, bool max,
                                double* out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  combine_kernel<<<blocks_for(count), kThreads, 0, stream>>>(gathered, ranks, count, max, out);
  return cudaGetLastError();
}

}  // namespace tessera::ops::kernels
