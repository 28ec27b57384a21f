// Public conv entry points: argument validation, output shapes, empty problems, and the choice
// between the reference and oneDNN backends (cpu tensors) and cuDNN (cuda tensors). The backends
// assume everything checked here.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/checked_math.hpp"
#include "core/compute_threads.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/parallel_for.hpp"
#include "ops/conv/conv_cudnn.hpp"
#include "ops/conv/conv_cudnn_key.hpp"
#include "ops/conv/conv_kernels.hpp"
#include "ops/conv/conv_onednn.hpp"
#include "ops/conv/conv_problem.hpp"
#include "ops/conv/conv_reference.hpp"

namespace tessera::ops {
namespace {

constexpr std::string_view kOp = "conv";

// "(2,3,4)": the shape notation of error messages.
std::string shape_text(const Shape& shape) {
  return fmt::format("({})", fmt::join(shape, ","));
}

// The number of spatial dims a geometry asks for; with neither stride nor dilation given, the
// input's rank decides.
int spatial_dims_of(const ConvGeometry& geometry, const Shape& x_shape) {
  if (!geometry.stride.empty()) return static_cast<int>(geometry.stride.size());
  if (!geometry.dilation.empty()) return static_cast<int>(geometry.dilation.size());
  return static_cast<int>(x_shape.size()) - 2;
}

// Validates shapes and geometry of a conv of x_shape with w_shape and returns the problem. An
// input (padded) smaller than the dilated kernel is legal: its output extent is 0.
ConvProblem make_problem(const Shape& x_shape, const Shape& w_shape, const ConvGeometry& geometry,
                         DType dtype) {
  const int dims = spatial_dims_of(geometry, x_shape);
  if (geometry.stride.empty() && geometry.dilation.empty())
    check_arg(dims >= 1 && dims <= 3, kOp,
              "expected a 3-, 4- or 5-d input for conv1d/2d/3d, got shape {}", shape_text(x_shape));
  check_arg(dims >= 1 && dims <= 3, kOp,
            "stride and dilation name {} spatial dims, expected 1, 2 or 3", dims);
  check_arg(geometry.stride.empty() || static_cast<int>(geometry.stride.size()) == dims, kOp,
            "stride has {} entries, expected {} (one per spatial dim)", geometry.stride.size(),
            dims);
  check_arg(geometry.dilation.empty() || static_cast<int>(geometry.dilation.size()) == dims, kOp,
            "dilation has {} entries, expected {} (one per spatial dim)", geometry.dilation.size(),
            dims);
  for (const std::vector<int64_t>* pad : {&geometry.pad_lo, &geometry.pad_hi})
    check_arg(pad->empty() || static_cast<int>(pad->size()) == dims, kOp,
              "padding has {} entries, expected {} (one per spatial dim)", pad->size(), dims);
  check_arg(static_cast<int>(x_shape.size()) == dims + 2, kOp,
            "expected a {}-d input for conv{}d, got shape {}", dims + 2, dims, shape_text(x_shape));
  check_arg(static_cast<int>(w_shape.size()) == dims + 2, kOp,
            "expected a {}-d weight for conv{}d, got shape {}", dims + 2, dims,
            shape_text(w_shape));
  for (int64_t extent : x_shape)
    check_arg(extent >= 0, kOp, "input shape {} has a negative extent", shape_text(x_shape));
  for (int64_t extent : w_shape)
    check_arg(extent >= 0, kOp, "weight shape {} has a negative extent", shape_text(w_shape));
  check_arg(geometry.groups >= 1, kOp, "groups {} must be >= 1", geometry.groups);

  ConvProblem problem;
  problem.spatial_dims = dims;
  problem.dtype = dtype;
  problem.batch = x_shape[0];
  problem.in_channels = x_shape[1];
  problem.out_channels = w_shape[0];
  problem.groups = geometry.groups;
  check_arg(problem.in_channels % problem.groups == 0, kOp,
            "input channels {} not divisible by groups {}", problem.in_channels, problem.groups);
  check_arg(problem.out_channels % problem.groups == 0, kOp,
            "output channels {} not divisible by groups {}", problem.out_channels, problem.groups);
  check_arg(w_shape[1] == problem.in_channels_per_group(), kOp,
            "weight shape {} has {} input channels per group, expected {} (input channels {} / "
            "groups {})",
            shape_text(w_shape), w_shape[1], problem.in_channels_per_group(), problem.in_channels,
            problem.groups);

  for (int d = 0; d < dims; ++d) {
    const int slot = 3 - dims + d;  // the (depth, height, width) slot of spatial dim d
    const int64_t stride = geometry.stride.empty() ? 1 : geometry.stride[d];
    const int64_t dilation = geometry.dilation.empty() ? 1 : geometry.dilation[d];
    const int64_t kernel = w_shape[2 + d];
    const int64_t input = x_shape[2 + d];
    check_arg(stride >= 1, kOp, "stride {} along spatial dim {} must be >= 1", stride, d);
    check_arg(dilation >= 1, kOp, "dilation {} along spatial dim {} must be >= 1", dilation, d);
    check_arg(kernel >= 1, kOp, "kernel extent {} along spatial dim {} must be >= 1 (weight {})",
              kernel, d, shape_text(w_shape));
    const int64_t lo = geometry.pad_lo.empty() ? 0 : geometry.pad_lo[d];
    const int64_t hi = geometry.pad_hi.empty() ? 0 : geometry.pad_hi[d];
    check_arg(lo >= 0 && hi >= 0, kOp, "padding ({}, {}) along spatial dim {} must be >= 0", lo, hi,
              d);
    const int64_t span = checked_add(checked_mul(dilation, kernel - 1, kOp, "dilated kernel"), 1,
                                     kOp, "dilated kernel");  // input positions one output reads
    const int64_t padded =
        checked_add(checked_add(input, lo, kOp, "padded input"), hi, kOp, "padded input");
    problem.stride[slot] = stride;
    problem.dilation[slot] = dilation;
    problem.kernel[slot] = kernel;
    problem.input[slot] = input;
    problem.pad_lo[slot] = lo;
    problem.pad_hi[slot] = hi;
    problem.output[slot] = padded < span ? 0 : (padded - span) / stride + 1;
  }
  return problem;
}

// cpu convs run f32 and f64 (f16 and bf16 through f32: through_f32); cuda (cuDNN) convs also
// f16 and bf16.
void check_tensor(const Tensor& tensor, std::string_view name) {
  const DType dtype = tensor.dtype();
  if (tensor.device().is_cuda()) {
    check_arg(
        dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 || dtype == DType::bf16,
        kOp, "expected f32, f64, f16 or bf16 cuda tensors, got {} of dtype {}", name,
        dtype_name(dtype));
    return;
  }
  check_arg(dtype == DType::f32 || dtype == DType::f64, kOp,
            "expected f32 or f64 cpu tensors, got {} of dtype {}", name, dtype_name(dtype));
}

void check_same_dtype(const Tensor& a, std::string_view a_name, const Tensor& b,
                      std::string_view b_name) {
  check_tensor(a, a_name);
  check_tensor(b, b_name);
  check_arg(a.dtype() == b.dtype(), kOp, "{} is {} but {} is {}", a_name, dtype_name(a.dtype()),
            b_name, dtype_name(b.dtype()));
  TESSERA_CHECK_ARG(a.device() == b.device(), kOp, "{} is on {} but {} is on {}", a_name,
                    a.device().str(), b_name, b.device().str());
}

// True when `backend` resolves to cuDNN for tensors on `device`; throws when the backend cannot
// run tensors of that device.
bool use_cudnn(ConvBackend backend, Device device) {
  if (device.is_cpu()) {
    check_arg(backend != ConvBackend::cudnn, kOp,
              "backend cudnn runs cuda tensors, got cpu tensors");
    return false;
  }
  TESSERA_CHECK_ARG(backend == ConvBackend::automatic || backend == ConvBackend::cudnn, kOp,
                    "backend {} runs cpu tensors, got tensors on {}",
                    backend == ConvBackend::reference ? "reference" : "onednn", device.str());
  return true;
}

// The cuDNN operand of weights: packed row-major strides when the tensor is contiguous (its
// own strides may differ along unit dims), else a contiguous copy's.
ConvOperand weight_operand(const Tensor& w, Tensor& keep_alive) {
  keep_alive = w.contiguous();
  ConvOperand operand = conv_operand(keep_alive);
  operand.strides = contiguous_strides(keep_alive.shape());
  return operand;
}

std::atomic<bool>& allow_tf32_flag() {
  static std::atomic<bool> flag = allow_tf32_from_env(std::getenv("TESSERA_ALLOW_TF32"));
  return flag;
}

void check_output_gradient(const Tensor& dy, const ConvProblem& problem) {
  check_arg(dy.shape() == problem.y_shape(), kOp,
            "dy has shape {}, expected {} (the output of input {} and weight {})",
            shape_text(dy.shape()), shape_text(problem.y_shape()), shape_text(problem.x_shape()),
            shape_text(problem.w_shape()));
}

// True when `backend` resolves to oneDNN for `dtype`; throws when oneDNN was asked for but
// cannot run this dtype or was not compiled in.
bool use_onednn(ConvBackend backend, DType dtype) {
  switch (backend) {
    case ConvBackend::reference:
    case ConvBackend::cudnn: return false;
    case ConvBackend::automatic: return dtype == DType::f32 && conv_onednn_available();
    case ConvBackend::onednn:
      if (!conv_onednn_available())
        throw NotAvailable(std::string(kOp),
                           "backend onednn requested but Tessera was built without oneDNN");
      check_arg(dtype == DType::f32, kOp, "backend onednn supports f32 only, got {}",
                dtype_name(dtype));
      return true;
  }
  throw InvalidArgument(std::string(kOp),
                        fmt::format("unknown backend code {}", static_cast<int>(backend)));
}

// y[n, c, ...] = bias[c] (or 0): the output of a conv that reads no input channel.
void fill_with_bias(Tensor& y, const Tensor* bias) {
  if (bias == nullptr) {
    y.fill(0.0);
    return;
  }
  const Tensor bias_values = bias->contiguous();
  const int64_t batch = y.shape(0);
  const int64_t channels = y.shape(1);
  const int64_t plane = channels == 0 || batch == 0 ? 0 : y.numel() / (batch * channels);
  dispatch_dtype(y.dtype(), [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      const T* b = bias_values.data<T>();
      T* out = y.data<T>();
      for (int64_t n = 0; n < batch; ++n)
        for (int64_t c = 0; c < channels; ++c)
          for (int64_t i = 0; i < plane; ++i) *out++ = b[c];
    }
  });
}

// Whether the backend that runs `problem` on `device` takes its padding itself: oneDNN does
// (unless an input extent is 0), cuDNN when both sides of every dim are padded alike; the
// reference never does. Otherwise the dispatcher writes the padded input out first.
bool pads_natively(const ConvProblem& problem, bool onednn, Device device) {
  if (!problem.padded()) return true;
  if (device.is_cuda()) {
    for (int d = 0; d < 3; ++d)
      if (problem.pad_lo[d] != problem.pad_hi[d] || problem.pad_lo[d] > INT_MAX) return false;
    return true;
  }
  if (!onednn) return false;
  for (int d = 0; d < 3; ++d)
    if (problem.input[d] == 0) return false;
  return true;
}

// The geometry without its padding.
ConvGeometry unpadded(ConvGeometry geometry) {
  geometry.pad_lo.clear();
  geometry.pad_hi.clear();
  return geometry;
}

// Where x lies within its zero-padded copy: the box of x's shape shifted by the low padding.
Box unpadded_box(const Shape& x_shape, const ConvGeometry& geometry) {
  Box box = Box::of_shape(x_shape);
  for (size_t d = 0; d < geometry.pad_lo.size(); ++d) {
    box.lo[2 + d] += geometry.pad_lo[d];
    box.hi[2 + d] += geometry.pad_lo[d];
  }
  return box;
}

// The shape of x zero-padded by the geometry's padding.
Shape padded_shape(const Shape& x_shape, const ConvGeometry& geometry) {
  Shape shape = x_shape;
  for (size_t d = 0; d < geometry.pad_lo.size(); ++d) shape[2 + d] += geometry.pad_lo[d];
  for (size_t d = 0; d < geometry.pad_hi.size(); ++d) shape[2 + d] += geometry.pad_hi[d];
  return shape;
}

// x written into a zeroed tensor of its padded shape (on x's device).
Tensor zero_padded(const Tensor& x, const ConvGeometry& geometry) {
  Tensor padded = Tensor::zeros(padded_shape(x.shape(), geometry), x.dtype(), x.device());
  padded.view_box(unpadded_box(x.shape(), geometry)).copy_from(x);
  return padded;
}

}  // namespace

