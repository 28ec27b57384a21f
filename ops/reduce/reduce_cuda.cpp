// The cuda bodies of sum, mean and mse_loss and of their gradients (see reduce_cuda.hpp): the
// reduction plan (reduce_plan.hpp), a workspace for the chunk sums when the plan has a second
// pass, then the launches on the stream.
#include "ops/reduce/reduce_cuda.hpp"

#include "ops/cuda_support.hpp"
#include "ops/pointwise/pointwise_cuda.cuh"
#include "ops/reduce/reduce_cuda.cuh"
#include "ops/reduce/reduce_plan.hpp"

namespace tessera::ops {

namespace {

/// Runs `plan` on a (and b): scale * sums written at `out`.
void run_reduce(const ReducePlan& plan, kernels::ReduceLoad load, const Tensor& a, const Tensor* b,
                void* out, double scale, const Stream& stream, const std::string& op) {
  const kernels::ElementType type = element_type(a.dtype(), op);
  // The chunk sums live until the stream has used them: the allocator hands their memory out
  // again only to work ordered after this stream's.
  const int64_t workspace_elements = reduce_workspace_elements(plan);
  Tensor workspace;
  if (workspace_elements > 0)
    workspace =
        Tensor::empty({workspace_elements},
                      type == kernels::ElementType::f64 ? DType::f64 : DType::f32, a.device());
  check_launch(
      kernels::launch_reduce(type, plan, load, a.raw_data(), b != nullptr ? b->raw_data() : nullptr,
                             out, workspace_elements > 0 ? workspace.raw_data() : nullptr, scale,
                             stream_handle(stream)),
      op, a.device(), "reduce");
}

}  // namespace

void sum_into_cuda(const Tensor& x, const std::vector<bool>& reduced, void* out,
                   const std::vector<int64_t>& out_strides, double scale, const Stream& stream,
                   const std::string& op) {
  require_cuda_operands({&x}, op);
  const ReducePlan plan = reduce_plan(x.shape(), {x.strides()}, reduced, out_strides);
  run_reduce(plan, kernels::ReduceLoad::value, x, nullptr, out, scale, stream, op);
}

Tensor sum_cuda(const Tensor& x, const std::vector<int64_t>& dims, double scale,
                const Stream& stream, const std::string& op) {
  require_cuda_operands({&x}, op);
  Shape kept = x.shape();
  std::vector<bool> reduced(kept.size(), false);
  for (int64_t d : dims) {
    check_arg(d >= 0 && d < x.ndim(), op, "dim {} of a {}-d tensor", d, x.ndim());
    kept[d] = 1;
    reduced[d] = true;
  }
  Tensor sums = Tensor::empty(kept, x.dtype(), x.device());
  if (sums.numel() == 0) return sums;
  sum_into_cuda(x, reduced, sums.raw_data(), contiguous_strides(kept), scale, stream, op);
  return sums;
}

Tensor squared_difference_sum_cuda(const Tensor& a, const Tensor& b, double scale,
                                   const Stream& stream) {
  const std::string op = "mse_loss";
  require_cuda_operands({&a, &b}, op);
  TESSERA_CHECK_ARG(a.shape() == b.shape(), op, "operands {} and {}", a.str(), b.str());
  Tensor loss = Tensor::empty({}, a.dtype(), a.device());
  const std::vector<bool> reduced(a.shape().size(), true);
  const std::vector<int64_t> out_strides(a.shape().size(), 0);
  const ReducePlan plan = reduce_plan(a.shape(), {a.strides(), b.strides()}, reduced, out_strides);
  run_reduce(plan, kernels::ReduceLoad::squared_difference, a, &b, loss.raw_data(), scale, stream,
             op);
  return loss;
}

Tensor broadcast_back_cuda(const Tensor& g, const Shape& shape, double scale, const Stream& stream,
                           const std::string& op) {
  require_cuda_operands({&g}, op);
  TESSERA_CHECK_ARG(g.ndim() == static_cast<int>(shape.size()), op, "gradient {} for shape {}",
                    g.str(), shape);
  std::vector<int64_t> strides = g.strides();
  for (int d = 0; d < g.ndim(); ++d) {
    TESSERA_CHECK_ARG(g.shape(d) == 1 || g.shape(d) == shape[d], op, "gradient {} for shape {}",
                      g.str(), shape);
    if (g.shape(d) == 1) strides[d] = 0;
  }
  Tensor expanded = Tensor::empty(shape, g.dtype(), g.device());
  if (expanded.numel() == 0) return expanded;
  const ElementwiseLayout layout = elementwise_layout(shape, {strides});
  const int width = vector_width(layout, {g.raw_data(), expanded.raw_data()}, g.element_size());
  check_launch(kernels::launch_scaled_copy(element_type(g.dtype(), op), layout, width, g.raw_data(),
                                           expanded.raw_data(), scale, stream_handle(stream)),
               op, g.device(), "scaled copy");
  return expanded;
}

std::pair<Tensor, Tensor> mse_backward_cuda(const Tensor& a, const Tensor& b, const Tensor& g,
                                            double factor, const Stream& stream) {
  const std::string op = "mse_loss";
  require_cuda_operands({&a, &b, &g}, op);
  TESSERA_CHECK_ARG(a.shape() == b.shape() && g.numel() == 1, op,
                    "operands {} and {} with loss gradient {}", a.str(), b.str(), g.str());
  Tensor da = Tensor::empty(a.shape(), a.dtype(), a.device());
  Tensor db = Tensor::empty(a.shape(), a.dtype(), a.device());
  if (da.numel() == 0) return {da, db};
  const ElementwiseLayout layout = elementwise_layout(a.shape(), {a.strides(), b.strides()});
  const int width = vector_width(layout, {a.raw_data(), b.raw_data(), da.raw_data(), db.raw_data()},
                                 a.element_size());
  check_launch(kernels::launch_mse_backward(element_type(a.dtype(), op), layout, width,
                                            a.raw_data(), b.raw_data(), g.raw_data(), da.raw_data(),
                                            db.raw_data(), factor, stream_handle(stream)),
               op, a.device(), "mse backward");
  return {da, db};
}

}  // namespace tessera::ops
