// The cuda bodies of the normalizations (see norm_kernels.hpp): operand checks, then the launches
// of norm_cuda.cu on the stream. Results are new contiguous tensors on the input's device.
#include "ops/norm/norm_cuda.cuh"

#include <string>

#include "ops/cuda_support.hpp"
#include "ops/norm/norm_kernels.hpp"

namespace tessera::ops {

namespace {

const char* op_name(const kernels::NormGeometry& g) {
  switch (g.kind) {
    case kernels::NormKind::group: return "group_norm";
    case kernels::NormKind::batch: return "batch_norm";
    case kernels::NormKind::instance: return "instance_norm";
    case kernels::NormKind::layer: return "layer_norm";
  }
  return "norm";
}

/// An f64 statistics tensor on `device`, checked and made contiguous.
Tensor f64_on(const Tensor& tensor, Device device, const char* op) {
  TESSERA_CHECK_ARG(tensor.dtype() == DType::f64 && tensor.device() == device, op,
                    "statistics {} expected as f64 on {}", tensor.str(), device.str());
  return tensor.contiguous();
}

const void* data_or_null(const std::optional<Tensor>& tensor) {
  return tensor ? tensor->raw_data() : nullptr;
}

/// Contiguous copies of the optional operands, checked against x.
std::optional<Tensor> operand(const std::optional<Tensor>& tensor, const Tensor& x,
                              const char* op) {
  if (!tensor) return std::nullopt;
  require_cuda_operands({&x, &*tensor}, op);
  return tensor->contiguous();
}

}  // namespace

Tensor norm_moments_cuda(const kernels::NormGeometry& g, const Tensor& x, const Stream& stream) {
  const char* op = op_name(g);
  require_cuda_operands({&x}, op);
  const Tensor input = x.contiguous();
  Tensor moments = Tensor::empty({g.slots, 3}, DType::f64, x.device());
  check_launch(kernels::launch_norm_moments(g, element_type(x.dtype(), op), input.raw_data(),
                                            moments.data<double>(), stream_handle(stream)),
               op, x.device(), "norm moments");
  return moments;
}

Tensor norm_statistics_cuda(const Tensor& gathered, double eps, const Stream& stream) {
  const Tensor source = f64_on(gathered, gathered.device(), "norm");
  gpu::set_device(source.device().index);
  const int64_t ranks = source.shape()[0], slots = source.shape()[1];
  Tensor statistics = Tensor::empty({slots, 4}, DType::f64, source.device());
  check_launch(kernels::launch_norm_statistics(source.data<double>(), ranks, slots, eps,
                                               statistics.data<double>(), stream_handle(stream)),
               "norm", source.device(), "norm statistics");
  return statistics;
}

Tensor norm_running_statistics_cuda(const Tensor& running_mean, const Tensor& running_var,
                                    double eps, const Stream& stream) {
  require_cuda_operands({&running_mean, &running_var}, "batch_norm");
  const Tensor mean = running_mean.contiguous(), var = running_var.contiguous();
  Tensor statistics = Tensor::empty({mean.numel(), 4}, DType::f64, mean.device());
  check_launch(kernels::launch_norm_running_statistics(
                   element_type(mean.dtype(), "batch_norm"), mean.raw_data(), var.raw_data(),
                   mean.numel(), eps, statistics.data<double>(), stream_handle(stream)),
               "batch_norm", mean.device(), "running statistics");
  return statistics;
}

std::pair<Tensor, Tensor> norm_update_running_cuda(const Tensor& statistics,
                                                   const Tensor& running_mean,
                                                   const Tensor& running_var, double momentum,
                                                   const Stream& stream) {
  require_cuda_operands({&running_mean, &running_var}, "batch_norm");
  const Tensor stats = f64_on(statistics, running_mean.device(), "batch_norm");
  const Tensor mean = running_mean.contiguous(), var = running_var.contiguous();
  Tensor new_mean = Tensor::empty(mean.shape(), mean.dtype(), mean.device());
  Tensor new_var = Tensor::empty(var.shape(), var.dtype(), var.device());
  check_launch(kernels::launch_norm_update_running(
                   element_type(mean.dtype(), "batch_norm"), stats.data<double>(), mean.raw_data(),
                   var.raw_data(), mean.numel(), momentum, new_mean.raw_data(), new_var.raw_data(),
                   stream_handle(stream)),
               "batch_norm", mean.device(), "running statistics update");
  return {new_mean, new_var};
}

Tensor norm_forward_cuda(const kernels::NormGeometry& g, const Tensor& x, const Tensor& statistics,
                         const std::optional<Tensor>& w, const std::optional<Tensor>& b,
                         const Stream& stream) {
  const char* op = op_name(g);
  require_cuda_operands({&x}, op);
  const Tensor input = x.contiguous();
  const Tensor stats = f64_on(statistics, x.device(), op);
  const std::optional<Tensor> weight = operand(w, x, op), bias = operand(b, x, op);
  Tensor y = Tensor::empty(input.shape(), input.dtype(), input.device());
  check_launch(kernels::launch_norm_forward(
                   g, element_type(x.dtype(), op), input.raw_data(), stats.data<double>(),
                   data_or_null(weight), data_or_null(bias), y.raw_data(), stream_handle(stream)),
               op, x.device(), "norm forward");
  return y;
}

Tensor norm_backward_sums_cuda(const kernels::NormGeometry& g, const Tensor& x, const Tensor& dy,
                               const Tensor& statistics, const std::optional<Tensor>& w,
                               bool want_dw, bool want_db, NormParamGrads& grads,
                               const Stream& stream) {
  const char* op = op_name(g);
  require_cuda_operands({&x, &dy}, op);
  const Tensor input = x.contiguous(), grad = dy.contiguous();
  const Tensor stats = f64_on(statistics, x.device(), op);
  const std::optional<Tensor> weight = operand(w, x, op);
  Tensor sums = Tensor::empty({g.slots, 2}, DType::f64, x.device());
  const Shape param{g.per_element_affine ? g.length : g.channels};
  if (want_dw) grads.dw = Tensor::empty(param, x.dtype(), x.device());
  if (want_db) grads.db = Tensor::empty(param, x.dtype(), x.device());
  check_launch(
      kernels::launch_norm_backward_sums(
          g, element_type(x.dtype(), op), input.raw_data(), grad.raw_data(), stats.data<double>(),
          data_or_null(weight), sums.data<double>(), grads.dw ? grads.dw->raw_data() : nullptr,
          grads.db ? grads.db->raw_data() : nullptr, stream_handle(stream)),
      op, x.device(), "norm backward sums");
  return sums;
}

Tensor norm_sum_ranks_cuda(const Tensor& gathered, const Stream& stream) {
  const Tensor source = f64_on(gathered, gathered.device(), "norm");
  gpu::set_device(source.device().index);
  const int64_t ranks = source.shape()[0];
  const Shape shape(source.shape().begin() + 1, source.shape().end());
  Tensor sums = Tensor::empty(shape, DType::f64, source.device());
  check_launch(kernels::launch_norm_sum_ranks(source.data<double>(), ranks, sums.numel(),
                                              sums.data<double>(), stream_handle(stream)),
               "norm", source.device(), "norm rank sums");
  return sums;
}

Tensor norm_backward_dx_cuda(const kernels::NormGeometry& g, const Tensor& x, const Tensor& dy,
                             const Tensor& statistics, const std::optional<Tensor>& sums,
                             const std::optional<Tensor>& w, const Stream& stream) {
  const char* op = op_name(g);
  require_cuda_operands({&x, &dy}, op);
  const Tensor input = x.contiguous(), grad = dy.contiguous();
  const Tensor stats = f64_on(statistics, x.device(), op);
  const std::optional<Tensor> total =
      sums ? std::optional<Tensor>(f64_on(*sums, x.device(), op)) : std::nullopt;
  const std::optional<Tensor> weight = operand(w, x, op);
  Tensor dx = Tensor::empty(input.shape(), input.dtype(), input.device());
  check_launch(kernels::launch_norm_backward_dx(
                   g, element_type(x.dtype(), op), input.raw_data(), grad.raw_data(),
                   stats.data<double>(), total ? total->data<double>() : nullptr,
                   data_or_null(weight), dx.raw_data(), stream_handle(stream)),
               op, x.device(), "norm backward dx");
  return dx;
}

}  // namespace tessera::ops
