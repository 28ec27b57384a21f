// Broadcast helpers of the binary pointwise ops.
#include "ops/pointwise/broadcast.hpp"

#include <fmt/ranges.h>

#include "core/backend/backend.hpp"
#include "ops/pointwise/elementwise_plan.hpp"

namespace tessera::ops {

int broadcast_offset(const Shape& a_global, const Shape& b_shape, int64_t align,
                     const std::string& op) {
  const int a_ndim = static_cast<int>(a_global.size()), b_ndim = static_cast<int>(b_shape.size());
  const int offset = align < 0 ? a_ndim - b_ndim : static_cast<int>(align);
  check_arg(offset >= 0 && offset + b_ndim <= a_ndim, op,
            "operand of shape {} does not broadcast against {} at dim {}", b_shape, a_global,
            offset);
  for (int j = 0; j < b_ndim; ++j)
    check_arg(b_shape[j] == 1 || b_shape[j] == a_global[offset + j], op,
              "operand of shape {} does not broadcast against {}: dim {} is {}, expected 1 or {}",
              b_shape, a_global, j, b_shape[j], a_global[offset + j]);
  return offset;
}

namespace {
/// Strides (elements) and start offset that view b as a tensor over a_box.
void broadcast_view(const Tensor& b, const Box& a_box, int offset, std::vector<int64_t>& strides,
                    int64_t& start) {
  OperandView view = broadcast_operand_view(b.shape(), b.strides(), a_box.lo, offset);
  strides = std::move(view.strides);
  start = view.start;
}
}  // namespace

Tensor expand_to_box(const Tensor& b, const Box& a_box, int offset) {
  std::vector<int64_t> strides;
  int64_t start = 0;
  broadcast_view(b, a_box, offset, strides, start);
  const Shape shape = a_box.shape();
  Tensor result = Tensor::empty(shape, b.dtype(), b.device());
  if (result.numel() == 0) return result;
  const std::vector<int64_t> dense = contiguous_strides(shape);
  const int ndim = static_cast<int>(shape.size());
  void* first = static_cast<char*>(const_cast<void*>(b.raw_data())) +
                start * static_cast<int64_t>(b.element_size());
  backend_for(b.device())
      .copy(StridedRef{result.raw_data(), shape.data(), dense.data(), ndim},
            StridedRef{first, shape.data(), strides.data(), ndim}, b.element_size(),
            compute_stream_for(b.device()));
  return result;
}

Tensor reduce_to_operand(const Tensor& grad, const Shape& b_shape, const Box& a_box, int offset) {
  const Tensor source = grad.to_dtype(DType::f64).contiguous();
  Tensor sums = Tensor::zeros(b_shape, DType::f64);
  std::vector<int64_t> strides;
  int64_t start = 0;
  broadcast_view(sums, a_box, offset, strides, start);
  const Shape shape = a_box.shape();
  const int ndim = static_cast<int>(shape.size());
  std::vector<int64_t> index(ndim, 0);
  const double* in = source.data<double>();
  double* out = sums.data<double>() + start;
  for (int64_t flat = 0; flat < source.numel(); ++flat) {
    int64_t target = 0;
    for (int d = 0; d < ndim; ++d) target += index[d] * strides[d];
    out[target] += in[flat];
    for (int d = ndim - 1; d >= 0; --d) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  return sums.to_dtype(grad.dtype());
}

}  // namespace tessera::ops
