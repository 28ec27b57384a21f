// The cpu interpolate kernels (interpolate_cpu.hpp): tap tables per spatial dim, then each thread
// walks its planes' outputs, combining the two source cells of the innermost dim first (as
// PyTorch's kernels do).
#include "ops/interpolate/interpolate_cpu.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/parallel_for.hpp"

namespace tessera::ops {

namespace {

using kernels::InterpPlan;
using kernels::InterpTap;

constexpr const char* kOp = "interpolate";

/// One dim's table entry in the computation type.
template <typename C>
struct Tap {
  int64_t i0, i1;
  C w0, w1;
};

template <typename C>
std::array<std::vector<Tap<C>>, 3> taps_of(const InterpPlan& plan) {
  std::array<std::vector<Tap<C>>, 3> taps;
  for (int d = 0; d < 3; ++d)
    for (int64_t j = 0; j < plan.dims[d].out; ++j) {
      const InterpTap tap = kernels::interp_tap(plan.mode, plan.dims[d], j);
      taps[d].push_back({tap.i0, tap.i1, static_cast<C>(tap.w0), static_cast<C>(tap.w1)});
    }
  return taps;
}

/// Whether `dim` is a unit dim (the padding of a 1-d or 2-d interpolation to three dims, or an
/// extent-1 dim kept at 1): its second source cell is the first with weight 0, so the linear
/// kernels skip it (as PyTorch's 1-d and 2-d kernels never see it).
bool unit(const kernels::InterpDim& dim) {
  return dim.in == 1 && dim.out == 1 && dim.length == 1;
}

/// Calls fn.template operator()<T, Compute>() for the floating dtypes.
template <typename Fn>
void dispatch_interp(DType dtype, Fn&& fn) {
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

Tensor interpolate_forward_cpu(const InterpPlan& plan, const Tensor& x, const Shape& y_shape) {
  TESSERA_CHECK_ARG(x.device().is_cpu(), kOp, "cpu kernel got a {} tensor", x.str());
  const Tensor input = x.contiguous();
  Tensor y = Tensor::empty(y_shape, input.dtype());
  if (y.numel() == 0) return y;
  const int64_t in_plane = plan.in_plane(), out_plane = plan.out_plane();
  const int64_t in1 = plan.dims[1].in, in2 = plan.dims[2].in;
  const bool flat0 = unit(plan.dims[0]), flat1 = flat0 && unit(plan.dims[1]);
  dispatch_interp(input.dtype(), [&]<typename T, typename C>() {
    const auto taps = taps_of<C>(plan);
    const T* in = static_cast<const T*>(input.raw_data());
    T* out = static_cast<T*>(y.raw_data());
    parallel_for(plan.planes, compute_threads(), [&](int64_t begin, int64_t end, int) {
      for (int64_t p = begin; p < end; ++p) {
        const T* plane = in + p * in_plane;
        T* target = out + p * out_plane;
        int64_t o = 0;
        if (plan.mode != kernels::InterpMode::linear) {  // a copy of the source cell
          for (const Tap<C>& a : taps[0])
            for (const Tap<C>& b : taps[1]) {
              const T* row = plane + (a.i0 * in1 + b.i0) * in2;
              for (const Tap<C>& c : taps[2]) target[o++] = row[c.i0];
            }
          continue;
        }
        for (const Tap<C>& a : taps[0]) {
          for (const Tap<C>& b : taps[1]) {
            const T* r00 = plane + (a.i0 * in1 + b.i0) * in2;
            const T* r01 = plane + (a.i0 * in1 + b.i1) * in2;
            const T* r10 = plane + (a.i1 * in1 + b.i0) * in2;
            const T* r11 = plane + (a.i1 * in1 + b.i1) * in2;
            for (const Tap<C>& c : taps[2]) {
              auto row = [&](const T* r) {
                return c.w0 * static_cast<C>(r[c.i0]) + c.w1 * static_cast<C>(r[c.i1]);
              };
              const C value = flat0 && flat1 ? row(r00)
                              : flat0        ? b.w0 * row(r00) + b.w1 * row(r01)
                                             : a.w0 * (b.w0 * row(r00) + b.w1 * row(r01)) +
                                            a.w1 * (b.w0 * row(r10) + b.w1 * row(r11));
              target[o++] = T(value);
            }
          }
        }
      }
    });
  });
  return y;
}

Tensor interpolate_backward_cpu(const InterpPlan& plan, const Shape& x_shape, const Tensor& gy) {
  TESSERA_CHECK_ARG(gy.device().is_cpu(), kOp, "cpu kernel got a {} gradient", gy.str());
  const Tensor grad = gy.contiguous();
  Tensor dx = Tensor::zeros(x_shape, grad.dtype());
  const int64_t in_plane = plan.in_plane(), out_plane = plan.out_plane();
  if (grad.numel() == 0 || dx.numel() == 0) return dx;
  const int64_t in1 = plan.dims[1].in, in2 = plan.dims[2].in;
  // The corner rows a gradient cell reaches: 1 (1-d), 2 (2-d) or 4 (3-d), rows listed first.
  const bool flat0 = unit(plan.dims[0]), flat1 = flat0 && unit(plan.dims[1]);
  const int corners = flat1 ? 1 : flat0 ? 2 : 4;
  dispatch_interp(grad.dtype(), [&]<typename T, typename C>() {
    const auto taps = taps_of<C>(plan);
    const T* g = static_cast<const T*>(grad.raw_data());
    T* out = static_cast<T*>(dx.raw_data());
    parallel_for(plan.planes, compute_threads(), [&](int64_t begin, int64_t end, int) {
      // Accumulated in the computation type, one plane at a time, then rounded once.
      std::vector<C> acc(static_cast<size_t>(in_plane));
      for (int64_t p = begin; p < end; ++p) {
        std::fill(acc.begin(), acc.end(), C(0));
        const T* g_plane = g + p * out_plane;
        int64_t o = 0;
        if (plan.mode != kernels::InterpMode::linear) {  // the whole gradient to the source cell
          for (const Tap<C>& a : taps[0])
            for (const Tap<C>& b : taps[1]) {
              C* row = acc.data() + (a.i0 * in1 + b.i0) * in2;
              for (const Tap<C>& c : taps[2]) row[c.i0] += static_cast<C>(g_plane[o++]);
            }
        } else {
          for (const Tap<C>& a : taps[0]) {
            for (const Tap<C>& b : taps[1]) {
              C* rows[4] = {
                  acc.data() + (a.i0 * in1 + b.i0) * in2, acc.data() + (a.i0 * in1 + b.i1) * in2,
                  acc.data() + (a.i1 * in1 + b.i0) * in2, acc.data() + (a.i1 * in1 + b.i1) * in2};
              const C weights[4] = {flat0 && flat1 ? C(1)
                                    : flat0        ? b.w0
                                                   : a.w0 * b.w0,
                                    flat0 ? b.w1 : a.w0 * b.w1, a.w1 * b.w0, a.w1 * b.w1};
              for (const Tap<C>& c : taps[2]) {
                const C value = static_cast<C>(g_plane[o++]);
                for (int k = 0; k < corners; ++k) {
                  rows[k][c.i0] += weights[k] * c.w0 * value;
                  rows[k][c.i1] += weights[k] * c.w1 * value;
                }
              }
            }
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
