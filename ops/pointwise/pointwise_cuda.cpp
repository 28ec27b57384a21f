// The cuda bodies of the pointwise ops (see pointwise_cuda.hpp): operand checks, the
// elementwise layout and vector width (elementwise_plan.hpp), then one launch on the stream.
#include "ops/pointwise/pointwise_cuda.hpp"

#include "ops/cuda_support.hpp"
#include "ops/pointwise/pointwise_cuda.cuh"
#include "ops/reduce/reduce_cuda.hpp"

namespace tessera::ops {

namespace {

kernels::UnaryKind unary_kind(const std::string& name) {
  if (name == "relu") return kernels::UnaryKind::relu;
  if (name == "gelu") return kernels::UnaryKind::gelu;
  if (name == "silu") return kernels::UnaryKind::silu;
  if (name == "tanh") return kernels::UnaryKind::tanh;
  if (name == "exp") return kernels::UnaryKind::exp;
  if (name == "scale") return kernels::UnaryKind::scale;
  throw InvalidArgument(name, "no cuda kernel for this unary op");
}

kernels::BinaryKind binary_kind(const std::string& name) {
  if (name == "add" || name == "bias_add") return kernels::BinaryKind::add;
  if (name == "sub") return kernels::BinaryKind::sub;
  if (name == "mul") return kernels::BinaryKind::mul;
  if (name == "div") return kernels::BinaryKind::div;
  throw InvalidArgument(name, "no cuda kernel for this binary op");
}

void require_shape(const Tensor& tensor, const Shape& shape, const std::string& op) {
  check_arg(tensor.shape() == shape, op, "operand {} where shape {} is expected", tensor.str(),
            shape);
}

}  // namespace

Tensor unary_forward_cuda(const std::string& name, const Tensor& x, double factor,
                          const Stream& stream) {
  require_cuda_operands({&x}, name);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (y.numel() == 0) return y;
  const ElementwiseLayout layout = elementwise_layout(x.shape(), {x.strides()});
  const int width = vector_width(layout, {x.raw_data(), y.raw_data()}, x.element_size());
  check_launch(kernels::launch_unary(unary_kind(name), element_type(x.dtype(), name), layout, width,
                                     x.raw_data(), y.raw_data(), factor, stream_handle(stream)),
               name, x.device(), "unary");
  return y;
}

Tensor unary_backward_cuda(const std::string& name, const Tensor& x, const Tensor& y,
                           const Tensor& g, double factor, const Stream& stream) {
  require_cuda_operands({&x, &y, &g}, name);
  require_shape(y, x.shape(), name);
  require_shape(g, x.shape(), name);
  const kernels::UnaryKind kind = unary_kind(name);
  // tanh' = 1 - y^2 and exp' = y read the output; the others read the input.
  const Tensor& saved = kind == kernels::UnaryKind::tanh || kind == kernels::UnaryKind::exp ? y : x;
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (dx.numel() == 0) return dx;
  const ElementwiseLayout layout = elementwise_layout(x.shape(), {saved.strides(), g.strides()});
  const int width =
      vector_width(layout, {saved.raw_data(), g.raw_data(), dx.raw_data()}, x.element_size());
  check_launch(kernels::launch_unary_backward(kind, element_type(x.dtype(), name), layout, width,
                                              saved.raw_data(), g.raw_data(), dx.raw_data(), factor,
                                              stream_handle(stream)),
               name, x.device(), "unary backward");
  return dx;
}

Tensor binary_forward_cuda(const std::string& name, const Tensor& a, const Tensor& b,
                           const OperandView& b_view, const Stream& stream) {
  require_cuda_operands({&a, &b}, name);
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  if (out.numel() == 0) return out;
  const void* b_first = advanced(b.raw_data(), b_view.start, b.element_size());
  const ElementwiseLayout layout = elementwise_layout(a.shape(), {a.strides(), b_view.strides});
  const int width = vector_width(layout, {a.raw_data(), b_first, out.raw_data()}, a.element_size());
  check_launch(
      kernels::launch_binary(binary_kind(name), element_type(a.dtype(), name), layout, width,
                             a.raw_data(), b_first, out.raw_data(), stream_handle(stream)),
      name, a.device(), "binary");
  return out;
}

std::pair<Tensor, Tensor> binary_backward_cuda(const std::string& name, const Tensor& a,
                                               const Tensor& b, const OperandView& b_view,
                                               const Tensor& g, const Stream& stream) {
  require_cuda_operands({&a, &b, &g}, name);
  require_shape(g, a.shape(), name);
  Tensor da = Tensor::empty(a.shape(), a.dtype(), a.device());
  Tensor db = Tensor::empty(a.shape(), a.dtype(), a.device());
  if (da.numel() == 0) return {da, db};
  const void* b_first = advanced(b.raw_data(), b_view.start, b.element_size());
  const ElementwiseLayout layout =
      elementwise_layout(a.shape(), {a.strides(), b_view.strides, g.strides()});
  const int width =
      vector_width(layout, {a.raw_data(), b_first, g.raw_data(), da.raw_data(), db.raw_data()},
                   a.element_size());
  check_launch(kernels::launch_binary_backward(binary_kind(name), element_type(a.dtype(), name),
                                               layout, width, a.raw_data(), b_first, g.raw_data(),
                                               da.raw_data(), db.raw_data(), stream_handle(stream)),
               name, a.device(), "binary backward");
  return {da, db};
}

Tensor reduce_to_operand_cuda(const Tensor& grad, const Shape& b_shape, const Box& a_box,
                              int offset, const Stream& stream) {
  const std::string op = "reduce_to_operand";
  require_cuda_operands({&grad}, op);
  require_shape(grad, a_box.shape(), op);
  Tensor sums = Tensor::empty(b_shape, grad.dtype(), grad.device());
  if (sums.numel() == 0) return sums;
  // Entries of b outside a's box (along dims b does not broadcast) get nothing from this rank.
  gpu::zero_bytes_async(sums.raw_data(), sums.nbytes(), stream.handle, grad.device().index);
  if (grad.numel() == 0) return sums;
  // The output is b (contiguous) seen over a's box: stride 0 exactly along the summed dims.
  const OperandView out_view =
      broadcast_operand_view(b_shape, contiguous_strides(b_shape), a_box.lo, offset);
  std::vector<bool> reduced(out_view.strides.size());
  for (size_t d = 0; d < reduced.size(); ++d) reduced[d] = out_view.strides[d] == 0;
  void* out = static_cast<char*>(sums.raw_data()) +
              out_view.start * static_cast<int64_t>(sums.element_size());
  sum_into_cuda(grad, reduced, out, out_view.strides, 1.0, stream, op);
  return sums;
}

}  // namespace tessera::ops