Shape conv_output_shape(const Shape& x_shape, const Shape& w_shape, const ConvGeometry& geometry) {
  return make_problem(x_shape, w_shape, geometry, DType::f32).y_shape();
}

namespace {

/// True when a cpu conv of `a` (and the other operands, of its dtype) runs through f32: f16 and
/// bf16 cpu tensors are converted to f32 (exactly), convolved with f32 sums, and the result
/// rounded back to the dtype once, as a mixed-precision cpu run expects.
bool through_f32(const Tensor& a, std::initializer_list<const Tensor*> others) {
  if (a.device().is_cuda() || (a.dtype() != DType::f16 && a.dtype() != DType::bf16)) return false;
  for (const Tensor* other : others)
    if (other != nullptr && other->dtype() != a.dtype()) return false;
  return true;
}

}  // namespace

Tensor conv_forward(const Tensor& x, const Tensor& w, const Tensor* bias,
                    const ConvGeometry& geometry, ConvBackend backend) {
  if (through_f32(x, {&w, bias})) {
    const Tensor bias32 = bias != nullptr ? bias->to_dtype(DType::f32) : Tensor();
    return conv_forward(x.to_dtype(DType::f32), w.to_dtype(DType::f32),
                        bias != nullptr ? &bias32 : nullptr, geometry, backend)
        .to_dtype(x.dtype());
  }
  check_same_dtype(x, "x", w, "w");
  const ConvProblem problem = make_problem(x.shape(), w.shape(), geometry, x.dtype());
  if (bias != nullptr) {
    check_same_dtype(x, "x", *bias, "bias");
    check_arg(bias->shape() == Shape{problem.out_channels}, kOp,
              "bias has shape {}, expected ({}) (one entry per output channel)",
              shape_text(bias->shape()), problem.out_channels);
  }
  // Estimate mode: the output's shape, no arithmetic (core/estimate/estimate_mode.hpp).
  if (estimate::active()) return Tensor::empty(problem.y_shape(), problem.dtype, x.device());
  if (use_cudnn(backend, x.device())) {
    Tensor y = Tensor::empty(problem.y_shape(), problem.dtype, x.device());
    conv_forward_into(x, w, bias, geometry, y, ConvBackend::cudnn);
    return y;
  }
  const bool onednn = use_onednn(backend, problem.dtype);
  if (!pads_natively(problem, onednn, x.device()))
    return conv_forward(zero_padded(x, geometry), w, bias, unpadded(geometry), backend);

  Tensor y = Tensor::empty(problem.y_shape(), problem.dtype);
  if (y.numel() == 0) return y;
  if (problem.in_channels_per_group() == 0) {
    fill_with_bias(y, bias);
    return y;
  }
  const Tensor x_values = x.contiguous();
  const Tensor w_values = w.contiguous();
  const Tensor bias_values = bias != nullptr ? bias->contiguous() : Tensor();
  const Tensor* bias_pointer = bias != nullptr ? &bias_values : nullptr;
  if (onednn)
    conv_forward_onednn(problem, x_values, w_values, bias_pointer, y);
  else
    conv_forward_reference(problem, x_values, w_values, bias_pointer, y);
  return y;
}

