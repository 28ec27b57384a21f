// The sharded pooling ops: attributes, rule (output ownership, halo), kernels and backward.
//
// Along a spatial dim with input extent L, kernel K, stride s, dilation d and padding p, output
// o reads inputs o*s - p + j*d, j < K; cells outside [0, L) are padding. Output o is owned by the
// rank owning input clamp(o*s, 0, L-1) (as conv); a rank owning outputs [a, b) needs inputs
// [a*s - p, (b-1)*s - p + d*(K-1) + 1) cut to [0, L), which the halo plan fills (no halo at all
// when that is every rank's own piece, as with stride = kernel, no padding and shards on window
// borders). The kernels are told the global box of their haloed piece and the global extent, so
// windows may start before or end past the piece: every cell outside [0, L) is padding (as is any
// zero-filled cell a plan puts past a global edge), and one kernel serves sharded and unsharded
// calls. The channel and batch dims may stay sharded: pooling works on each (n, c) plane alone.
#include "ops/pool/pool_op.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>

#include "core/halo/halo_exchange.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/op_costs.hpp"
#include "ops/op_helpers.hpp"
#include "ops/pool/pool_cpu.hpp"
#include "ops/pool/pool_cuda.hpp"

namespace tessera::ops {

namespace {

using kernels::PoolKind;
using kernels::PoolWindows;

const char* name_of(PoolKind kind) {
  return kind == PoolKind::max ? "max_pool" : "avg_pool";
}

/// Per-spatial-dim geometry resolved from the attrs.
struct PoolDims {
  int spatial = 0;
  std::vector<int64_t> kernel, stride, padding, dilation, input, output;
  bool ceil_mode = false;
  bool count_include_pad = true;
  int64_t divisor_override = 0;
};

/// PyTorch's pooling output extent (pooling_output_shape): rounded down, or up with ceil_mode as
/// long as the last window starts inside the input or the left padding.
int64_t output_extent(int64_t length, int64_t kernel, int64_t stride, int64_t padding,
                      int64_t dilation, bool ceil_mode) {
  const int64_t span = dilation * (kernel - 1) + 1;
  const int64_t numerator = length + 2 * padding - span + (ceil_mode ? stride - 1 : 0);
  // Division rounding towards minus infinity.
  int64_t output = numerator / stride - (numerator % stride != 0 && numerator < 0 ? 1 : 0) + 1;
  if (ceil_mode && output > 0 && (output - 1) * stride >= length + padding) --output;
  return output;
}

PoolDims resolve(PoolKind kind, const Shape& x, const OpAttrs& attrs) {
  const char* op = name_of(kind);
  PoolDims dims;
  check_arg(x.size() >= 3 && x.size() <= 5, op,
            "expected a 3-d, 4-d or 5-d input [N, C, spatial..], got shape {}", x);
  dims.spatial = static_cast<int>(x.size()) - 2;
  check_arg(attrs.has("kernel_size"), op, "missing required attribute 'kernel_size'");
  auto per_dim = [&](const char* name, std::vector<int64_t> fallback) {
    std::vector<int64_t> values = attrs.has(name) ? attrs.get_ints(name) : fallback;
    if (values.size() == 1) values.assign(dims.spatial, values[0]);
    check_arg(static_cast<int>(values.size()) == dims.spatial, op,
              "attribute '{}' = {}: expected 1 or {} values for a {}-d pooling", name, values,
              dims.spatial, dims.spatial);
    return values;
  };
  dims.kernel = per_dim("kernel_size", {});
  dims.stride = per_dim("stride", dims.kernel);
  dims.padding = per_dim("padding", {0});
  dims.dilation = per_dim("dilation", {1});
  dims.ceil_mode = attrs.get_int("ceil_mode", 0) != 0;
  dims.count_include_pad = attrs.get_int("count_include_pad", 1) != 0;
  dims.divisor_override = attrs.get_int("divisor_override", 0);
  check_arg(dims.divisor_override >= 0, op,
            "attribute 'divisor_override' = {}: expected > 0, or 0 for none",
            dims.divisor_override);
  for (int i = 0; i < dims.spatial; ++i) {
    const int64_t kernel = dims.kernel[i], stride = dims.stride[i];
    const int64_t padding = dims.padding[i], dilation = dims.dilation[i];
    check_arg(kernel >= 1 && kernel <= (int64_t{1} << 30), op,
              "attribute 'kernel_size' = {}: every value must be in [1, 2^30]", dims.kernel);
    check_arg(stride >= 1 && stride <= (int64_t{1} << 30), op,
              "attribute 'stride' = {}: every value must be in [1, 2^30]", dims.stride);
    check_arg(dilation >= 1 && dilation <= (int64_t{1} << 30), op,
              "attribute 'dilation' = {}: every value must be in [1, 2^30]", dims.dilation);
    check_arg(padding >= 0 && padding <= kernel / 2, op,
              "attribute 'padding' = {}: must be at least 0 and at most half of kernel_size {}",
              dims.padding, dims.kernel);
    const int64_t length = x[2 + i];
    check_arg(length >= 1 && length <= (int64_t{1} << 40), op,
              "input of shape {}: spatial extents must be at least 1", x);
    const int64_t output = output_extent(length, kernel, stride, padding, dilation, dims.ceil_mode);
    check_arg(output >= 1, op,
              "input of shape {} is too small for kernel_size {}, dilation {} and padding {}: "
              "output extent {} along spatial dim {}",
              x, dims.kernel, dims.dilation, dims.padding, output, i);
    dims.input.push_back(length);
    dims.output.push_back(output);
  }
  if (kind == PoolKind::avg)
    check_arg(
        std::all_of(dims.dilation.begin(), dims.dilation.end(), [](int64_t d) { return d == 1; }),
        op, "attribute 'dilation' = {}: avg_pool has no dilation", dims.dilation);
  return dims;
}

OpRule pool_rule(PoolKind kind, const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
  const char* op = name_of(kind);
  check_arg(inputs.size() == 1, op, "expects one input x, got {}", inputs.size());
  const ShardSpec x = without_partial(inputs[0]);
  const PoolDims dims = resolve(kind, x.global_shape, attrs);
  OpRule rule;
  rule.inputs.push_back(x);

  Shape out_shape{x.global_shape[0], x.global_shape[1]};
  for (int i = 0; i < dims.spatial; ++i) out_shape.push_back(dims.output[i]);
  std::vector<std::vector<int64_t>> out_extents(x.mesh_shape.size());
  for (size_t m = 0; m < x.mesh_shape.size(); ++m) {
    if (!x.placements[m].is_shard()) continue;
    const int dim = x.placements[m].dim;
    out_extents[m] = dim < 2 ? x.extents[m]
                             : strided_output_extents(x.extents[m], dims.input[dim - 2],
                                                      dims.output[dim - 2], dims.stride[dim - 2]);
  }
  const ShardSpec y = ShardSpec::make(out_shape, x.mesh_shape, x.placements, out_extents, op);
  rule.outputs.push_back(y);
  if (kind == PoolKind::max) {  // the indices, laid out as y
    rule.outputs.push_back(y);
    rule.output_dtypes = {std::nullopt, DType::i64};
  }

  // Halo of x: the input range every rank's outputs read, cut to the tensor.
  HaloNeed need;
  need.boundary.assign(x.global_shape.size(), BoundaryMode::zero);
  bool own_piece_only = true;  // every rank reads exactly its own piece (stride = kernel, ...)
  for (int rank = 0; rank < mesh_size(x.mesh_shape); ++rank) {
    Box box = x.local_box_of_rank(rank);
    const Box out_box = y.local_box_of_rank(rank);
    for (int i = 0; i < dims.spatial; ++i) {
      const int64_t first = out_box.lo[2 + i], last = out_box.hi[2 + i];
      const int64_t lo = first * dims.stride[i] - dims.padding[i];
      const int64_t hi = last > first ? (last - 1) * dims.stride[i] - dims.padding[i] +
                                            dims.dilation[i] * (dims.kernel[i] - 1) + 1
                                      : lo;
      // Cut to the tensor: what lies beyond is padding, which the kernel knows from the extent.
      box.lo[2 + i] = std::clamp<int64_t>(lo, 0, dims.input[i]);
      box.hi[2 + i] = std::clamp<int64_t>(hi, box.lo[2 + i], dims.input[i]);
    }
    own_piece_only = own_piece_only && box == x.local_box_of_rank(rank);
    need.needed.push_back(box);
  }
  // Without a halo the kernel reads the owned piece as it is (no haloed copy).
  rule.halos.push_back(own_piece_only ? std::nullopt : std::optional<HaloNeed>(need));
  return rule;
}

/// The windows of a local piece: the haloed input covers global box `haloed`, the output
/// global box `out`.
PoolWindows windows_of(PoolKind kind, const OpAttrs& attrs, const Shape& x_shape, const Box& haloed,
                       const Box& out) {
  const PoolDims dims = resolve(kind, x_shape, attrs);
  PoolWindows windows;
  windows.kind = kind;
  windows.planes = (haloed.hi[0] - haloed.lo[0]) * (haloed.hi[1] - haloed.lo[1]);
  windows.count_include_pad = dims.count_include_pad;
  windows.divisor_override = dims.divisor_override;
  for (int i = 0; i < dims.spatial; ++i) {
    kernels::PoolDim& dim = windows.dims[3 - dims.spatial + i];
    const int64_t lo = haloed.lo[2 + i];
    dim.in = haloed.hi[2 + i] - lo;
    dim.out = out.hi[2 + i] - out.lo[2 + i];
    dim.kernel = dims.kernel[i];
    dim.stride = dims.stride[i];
    dim.dilation = dims.dilation[i];
    dim.first = out.lo[2 + i] * dims.stride[i] - dims.padding[i] - lo;
    dim.real_lo = std::clamp<int64_t>(-lo, 0, dim.in);
    dim.real_hi = std::clamp<int64_t>(dims.input[i] - lo, dim.real_lo, dim.in);
    dim.padded_hi = dims.input[i] + dims.padding[i] - lo;
    dim.global_lo = lo;
    dim.global_in = dims.input[i];
  }
  return windows;
}

std::vector<Tensor> forward_local(const PoolWindows& windows, const Tensor& x, const Shape& y_shape,
                                  const Stream& stream) {
  if (x.device().is_cuda()) return pool_forward_cuda(windows, x, y_shape, stream);
  return pool_forward_cpu(windows, x, y_shape);
}

KernelFn kernel_of(PoolKind kind) {
  return [kind](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const PoolWindows windows = windows_of(kind, context.attrs, context.input_specs[0].global_shape,
                                           context.input_boxes[0], context.output_boxes[0]);
    return forward_local(windows, inputs[0], context.output_boxes[0].shape(), context.stream);
  };
}

BackwardFn backward_of(PoolKind kind) {
  return [kind](const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads) {
    return single_input_halo_backward(
        record, grads, [&](const Tensor& g_local, const Tensor& x_haloed, const Box& box) {
          const PoolWindows windows =
              windows_of(kind, record.attrs, record.inputs[0].global_shape(), box,
                         record.outputs[0].local_box());
          if (x_haloed.device().is_cuda())
            return pool_backward_cuda(windows, x_haloed, g_local,
                                      compute_stream_for(x_haloed.device()));
          // max: the gradient goes where the forward's indices say (x itself is not read).
          const std::optional<Tensor> indices =
              kind == PoolKind::max ? std::optional<Tensor>(record.outputs.at(1).to_local())
                                    : std::nullopt;
          return pool_backward_cpu(windows, x_haloed.shape(), indices, g_local);
        });
  };
}

OpAttr per_dim_attr(const char* name, std::optional<int64_t> value, const char* doc) {
  return OpAttr{.name = name,
                .type = AttrType::int_list,
                .default_value =
                    value ? std::optional<AttrValue>(std::vector<int64_t>{*value}) : std::nullopt,
                .required = std::string(name) == "kernel_size",
                .doc = doc};
}

OpAttr bool_attr(const char* name, bool value, const char* doc) {
  return OpAttr{
      .name = name, .type = AttrType::boolean, .default_value = int64_t{value ? 1 : 0}, .doc = doc};
}

OpAttrs attrs_of(PoolKind kind, const PoolOptions& options) {
  OpAttrs attrs;
  attrs.set("kernel_size", options.kernel_size).set("padding", options.padding);
  if (!options.stride.empty()) attrs.set("stride", options.stride);
  attrs.set("ceil_mode", int64_t{options.ceil_mode ? 1 : 0});
  if (kind == PoolKind::max) {
    attrs.set("dilation", options.dilation);
  } else {
    check_arg(std::all_of(options.dilation.begin(), options.dilation.end(),
                          [](int64_t d) { return d == 1; }),
              "avg_pool", "dilation {}: avg_pool has no dilation", options.dilation);
    attrs.set("count_include_pad", int64_t{options.count_include_pad ? 1 : 0});
    attrs.set("divisor_override", options.divisor_override);
  }
  return attrs;
}

}  // namespace

void register_pool_ops() {
  const auto rule = [](PoolKind kind) {
    return [kind](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
      return pool_rule(kind, inputs, attrs);
    };
  };
  register_op(OpDef{
      .name = "max_pool",
      .summary = "max_pool1d/2d/3d (by the rank of x) of x [N, C, spatial..] and the indices of "
                 "the maxima (i64, flat in the input's spatial plane), PyTorch's semantics",
      .inputs = {{.name = "x"}},
      .outputs = {"y", "indices"},
      .attrs = {per_dim_attr("kernel_size", std::nullopt, "per spatial dim, or one for all"),
                per_dim_attr("stride", std::nullopt,
                             "per spatial dim, or one for all; unset: "
                             "kernel_size"),
                per_dim_attr("padding", 0, "-inf cells on both sides, at most kernel_size/2"),
                per_dim_attr("dilation", 1, "per spatial dim, or one for all"),
                bool_attr("ceil_mode", false, "round the output extent up")},
      .rule = rule(PoolKind::max),
      .cpu = kernel_of(PoolKind::max),
      .cuda = kernel_of(PoolKind::max),
      .backward = backward_of(PoolKind::max),
      .cost = pool_cost});
  register_op(OpDef{
      .name = "avg_pool",
      .summary = "avg_pool1d/2d/3d (by the rank of x) of x [N, C, spatial..], PyTorch's semantics",
      .inputs = {{.name = "x"}},
      .outputs = {"y"},
      .attrs = {per_dim_attr("kernel_size", std::nullopt, "per spatial dim, or one for all"),
                per_dim_attr("stride", std::nullopt,
                             "per spatial dim, or one for all; unset: "
                             "kernel_size"),
                per_dim_attr("padding", 0, "zero cells on both sides, at most kernel_size/2"),
                bool_attr("ceil_mode", false, "round the output extent up"),
                bool_attr("count_include_pad", true, "the divisor counts padding cells"),
                {.name = "divisor_override",
                 .type = AttrType::int_scalar,
                 .default_value = int64_t{0},
                 .doc = "the divisor of every window; 0: none"}},
      .rule = rule(PoolKind::avg),
      .cpu = kernel_of(PoolKind::avg),
      .cuda = kernel_of(PoolKind::avg),
      .backward = backward_of(PoolKind::avg),
      .cost = pool_cost});
}

std::pair<ShardTensor, ShardTensor> max_pool_with_indices(const ShardTensor& x,
                                                          const PoolOptions& options) {
  std::vector<ShardTensor> outputs = apply_op("max_pool", {x}, attrs_of(PoolKind::max, options));
  return {std::move(outputs[0]), std::move(outputs[1])};
}

ShardTensor max_pool(const ShardTensor& x, const PoolOptions& options) {
  return max_pool_with_indices(x, options).first;
}

ShardTensor avg_pool(const ShardTensor& x, const PoolOptions& options) {
  return apply_op("avg_pool", {x}, attrs_of(PoolKind::avg, options))[0];
}

}  // namespace tessera::ops
