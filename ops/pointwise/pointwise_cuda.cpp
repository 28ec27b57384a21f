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
  if (name == "sigmoid") return kernels::UnaryKind::sigmoid;
  if (name == "softplus") return kernels::UnaryKind::softplus;
  if (name == "leaky_relu") return kernels::UnaryKind::leaky_relu;
  if (name == "erf") return kernels::UnaryKind::erf;
  if (name == "sqrt") return kernels::UnaryKind::sqrt;
  if (name == "neg") return kernels::UnaryKind::neg;
  if (name == "abs") return kernels::UnaryKind::abs;
  if (name == "log") return kernels::UnaryKind::log;
  if (name == "clamp") return kernels::UnaryKind::clamp;
  throw InvalidArgument(name, "no cuda kernel for this unary op");
}

kernels::BinaryKind binary_kind(const std::string& name) {
  if (name == "add" || name == "bias_add") return kernels::BinaryKind::add;
  if (name == "sub") return kernels::BinaryKind::sub;
  if (name == "mul") return kernels::BinaryKind::mul;
  if (name == "div") return kernels::BinaryKind::div;
  if (name == "pow") return kernels::BinaryKind::pow;
  if (name == "maximum") return kernels::BinaryKind::maximum;
  if (name == "minimum") return kernels::BinaryKind::minimum;
  throw InvalidArgument(name, "no cuda kernel for this binary op");
}

void require_shape(const Tensor& tensor, const Shape& shape, const std::string& op) {
  TESSERA_CHECK_ARG(tensor.shape() == shape, op, "operand {} where shape {} is expected",
                    tensor.str(), shape);
}

}  // namespace

Tensor unary_forward_cuda(const std::string& name, const Tensor& x, double p0, double p1,
                          const Stream& stream) {
  require_cuda_operands({&x}, name);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (y.numel() == 0) return y;
  const ElementwiseLayout layout = elementwise_layout(x.shape(), {x.strides()});
  const int width = vector_width(layout, {x.raw_data(), y.raw_data()}, x.element_size());
  check_launch(kernels::launch_unary(unary_kind(name), element_type(x.dtype(), name), layout, width,
                                     x.raw_data(), y.raw_data(), p0, p1, stream_handle(stream)),
               name, x.device(), "unary");
  return y;
}

Tensor unary_backward_cuda(const std::string& name, const Tensor& x, const Tensor& y,
                           const Tensor& g, double p0, double p1, const Stream& stream) {
  require_cuda_operands({&x, &y, &g}, name);
  require_shape(y, x.shape(), name);
  require_shape(g, x.shape(), name);
  const kernels::UnaryKind kind = unary_kind(name);
  // The derivatives of tanh, exp, sigmoid and sqrt read the output; the others read the input.
  const bool reads_output = kind == kernels::UnaryKind::tanh || kind == kernels::UnaryKind::exp ||
                            kind == kernels::UnaryKind::sigmoid || kind == kernels::UnaryKind::sqrt;
  const Tensor& saved = reads_output ? y : x;
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (dx.numel() == 0) return dx;
  const ElementwiseLayout layout = elementwise_layout(x.shape(), {saved.strides(), g.strides()});
  const int width =
      vector_width(layout, {saved.raw_data(), g.raw_data(), dx.raw_data()}, x.element_size());
  check_launch(kernels::launch_unary_backward(kind, element_type(x.dtype(), name), layout, width,
                                              saved.raw_data(), g.raw_data(), dx.raw_data(), p0, p1,
                                              stream_handle(stream)),
               name, x.device(), "unary backward");
  return dx;
}