void conv_forward_into(const Tensor& x, const Tensor& w, const Tensor* bias,
                       const ConvGeometry& geometry, Tensor& y, ConvBackend backend) {
  if (through_f32(x, {&w, bias, &y})) {
    y.copy_from(conv_forward(x, w, bias, geometry, backend));
    return;
  }
  check_same_dtype(x, "x", y, "y");
  if (y.is_shape_only()) return;
  if (!use_cudnn(backend, x.device())) {
    y.copy_from(conv_forward(x, w, bias, geometry, backend));
    return;
  }
  check_same_dtype(x, "x", w, "w");
  if (bias != nullptr) check_same_dtype(x, "x", *bias, "bias");
  if (!pads_natively(make_problem(x.shape(), w.shape(), geometry, x.dtype()), false, x.device())) {
    conv_forward_into(zero_padded(x, geometry), w, bias, unpadded(geometry), y, backend);
    return;
  }
  Tensor packed_weights;
  const ConvOperand bias_operand = bias != nullptr ? conv_operand(*bias) : ConvOperand{};
  conv_forward_cudnn(conv_operand(x), weight_operand(w, packed_weights),
                     bias != nullptr ? &bias_operand : nullptr, geometry, conv_operand(y));
}

Tensor conv_backward_data(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                          const ConvGeometry& geometry, ConvBackend backend) {
  if (through_f32(dy, {&w}))
    return conv_backward_data(dy.to_dtype(DType::f32), w.to_dtype(DType::f32), x_shape, geometry,
                              backend)
        .to_dtype(dy.dtype());
  check_same_dtype(dy, "dy", w, "w");
  const ConvProblem problem = make_problem(x_shape, w.shape(), geometry, dy.dtype());
  check_output_gradient(dy, problem);
  if (estimate::active()) return Tensor::empty(x_shape, problem.dtype, dy.device());
  const bool cudnn = use_cudnn(backend, dy.device());
  if (!pads_natively(problem, !cudnn && use_onednn(backend, problem.dtype), dy.device())) {
    // The gradient of the padded input, cut to x's cells.
    const Tensor padded_dx =
        conv_backward_data(dy, w, padded_shape(x_shape, geometry), unpadded(geometry), backend);
    return padded_dx.view_box(unpadded_box(x_shape, geometry)).contiguous();
  }
  if (cudnn) {
    Tensor dx = Tensor::empty(x_shape, problem.dtype, dy.device());
    Tensor packed_weights;
    conv_backward_data_cudnn(conv_operand(dy), weight_operand(w, packed_weights), geometry,
                             conv_operand(dx));
    return dx;
  }
  const bool onednn = use_onednn(backend, problem.dtype);

  if (dy.numel() == 0 || w.numel() == 0) return Tensor::zeros(x_shape, problem.dtype);
  Tensor dx = Tensor::empty(x_shape, problem.dtype);
  if (dx.numel() == 0) return dx;
  const Tensor dy_values = dy.contiguous();
  const Tensor w_values = w.contiguous();
  if (onednn)
    conv_backward_data_onednn(problem, dy_values, w_values, dx);
  else
    conv_backward_data_reference(problem, dy_values, w_values, dx);
  return dx;
}

