// Reductions sum and mean over any tensor dims, and the mse loss. A reduced dim that is sharded
// gives Partial(sum): each rank sums its own elements; mean divides every partial sum by the
// GLOBAL count, so the reduction of the partials is exact on uneven and empty shards.
//
// Devices: the cpu kernels sum in f64 on the host (reduce_cpu.hpp's typed loops when the reduced
// dims are one block); the cuda kernels (reduce_cuda.hpp) sum
// deterministically on the rank's compute stream, accumulating in float (f16, bf16, f32) or
// double (f64), and the gradients are fused broadcasts on the device.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/estimate/estimate_mode.hpp"
#include "ops/op_helpers.hpp"
#include "ops/reduce/reduce_cpu.hpp"
#include "ops/reduce/reduce_cuda.hpp"
#include "ops/reduce/reduce_ops.hpp"

namespace tessera::ops {

namespace {

/// The dims to reduce ("dims" attr; all dims when absent), sorted and validated.
std::vector<int64_t> reduced_dims(const Shape& shape, const OpAttrs& attrs, const std::string& op) {
  std::vector<int64_t> dims;
  if (attrs.has("dims")) {
    for (int64_t dim : attrs.get_ints("dims")) {
      const int64_t ndim = static_cast<int64_t>(shape.size());
      check_arg(dim >= -ndim && dim < ndim, op, "dim {} of a {}-d tensor", dim, ndim);
      dims.push_back(dim < 0 ? dim + ndim : dim);
    }
  } else {
    for (size_t d = 0; d < shape.size(); ++d) dims.push_back(static_cast<int64_t>(d));
  }
  std::sort(dims.begin(), dims.end());
  dims.erase(std::unique(dims.begin(), dims.end()), dims.end());
  return dims;
}

bool is_reduced(const std::vector<int64_t>& dims, size_t d) {
  return std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) != dims.end();
}

/// Output layout: reduced sharded dims -> Partial(sum); kept dims keep their sharding.
ShardSpec reduced_layout(const ShardSpec& input, const std::vector<int64_t>& dims, bool keepdim) {
  Shape shape;
  std::vector<int> new_index(input.global_shape.size(), -1);
  for (size_t d = 0; d < input.global_shape.size(); ++d) {
    if (is_reduced(dims, d) && !keepdim) continue;
    new_index[d] = static_cast<int>(shape.size());
    shape.push_back(is_reduced(dims, d) ? 1 : input.global_shape[d]);
  }
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents(input.mesh_shape.size());
  for (size_t m = 0; m < input.mesh_shape.size(); ++m) {
    const Placement& placement = input.placements[m];
    if (placement.is_shard() && is_reduced(dims, placement.dim)) {
      placements.push_back(Placement::partial(ReduceOp::sum));
    } else if (placement.is_shard()) {
      placements.push_back(Placement::shard(new_index[placement.dim]));
      extents[m] = input.extents[m];
    } else {
      placements.push_back(placement);
    }
  }
  return ShardSpec::make(shape, input.mesh_shape, placements, extents);
}

/// Local sum of x over `dims` (keepdim shape), in f64, then cast back.
Tensor local_sum(const Tensor& x, const std::vector<int64_t>& dims, double scale) {
  if (std::optional<Tensor> sums = blocked_sum_cpu(x, dims, scale)) return *sums;
  const Tensor source = x.to_dtype(DType::f64).contiguous();
  Shape kept = source.shape();
  for (int64_t d : dims) kept[d] = 1;
  Tensor sums = Tensor::zeros(kept, DType::f64);
  const std::vector<int64_t> out_strides = contiguous_strides(kept);
  const int ndim = source.ndim();
  const double* in = source.data<double>();
  double* out = sums.data<double>();
  if (ndim == 0 || source.numel() == 0) {
    if (source.numel() == 1) out[0] = in[0];
  } else {
    // Rows of the last dim: added into the output row when the last dim is kept, summed into
    // one output element when it is reduced; an odometer over the other dims finds the target.
    const int64_t length = source.shape(ndim - 1);
    const bool last_kept = kept[ndim - 1] != 1 || length == 1;
    std::vector<int64_t> index(ndim - 1, 0);
    for (int64_t row = 0; row < source.numel() / length; ++row) {
      int64_t target = 0;
      for (int d = 0; d < ndim - 1; ++d)
        if (kept[d] != 1 || source.shape(d) == 1) target += index[d] * out_strides[d];
      const double* values = in + row * length;
      if (last_kept) {
        for (int64_t j = 0; j < length; ++j) out[target + j] += values[j];
      } else {
        double sum = 0;
        for (int64_t j = 0; j < length; ++j) sum += values[j];
        out[target] += sum;
      }
      for (int d = ndim - 2; d >= 0; --d) {
        if (++index[d] < source.shape(d)) break;
        index[d] = 0;
      }
    }
  }
  for (int64_t i = 0; i < sums.numel(); ++i) out[i] *= scale;
  return sums.to_dtype(x.dtype());
}

/// Tensor `g` (keepdim shape, `dims` reduced) broadcast back to `shape`, times `scale`.
Tensor broadcast_back(const Tensor& g, const Shape& shape, const std::vector<int64_t>& dims,
                      double scale) {
  if (estimate::active()) return Tensor::empty(shape, g.dtype(), g.device());  // no arithmetic
  if (std::optional<Tensor> dx = blocked_broadcast_cpu(g, shape, dims, scale)) return *dx;
  Box box = Box::of_shape(shape);
  Tensor expanded = Tensor::empty(shape, g.dtype());
  std::vector<int64_t> strides = g.contiguous().strides();
  for (size_t d = 0; d < shape.size(); ++d)
    if (g.shape(static_cast<int>(d)) == 1) strides[d] = 0;
  const Tensor source = g.contiguous();
  if (expanded.numel() > 0) {
    const std::vector<int64_t> dense = contiguous_strides(shape);
    copy_strided_host(expanded.raw_data(), dense.data(), source.raw_data(), strides.data(),
                      shape.data(), static_cast<int>(shape.size()), g.element_size());
  }
  return map_elements(expanded, [scale](double v) { return v * scale; });
}

double count_of(const Shape& global, const std::vector<int64_t>& dims) {
  double count = 1;
  for (int64_t d : dims) count *= static_cast<double>(global[d]);
  return count;
}

void register_reduction(const std::string& name, bool mean) {
  RuleFn rule = [name](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    const std::vector<int64_t> dims = reduced_dims(inputs[0].global_shape, attrs, name);
    // Partial(sum) inputs stay partial (the reduction is linear); other partial ops reduce first.
    ShardSpec layout = inputs[0];
    for (Placement& placement : layout.placements)
      if (placement.is_partial() && placement.reduce != ReduceOp::sum)
        placement = Placement::replicate();
    return OpRule{
        {layout}, {std::nullopt}, {reduced_layout(layout, dims, attrs.get_int("keepdim", 0) != 0)}};
  };
  KernelFn cpu = [name, mean](const KernelContext& context, const std::vector<Tensor>& inputs) {
    require_floating_cpu(inputs[0], name);
    const Shape& global = context.input_specs[0].global_shape;
    const std::vector<int64_t> dims = reduced_dims(global, context.attrs, name);
    const double scale = mean ? 1.0 / count_of(global, dims) : 1.0;
    Tensor sums = local_sum(inputs[0], dims, scale);
    return std::vector<Tensor>{sums.contiguous().reshape(context.output_boxes[0].shape())};
  };
  KernelFn cuda = [name, mean](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const Shape& global = context.input_specs[0].global_shape;
    const std::vector<int64_t> dims = reduced_dims(global, context.attrs, name);
    const double scale = mean ? 1.0 / count_of(global, dims) : 1.0;
    const Tensor sums = sum_cuda(inputs[0], dims, scale, context.stream, name);
    return std::vector<Tensor>{sums.reshape(context.output_boxes[0].shape())};
  };
  BackwardFn backward = [name, mean](const OpRecord& record,
                                     const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardTensor& x = record.inputs[0];
    const std::vector<int64_t> dims = reduced_dims(x.global_shape(), record.attrs, name);
    const double scale = mean ? 1.0 / count_of(x.global_shape(), dims) : 1.0;
    // Every rank needs the gradient of the outputs its elements were reduced into.
    const ShardSpec g_layout = without_partial(record.outputs[0].spec());
    const ShardTensor g = grads[0]->redistribute_to(g_layout);
    Shape keep = x.to_local().shape();
    for (int64_t d : dims) keep[d] = 1;
    const Tensor g_local = g.to_local().contiguous().reshape(keep);
    const ShardSpec x_layout = without_partial(x.spec());
    const Shape& x_shape = x.to_local().shape();
    const Tensor dx = g_local.device().is_cuda()
                          ? broadcast_back_cuda(g_local, x_shape, scale,
                                                compute_stream_for(g_local.device()), name)
                          : broadcast_back(g_local, x_shape, dims, scale);
    return {ShardTensor(dx, x.mesh(), x_layout)};
  };
  register_op(
      OpDef{.name = name,
            .summary = mean ? "Mean over dims (all when unset); exact on uneven shards"
                            : "Sum over dims (all when unset); sharded reduced dims give "
                              "Partial(sum)",
            .inputs = {{.name = "x"}},
            .outputs = {"y"},
            .attrs = {{.name = "dims",
                       .type = AttrType::int_list,
                       .doc = "the dims reduced (negative count from the end); unset: every dim"},
                      {.name = "keepdim",
                       .type = AttrType::boolean,
                       .default_value = int64_t{0},
                       .doc = "keep reduced dims with extent 1"}},
            .rule = std::move(rule),
            .cpu = std::move(cpu),
            .cuda = std::move(cuda),
            .backward = std::move(backward)});
}

void register_mse_loss() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs&) {
    check_arg(inputs.size() == 2 && inputs[0].global_shape == inputs[1].global_shape, "mse_loss",
              "needs two inputs of one shape, got {} and {}", inputs[0].global_shape,
              inputs.size() > 1 ? inputs[1].global_shape : Shape{});
    const ShardSpec layout = without_partial(inputs[0]);
    std::vector<int64_t> all(layout.global_shape.size());
    for (size_t d = 0; d < all.size(); ++d) all[d] = static_cast<int64_t>(d);
    return OpRule{
        {layout, layout}, {std::nullopt, std::nullopt}, {reduced_layout(layout, all, false)}};
  };
  KernelFn cpu = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    require_floating_cpu(inputs[0], "mse_loss");
    const double count = static_cast<double>(shape_numel(context.input_specs[0].global_shape));
    const Tensor squared =
        zip_elements(inputs[0], inputs[1], [](double a, double b) { return (a - b) * (a - b); });
    std::vector<int64_t> all(squared.shape().size());
    for (size_t d = 0; d < all.size(); ++d) all[d] = static_cast<int64_t>(d);
    return std::vector<Tensor>{local_sum(squared, all, 1.0 / count).reshape({})};
  };
  KernelFn cuda = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const double count = static_cast<double>(shape_numel(context.input_specs[0].global_shape));
    return std::vector<Tensor>{
        squared_difference_sum_cuda(inputs[0], inputs[1], 1.0 / count, context.stream)};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardTensor& a = record.inputs[0];
    const ShardTensor& b = record.inputs[1];
    const ShardSpec g_layout = without_partial(record.outputs[0].spec());
    const Tensor g_local = grads[0]->redistribute_to(g_layout).to_local();
    const double count = static_cast<double>(shape_numel(a.global_shape()));
    if (g_local.device().is_cuda()) {  // g stays on the device: the kernel reads it there
      auto [da, db] = mse_backward_cuda(a.to_local(), b.to_local(), g_local, 2.0 / count,
                                        compute_stream_for(g_local.device()));
      return {ShardTensor(da, a.mesh(), a.spec()), ShardTensor(db, b.mesh(), b.spec())};
    }
    if (g_local.is_shape_only())  // estimate mode: the gradients' shapes, no arithmetic
      return {ShardTensor(Tensor::empty(a.to_local().shape(), a.dtype()), a.mesh(), a.spec()),
              ShardTensor(Tensor::empty(b.to_local().shape(), b.dtype()), b.mesh(), b.spec())};
    const double g = g_local.to_dtype(DType::f64).data<double>()[0];
    const double factor = 2.0 * g / count;
    const Tensor da = zip_elements(a.to_local(), b.to_local(),
                                   [factor](double x, double y) { return factor * (x - y); });
    const Tensor db = map_elements(da, [](double v) { return -v; });
    return {ShardTensor(da, a.mesh(), a.spec()), ShardTensor(db, b.mesh(), b.spec())};
  };
  register_op(OpDef{.name = "mse_loss",
                    .summary = "mean((a - b)^2) over every element: a scalar",
                    .inputs = {{.name = "a"}, {.name = "b"}},
                    .outputs = {"y"},
                    .rule = std::move(rule),
                    .cpu = std::move(cpu),
                    .cuda = std::move(cuda),
                    .backward = std::move(backward)});
}

}  // namespace

void register_reduce_ops() {
  register_reduction("sum", false);
  register_reduction("mean", true);
  register_mse_loss();
}

namespace {
ShardTensor reduction(const char* name, const ShardTensor& x, const std::vector<int64_t>& dims,
                      bool keepdim) {
  OpAttrs attrs;
  if (!dims.empty()) attrs.set("dims", dims);
  attrs.set("keepdim", int64_t{keepdim});
  return apply_op(name, {x}, attrs)[0];
}
}  // namespace

ShardTensor sum(const ShardTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduction("sum", x, dims, keepdim);
}
ShardTensor mean(const ShardTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduction("mean", x, dims, keepdim);
}
ShardTensor mse_loss(const ShardTensor& a, const ShardTensor& b) {
  return apply_op("mse_loss", {a, b})[0];
}

}  // namespace tessera::ops
