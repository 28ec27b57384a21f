// Plain C++ conv kernels: every conv is run as a conv3d (conv1d/conv2d have unit leading dims),
// templated on the element type. Accumulation: f64 accumulates in double; f32 accumulates the
// forward and backward-data sums in float (like oneDNN), and the weight gradient in float along
// one output row, then in double across rows (it sums N * |O| terms per weight).
//
// Every loop nest ends in a loop over consecutive output positions along the width, so the
// output (or dy) side is unit-stride and the input side has the conv's stride (unit for
// stride 1): those loops vectorise. Rows are cut into chunks of at most kRowChunk positions so
// that the rows a chunk touches stay in L1 even for long conv1d inputs.
#include "ops/conv/conv_reference.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

namespace tessera::ops {
namespace {

constexpr int64_t kRowChunk = 256;     // output positions per accumulator row
constexpr int64_t kChannelBlock = 16;  // output channels accumulated together in the forward

// Extents and element strides of a problem, every conv seen as a conv3d.
struct Geometry3d {
  int64_t batch, groups, in_per_group, out_per_group;
  int64_t in_d, in_h, in_w;
  int64_t k_d, k_h, k_w;
  int64_t out_d, out_h, out_w;
  int64_t stride_d, stride_h, stride_w;
  int64_t dilation_d, dilation_h, dilation_w;
  int64_t x_channel, x_batch;           // x strides of one channel plane and one batch item
  int64_t y_channel, y_batch;           // y strides of one channel plane and one batch item
  int64_t w_in_channel, w_out_channel;  // w strides: one kernel volume, one output channel

  explicit Geometry3d(const ConvProblem& p)
      : batch(p.batch),
        groups(p.groups),
        in_per_group(p.in_channels_per_group()),
        out_per_group(p.out_channels_per_group()),
        in_d(p.input[0]),
        in_h(p.input[1]),
        in_w(p.input[2]),
        k_d(p.kernel[0]),
        k_h(p.kernel[1]),
        k_w(p.kernel[2]),
        out_d(p.output[0]),
        out_h(p.output[1]),
        out_w(p.output[2]),
        stride_d(p.stride[0]),
        stride_h(p.stride[1]),
        stride_w(p.stride[2]),
        dilation_d(p.dilation[0]),
        dilation_h(p.dilation[1]),
        dilation_w(p.dilation[2]),
        x_channel(in_d * in_h * in_w),
        x_batch(p.in_channels * x_channel),
        y_channel(out_d * out_h * out_w),
        y_batch(p.out_channels * y_channel),
        w_in_channel(k_d * k_h * k_w),
        w_out_channel(in_per_group * w_in_channel) {}