Tensor conv_backward_weight(const Tensor& x, const Tensor& dy, const Shape& w_shape,
                            const ConvGeometry& geometry, ConvBackend backend) {
  if (through_f32(x, {&dy}))
    return conv_backward_weight(x.to_dtype(DType::f32), dy.to_dtype(DType::f32), w_shape, geometry,
                                backend)
        .to_dtype(x.dtype());
  check_same_dtype(x, "x", dy, "dy");
  const ConvProblem problem = make_problem(x.shape(), w_shape, geometry, x.dtype());
  check_output_gradient(dy, problem);
  if (estimate::active()) return Tensor::empty(w_shape, problem.dtype, x.device());
  const bool cudnn = use_cudnn(backend, x.device());
  if (!pads_natively(problem, !cudnn && use_onednn(backend, problem.dtype), x.device()))
    return conv_backward_weight(zero_padded(x, geometry), dy, w_shape, unpadded(geometry), backend);
  if (cudnn) {
    Tensor dw = Tensor::empty(w_shape, problem.dtype, x.device());
    conv_backward_filter_cudnn(
        conv_operand(x), conv_operand(dy), geometry,
        {dw.raw_data(), w_shape, contiguous_strides(w_shape), dw.dtype(), dw.device()});
    return dw;
  }
  const bool onednn = use_onednn(backend, problem.dtype);

  if (dy.numel() == 0 || x.numel() == 0) return Tensor::zeros(w_shape, problem.dtype);
  Tensor dw = Tensor::empty(w_shape, problem.dtype);
  if (dw.numel() == 0) return dw;
  const Tensor x_values = x.contiguous();
  const Tensor dy_values = dy.contiguous();
  if (onednn)
    conv_backward_weight_onednn(problem, x_values, dy_values, dw);
  else
    conv_backward_weight_reference(problem, x_values, dy_values, dw);
  return dw;
}