Tensor binary_forward_cuda(const std::string& name, const Tensor& lead, const Tensor& other,
                           const OperandView& other_view, bool swapped, const Stream& stream) {
  require_cuda_operands({&lead, &other}, name);
  Tensor out = Tensor::empty(lead.shape(), lead.dtype(), lead.device());
  if (out.numel() == 0) return out;
  const void* other_first = advanced(other.raw_data(), other_view.start, other.element_size());
  const ElementwiseLayout layout =
      elementwise_layout(lead.shape(), {lead.strides(), other_view.strides});
  const int width =
      vector_width(layout, {lead.raw_data(), other_first, out.raw_data()}, lead.element_size());
  check_launch(kernels::launch_binary(binary_kind(name), element_type(lead.dtype(), name), layout,
                                      width, lead.raw_data(), other_first, out.raw_data(), swapped,
                                      stream_handle(stream)),
               name, lead.device(), "binary");
  return out;
}

std::pair<Tensor, Tensor> binary_backward_cuda(const std::string& name, const Tensor& lead,
                                               const Tensor& other, const OperandView& other_view,
                                               const Tensor& g, bool swapped,
                                               const Stream& stream) {
  require_cuda_operands({&lead, &other, &g}, name);
  require_shape(g, lead.shape(), name);
  Tensor d_lead = Tensor::empty(lead.shape(), lead.dtype(), lead.device());
  Tensor d_other = Tensor::empty(lead.shape(), lead.dtype(), lead.device());
  if (d_lead.numel() == 0) return {d_lead, d_other};
  const void* other_first = advanced(other.raw_data(), other_view.start, other.element_size());
  const ElementwiseLayout layout =
      elementwise_layout(lead.shape(), {lead.strides(), other_view.strides, g.strides()});
  const int width = vector_width(
      layout, {lead.raw_data(), other_first, g.raw_data(), d_lead.raw_data(), d_other.raw_data()},
      lead.element_size());
  check_launch(kernels::launch_binary_backward(binary_kind(name), element_type(lead.dtype(), name),
                                               layout, width, lead.raw_data(), other_first,
                                               g.raw_data(), d_lead.raw_data(), d_other.raw_data(),
                                               swapped, stream_handle(stream)),
               name, lead.device(), "binary backward");
  return {d_lead, d_other};
}

Tensor where_forward_cuda(const Tensor& cond, const Tensor& a, const Tensor& b,
                          const Stream& stream) {
  const std::string op = "where";
  require_cuda_operands({&cond, &a, &b}, op);
  require_shape(cond, a.shape(), op);
  require_shape(b, a.shape(), op);
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  if (out.numel() == 0) return out;
  const Tensor mask = cond.to_dtype(a.dtype());  // 0 stays 0, anything else stays nonzero
  const ElementwiseLayout layout =
      elementwise_layout(a.shape(), {mask.strides(), a.strides(), b.strides()});
  const int width = vector_width(
      layout, {mask.raw_data(), a.raw_data(), b.raw_data(), out.raw_data()}, a.element_size());
  check_launch(
      kernels::launch_where(element_type(a.dtype(), op), layout, width, mask.raw_data(),
                            a.raw_data(), b.raw_data(), out.raw_data(), stream_handle(stream)),
      op, a.device(), "where");
  return out;
}

std::pair<Tensor, Tensor> where_backward_cuda(const Tensor& cond, const Tensor& g,
                                              const Stream& stream) {
  const std::string op = "where";
  require_cuda_operands({&cond, &g}, op);
  require_shape(cond, g.shape(), op);
  Tensor da = Tensor::empty(g.shape(), g.dtype(), g.device());
  Tensor db = Tensor::empty(g.shape(), g.dtype(), g.device());
  if (da.numel() == 0) return {da, db};
  const Tensor mask = cond.to_dtype(g.dtype());
  const ElementwiseLayout layout = elementwise_layout(g.shape(), {mask.strides(), g.strides()});
  const int width = vector_width(
      layout, {mask.raw_data(), g.raw_data(), da.raw_data(), db.raw_data()}, g.element_size());
  check_launch(kernels::launch_where_backward(element_type(g.dtype(), op), layout, width,
                                              mask.raw_data(), g.raw_data(), da.raw_data(),
                                              db.raw_data(), stream_handle(stream)),
               op, g.device(), "where backward");
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
