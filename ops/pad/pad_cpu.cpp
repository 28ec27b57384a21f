// The cpu pad kernels (pad_cpu.hpp): source tables per padded dim, then each thread walks its
// planes' outputs.
#include "ops/pad/pad_cpu.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/parallel_for.hpp"

namespace tessera::ops {

namespace {

using kernels::PadPlan;

constexpr const char* kOp = "pad";

/// The local source (or -1) of every local output index along each of the three dims.
std::array<std::vector<int64_t>, 3> taps_of(const PadPlan& plan) {
  std::array<std::vector<int64_t>, 3> taps;
  for (int d = 0; d < 3; ++d)
    for (int64_t j = 0; j < plan.dims[d].out; ++j)
      taps[d].push_back(kernels::pad_tap(plan.mode, plan.dims[d], j));
  return taps;
}

/// Calls fn.template operator()<T, Compute>() for the floating dtypes.
template <typename Fn>
void dispatch_pad(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32: fn.template operator()<float, float>(); return;
    case DType::f64: fn.template operator()<double, double>(); return;
    case DType::f16: fn.template operator()<Half, float>(); return;
    case DType::bf16: fn.template operator()<BFloat16, float>(); return;
    default: break;
  }
  throw InvalidArgument(kOp, fmt::format("needs a floating tensor, got {}", dtype_name(dtype)));
}

}  // namespace

Tensor pad_forward_cpu(const PadPlan& plan, const Tensor& x, const Shape& y_shape) {
  TESSERA_CHECK_ARG(x.device().is_cpu(), kOp, "cpu kernel got a {} tensor", x.str());
  const Tensor input = x.contiguous();
  Tensor y = Tensor::empty(y_shape, input.dtype());
  if (y.numel() == 0) return y;
  const int64_t in_plane = plan.in_plane(), out_plane = plan.out_plane();
  const int64_t in1 = plan.dims[1].in, in2 = plan.dims[2].in;
  const auto taps = taps_of(plan);
  dispatch_pad(input.dtype(), [&]<typename T, typename C>() {
    const T* in = static_cast<const T*>(input.raw_data());
    T* out = static_cast<T*>(y.raw_data());
    const T value = T(static_cast<C>(plan.value));
    parallel_for(plan.planes, compute_threads(), [&](int64_t begin, int64_t end, int) {
      for (int64_t p = begin; p < end; ++p) {
        const T* plane = in + p * in_plane;
        T* target = out + p * out_plane;
        int64_t o = 0;
        for (int64_t a : taps[0])
          for (int64_t b : taps[1]) {
            // A padding row has no source row (the input piece may even be empty): no pointer
            // into it is formed.
            if (a < 0 || b < 0) {
              for (size_t c = 0; c < taps[2].size(); ++c) target[o++] = value;
              continue;
            }
            const T* row = plane + (a * in1 + b) * in2;
            for (int64_t c : taps[2]) target[o++] = c < 0 ? value : row[c];
          }
      }
    });
  });
  return y;
}

Tensor pad_backward_cpu(const PadPlan& plan, const Shape& x_shape, const Tensor& gy) {
  TESSERA_CHECK_ARG(gy.device().is_cpu(), kOp, "cpu kernel got a {} gradient", gy.str());
  const Tensor grad = gy.contiguous();
  Tensor dx = Tensor::zeros(x_shape, grad.dtype());
  const int64_t in_plane = plan.in_plane(), out_plane = plan.out_plane();
  if (grad.numel() == 0 || dx.numel() == 0) return dx;
  const int64_t in1 = plan.dims[1].in, in2 = plan.dims[2].in;
  const auto taps = taps_of(plan);
  dispatch_pad(grad.dtype(), [&]<typename T, typename C>() {
    const T* g = static_cast<const T*>(grad.raw_data());
    T* out = static_cast<T*>(dx.raw_data());
    parallel_for(plan.planes, compute_threads(), [&](int64_t begin, int64_t end, int) {
      // Accumulated in the computation type, one plane at a time, then rounded once.
      std::vector<C> acc(static_cast<size_t>(in_plane));
      for (int64_t p = begin; p < end; ++p) {
        std::fill(acc.begin(), acc.end(), C(0));
        const T* g_plane = g + p * out_plane;
        int64_t o = 0;
        for (int64_t a : taps[0])
          for (int64_t b : taps[1]) {
            if (a < 0 || b < 0) {  // gradients of padding cells go nowhere
              o += static_cast<int64_t>(taps[2].size());
              continue;
            }
            C* row = acc.data() + (a * in1 + b) * in2;
            for (int64_t c : taps[2]) {
              const C value = static_cast<C>(g_plane[o++]);
              if (c >= 0) row[c] += value;
            }
          }
        T* target = out + p * in_plane;
        for (int64_t i = 0; i < in_plane; ++i) target[i] = T(acc[i]);
      }
    });
  });
  return dx;
}

}  // namespace tessera::ops