  // Offset of input row (id, ih) inside one channel plane.
  int64_t x_row(int64_t id, int64_t ih) const { return (id * in_h + ih) * in_w; }
  // Offset of output row (od, oh) inside one channel plane.
  int64_t y_row(int64_t od, int64_t oh) const { return (od * out_h + oh) * out_w; }
};

// acc[i] += alpha * x[i * stride] for i < count.
template <typename T>
inline void axpy(T* __restrict acc, T alpha, const T* __restrict x, int64_t stride, int64_t count) {
  if (stride == 1) {
    for (int64_t i = 0; i < count; ++i) acc[i] += alpha * x[i];
  } else {
    for (int64_t i = 0; i < count; ++i) acc[i] += alpha * x[i * stride];
  }
}

// dst[i * stride] += alpha * src[i] for i < count (the adjoint of axpy's read pattern).
template <typename T>
inline void scatter_axpy(T* __restrict dst, T alpha, const T* __restrict src, int64_t stride,
                         int64_t count) {
  if (stride == 1) {
    for (int64_t i = 0; i < count; ++i) dst[i] += alpha * src[i];
  } else {
    for (int64_t i = 0; i < count; ++i) dst[i * stride] += alpha * src[i];
  }
}

// sum over i < count of a[i] * b[i * stride]; eight independent partial sums let the unit
// stride loop vectorise without reassociation flags.
template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t stride, int64_t count) {
  constexpr int kLanes = 8;
  T partial[kLanes] = {};
  int64_t i = 0;
  if (stride == 1) {
    for (; i + kLanes <= count; i += kLanes)
      for (int lane = 0; lane < kLanes; ++lane) partial[lane] += a[i + lane] * b[i + lane];
  } else {
    for (; i + kLanes <= count; i += kLanes)
      for (int lane = 0; lane < kLanes; ++lane)
        partial[lane] += a[i + lane] * b[(i + lane) * stride];
  }
  T sum = 0;
  for (; i < count; ++i) sum += a[i] * b[i * stride];
  for (int lane = 0; lane < kLanes; ++lane) sum += partial[lane];
  return sum;
}

// Forward: for a block of output channels and one chunk of one output row, the accumulators
// stay in L1 while every (input channel, kernel offset) adds one shifted input row to them.
template <typename T>
void forward_typed(const ConvProblem& problem, const T* x, const T* w, const T* bias, T* y) {
  const Geometry3d g(problem);
  std::vector<T> acc(static_cast<size_t>(kChannelBlock * kRowChunk));
  for (int64_t n = 0; n < g.batch; ++n) {
    for (int64_t group = 0; group < g.groups; ++group) {
      const T* x_group = x + n * g.x_batch + group * g.in_per_group * g.x_channel;
      for (int64_t co0 = 0; co0 < g.out_per_group; co0 += kChannelBlock) {
        const int64_t block = std::min(kChannelBlock, g.out_per_group - co0);
        const int64_t co_first = group * g.out_per_group + co0;  // global output channel
        const T* w_block = w + co_first * g.w_out_channel;
        for (int64_t od = 0; od < g.out_d; ++od) {
          for (int64_t oh = 0; oh < g.out_h; ++oh) {
            for (int64_t ow0 = 0; ow0 < g.out_w; ow0 += kRowChunk) {
              const int64_t count = std::min(kRowChunk, g.out_w - ow0);
              for (int64_t c = 0; c < block; ++c)
                std::fill_n(acc.data() + c * kRowChunk, count,
                            bias != nullptr ? bias[co_first + c] : T(0));
              for (int64_t ci = 0; ci < g.in_per_group; ++ci) {
                const T* x_channel = x_group + ci * g.x_channel;
                const T* w_channel = w_block + ci * g.w_in_channel;
                for (int64_t kd = 0; kd < g.k_d; ++kd) {
                  const int64_t id = od * g.stride_d + kd * g.dilation_d;
                  for (int64_t kh = 0; kh < g.k_h; ++kh) {
                    const int64_t ih = oh * g.stride_h + kh * g.dilation_h;
                    const T* x_row = x_channel + g.x_row(id, ih) + ow0 * g.stride_w;
                    const T* w_taps = w_channel + (kd * g.k_h + kh) * g.k_w;
                    for (int64_t kw = 0; kw < g.k_w; ++kw) {
                      const T* x_taps = x_row + kw * g.dilation_w;
                      for (int64_t c = 0; c < block; ++c)
                        axpy(acc.data() + c * kRowChunk, w_taps[c * g.w_out_channel + kw], x_taps,
                             g.stride_w, count);
                    }
                  }
                }
              }
              for (int64_t c = 0; c < block; ++c)
                std::copy_n(
                    acc.data() + c * kRowChunk, count,
                    y + n * g.y_batch + (co_first + c) * g.y_channel + g.y_row(od, oh) + ow0);
            }
          }
        }
      }
    }
  }
}

// Backward data: each chunk of a dy row is scattered, through every kernel tap, into the input
// rows it was read from. dx starts at zero, so positions no output reads stay 0.
template <typename T>
void backward_data_typed(const ConvProblem& problem, const T* dy, const T* w, T* dx) {
  const Geometry3d g(problem);
  std::memset(dx, 0, sizeof(T) * static_cast<size_t>(g.batch * g.x_batch));
  for (int64_t n = 0; n < g.batch; ++n) {
    for (int64_t group = 0; group < g.groups; ++group) {
      T* dx_group = dx + n * g.x_batch + group * g.in_per_group * g.x_channel;
      for (int64_t od = 0; od < g.out_d; ++od) {
        for (int64_t oh = 0; oh < g.out_h; ++oh) {
          for (int64_t ow0 = 0; ow0 < g.out_w; ow0 += kRowChunk) {
            const int64_t count = std::min(kRowChunk, g.out_w - ow0);
            for (int64_t co = 0; co < g.out_per_group; ++co) {
              const int64_t co_global = group * g.out_per_group + co;
              const T* dy_row =
                  dy + n * g.y_batch + co_global * g.y_channel + g.y_row(od, oh) + ow0;
              const T* w_out = w + co_global * g.w_out_channel;
              for (int64_t ci = 0; ci < g.in_per_group; ++ci) {
                T* dx_channel = dx_group + ci * g.x_channel;
                const T* w_channel = w_out + ci * g.w_in_channel;
                for (int64_t kd = 0; kd < g.k_d; ++kd) {
                  const int64_t id = od * g.stride_d + kd * g.dilation_d;
                  for (int64_t kh = 0; kh < g.k_h; ++kh) {
                    const int64_t ih = oh * g.stride_h + kh * g.dilation_h;
                    T* dx_row = dx_channel + g.x_row(id, ih) + ow0 * g.stride_w;
                    const T* w_taps = w_channel + (kd * g.k_h + kh) * g.k_w;
                    for (int64_t kw = 0; kw < g.k_w; ++kw)
                      scatter_axpy(dx_row + kw * g.dilation_w, w_taps[kw], dy_row, g.stride_w,
                                   count);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

// Backward weight: dw[co, ci, kd, kh, kw] is the dot product of dy rows with the input rows
// they read, summed over batch and output rows. One input row chunk feeds every output channel
// of its group while it is in L1.
template <typename T>
void backward_weight_typed(const ConvProblem& problem, const T* x, const T* dy, T* dw) {
  const Geometry3d g(problem);
  const int64_t weight_count = g.groups * g.out_per_group * g.w_out_channel;
  std::vector<double> dw_sum(static_cast<size_t>(weight_count), 0.0);
  for (int64_t n = 0; n < g.batch; ++n) {
    for (int64_t group = 0; group < g.groups; ++group) {
      const T* x_group = x + n * g.x_batch + group * g.in_per_group * g.x_channel;
      const T* dy_group = dy + n * g.y_batch + group * g.out_per_group * g.y_channel;
      double* dw_group = dw_sum.data() + group * g.out_per_group * g.w_out_channel;
      for (int64_t od = 0; od < g.out_d; ++od) {
        for (int64_t oh = 0; oh < g.out_h; ++oh) {
          for (int64_t ow0 = 0; ow0 < g.out_w; ow0 += kRowChunk) {
            const int64_t count = std::min(kRowChunk, g.out_w - ow0);
            const T* dy_rows = dy_group + g.y_row(od, oh) + ow0;
            for (int64_t ci = 0; ci < g.in_per_group; ++ci) {
              const T* x_channel = x_group + ci * g.x_channel;
              for (int64_t kd = 0; kd < g.k_d; ++kd) {
                const int64_t id = od * g.stride_d + kd * g.dilation_d;
                for (int64_t kh = 0; kh < g.k_h; ++kh) {
                  const int64_t ih = oh * g.stride_h + kh * g.dilation_h;
                  const T* x_row = x_channel + g.x_row(id, ih) + ow0 * g.stride_w;
                  const int64_t tap_offset = ci * g.w_in_channel + (kd * g.k_h + kh) * g.k_w;
                  for (int64_t co = 0; co < g.out_per_group; ++co) {
                    const T* dy_row = dy_rows + co * g.y_channel;
                    double* dw_taps = dw_group + co * g.w_out_channel + tap_offset;
                    for (int64_t kw = 0; kw < g.k_w; ++kw)
                      dw_taps[kw] += dot(dy_row, x_row + kw * g.dilation_w, g.stride_w, count);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < weight_count; ++i) dw[i] = static_cast<T>(dw_sum[i]);
}

// Calls fn.template operator()<T>() for the two dtypes the conv kernels support.
template <typename Fn>
void dispatch_float(DType dtype, Fn&& fn) {
  if (dtype == DType::f64)
    fn.template operator()<double>();
  else
    fn.template operator()<float>();
}

}  // namespace

void conv_forward_reference(const ConvProblem& problem, const Tensor& x, const Tensor& w,
                            const Tensor* bias, Tensor& y) {
  dispatch_float(problem.dtype, [&]<typename T>() {
    forward_typed<T>(problem, x.data<T>(), w.data<T>(), bias != nullptr ? bias->data<T>() : nullptr,
                     y.data<T>());
  });
}

void conv_backward_data_reference(const ConvProblem& problem, const Tensor& dy, const Tensor& w,
                                  Tensor& dx) {
  dispatch_float(problem.dtype, [&]<typename T>() {
    backward_data_typed<T>(problem, dy.data<T>(), w.data<T>(), dx.data<T>());
  });
}

void conv_backward_weight_reference(const ConvProblem& problem, const Tensor& x, const Tensor& dy,
                                    Tensor& dw) {
  dispatch_float(problem.dtype, [&]<typename T>() {
    backward_weight_typed<T>(problem, x.data<T>(), dy.data<T>(), dw.data<T>());
  });
}

}  // namespace tessera::ops