Tensor conv_backward_bias(const Tensor& dy) {
  if (through_f32(dy, {})) return conv_backward_bias(dy.to_dtype(DType::f32)).to_dtype(dy.dtype());
  check_tensor(dy, "dy");
  check_arg(dy.ndim() >= 3 && dy.ndim() <= 5, kOp,
            "expected a 3-, 4- or 5-d dy for conv1d/2d/3d, got shape {}", shape_text(dy.shape()));
  const int64_t batch = dy.shape(0);
  const int64_t channels = dy.shape(1);
  if (estimate::active()) return Tensor::empty({channels}, dy.dtype(), dy.device());
  if (dy.device().is_cuda()) {
    Tensor db = Tensor::empty({channels}, dy.dtype(), dy.device());
    conv_backward_bias_cudnn(conv_operand(dy), conv_operand(db));
    return db;
  }
  Tensor db = Tensor::zeros({channels}, dy.dtype());
  if (dy.numel() == 0) return db;
  const Tensor dy_values = dy.contiguous();
  const int64_t plane = dy.numel() / (batch * channels);
  // Sums run in double for both dtypes: a bias gradient adds up N * |O| terms per channel. Each
  // (n, c) plane is summed on its own (8 interleaved partial sums, in parallel over planes), then
  // the planes of a channel in n order: the same result whatever the thread count.
  std::vector<double> plane_sums(static_cast<size_t>(batch * channels));
  dispatch_dtype(dy.dtype(), [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      const T* in = dy_values.data<T>();
      parallel_for(batch * channels, compute_threads(), [&](int64_t begin, int64_t end, int) {
        for (int64_t p = begin; p < end; ++p) {
          const T* row = in + p * plane;
          double partial[8] = {};
          int64_t i = 0;
          for (; i + 8 <= plane; i += 8)
            for (int lane = 0; lane < 8; ++lane) partial[lane] += row[i + lane];
          for (; i < plane; ++i) partial[i % 8] += row[i];
          plane_sums[p] = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
                          ((partial[4] + partial[5]) + (partial[6] + partial[7]));
        }
      });
      T* out = db.data<T>();
      for (int64_t c = 0; c < channels; ++c) {
        double sum = 0.0;
        for (int64_t n = 0; n < batch; ++n) sum += plane_sums[n * channels + c];
        out[c] = static_cast<T>(sum);
      }
    }
  });
  return db;
}

bool conv_allow_tf32() {
  return allow_tf32_flag().load();
}

void set_conv_allow_tf32(bool allow) {
  allow_tf32_flag().store(allow);
}

}  // namespace tessera::ops
