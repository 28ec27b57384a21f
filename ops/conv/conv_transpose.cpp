// The sharded transposed convolution (conv_transpose1d/2d/3d): rule, kernel call and backward.
//
// Along a spatial dim with input extent L, kernel k, stride s, padding p and dilation d, input i
// adds into outputs i*s - p + j*d, j < k. That is the data gradient of a conv with the same
// stride and dilation that maps the outputs (as its input) to the inputs (as its output), so the
// local kernel is conv_backward_data and the backward is conv_forward (dx) and
// conv_backward_weight with the roles of x and the output gradient swapped (dw). Output o is owned
// by the rank owning input clamp(floor((o + p) / s), 0, L-1); a rank's outputs [o_lo, o_hi) need
// the inputs conv_transpose_span gives, which the halo plan fills. The conv of a rank's piece has
// its outputs padded by (o_lo + p - in_lo*s) before them and enough after to end at the last
// input's last tap: positive padding drops the taps that land outside the rank's outputs, negative
// padding is outputs no input reaches (stride > kernel, output_padding, a box past every tap);
// those are cut off and get 0. No output beyond the rank's box is ever held in memory.
//
// Tensor parallelism: w sharded over a mesh dim splits the channels there, composed with any
// spatial or batch sharding of x on the other mesh dims. Groups 1: filter-parallel, w Shard(1)
// (Cout split): x is replicated there, y is Shard(1) with w's extents, b is split like y; dx is
// Partial(sum) there. Channel-parallel, w Shard(0) (Cin split): x is Shard(1) with w's extents, y
// is Partial(sum) (a bias is refused: add it after the reduction); the gradient of y arrives
// replicated there. Groups > 1: w Shard(0) in whole groups (group-parallel): x, y and b are all
// Shard(1) by group and nothing is summed; a split inside a group, or of w's dim 1, is refused.
// dw (db) keeps w's (b's) Shard and is Partial(sum) over the other mesh dims that shard x.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/backend/backend.hpp"
#include "core/checked_math.hpp"
#include "core/halo/halo_exchange.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/conv/conv_kernels.hpp"
#include "ops/conv/conv_op.hpp"
#include "ops/op_costs.hpp"
#include "ops/op_helpers.hpp"

namespace tessera::ops {

namespace {

constexpr const char* kOp = "conv_transpose";

int64_t floor_div(int64_t a, int64_t b) {
  return a / b - ((a % b != 0 && a < 0) ? 1 : 0);
}

int64_t ceil_div(int64_t a, int64_t b) {
  return -floor_div(-a, b);
}

/// Per-spatial-dim geometry resolved from the attrs.
struct TransposeDims {
  int spatial = 0;
  std::vector<int64_t> stride, padding, output_padding, dilation, kernel, input, output;
  int64_t groups = 1, out_channels = 0;
};

TransposeDims resolve(const Shape& x, const Shape& w, const OpAttrs& attrs) {
  TransposeDims dims;
  check_arg(x.size() >= 3 && x.size() <= 5, kOp,
            "expected a 3-d, 4-d or 5-d input [N, C, spatial..], got shape {}", x);
  dims.spatial = static_cast<int>(x.size()) - 2;
  check_arg(w.size() == x.size(), kOp,
            "weight of shape {} for an input of shape {} (conv_transpose{}d needs a {}-d weight)",
            w, x, dims.spatial, x.size());
  dims.groups = attrs.get_int("groups", 1);
  check_arg(dims.groups >= 1 && x[1] % dims.groups == 0, kOp,
            "'groups' {} must be >= 1 and divide the input channels {}", dims.groups, x[1]);
  check_arg(w[0] == x[1], kOp,
            "weight of shape {} expects {} input channels (its first dim), the input has {}", w,
            w[0], x[1]);
  dims.out_channels = checked_mul(w[1], dims.groups, kOp, "output channels");
  auto per_dim = [&](const char* name, int64_t fallback) {
    std::vector<int64_t> values =
        attrs.has(name) ? attrs.get_ints(name) : std::vector<int64_t>{fallback};
    if (values.size() == 1) values.assign(dims.spatial, values[0]);
    check_arg(static_cast<int>(values.size()) == dims.spatial, kOp,
              "'{}' {} for conv_transpose{}d (one value, or one per spatial dim)", name, values,
              dims.spatial);
    return values;
  };
  dims.stride = per_dim("stride", 1);
  dims.padding = per_dim("padding", 0);
  dims.output_padding = per_dim("output_padding", 0);
  dims.dilation = per_dim("dilation", 1);
  for (int i = 0; i < dims.spatial; ++i) {
    check_arg(dims.stride[i] >= 1 && dims.dilation[i] >= 1, kOp,
              "'stride' {} and 'dilation' {} must be >= 1", dims.stride, dims.dilation);
    check_arg(dims.padding[i] >= 0 && dims.output_padding[i] >= 0, kOp,
              "'padding' {} and 'output_padding' {} must be >= 0", dims.padding,
              dims.output_padding);
    check_arg(
        dims.output_padding[i] < std::max(dims.stride[i], dims.dilation[i]), kOp,
        "'output_padding' {} must be smaller than either 'stride' {} or 'dilation' {} (spatial "
        "dim {})",
        dims.output_padding, dims.stride, dims.dilation, i);
    check_arg(w[2 + i] >= 1, kOp, "kernel extent {} along spatial dim {} must be >= 1 (weight {})",
              w[2 + i], i, w);
    const int64_t extent =
        conv_transpose_extent(x[2 + i], w[2 + i], dims.stride[i], dims.padding[i], dims.dilation[i],
                              dims.output_padding[i]);
    check_arg(x[2 + i] >= 1 && extent >= 1, kOp,
              "input extent {} along spatial dim {} gives output extent {} (too small; kernel {}, "
              "stride {}, padding {}, dilation {}, output_padding {})",
              x[2 + i], i, extent, w[2 + i], dims.stride[i], dims.padding[i], dims.dilation[i],
              dims.output_padding[i]);
    dims.kernel.push_back(w[2 + i]);
    dims.input.push_back(x[2 + i]);
    dims.output.push_back(extent);
  }
  return dims;
}

/// How conv_transpose's w [Cin, Cout/groups, k..] is split over one mesh dim (tensor
/// parallelism).
enum class TransposeParallel { none, filter, channel, group };

/// The split of w over mesh dim m: Shard(1) filter-parallel (groups 1), Shard(0) channel-parallel
/// (groups 1) or group-parallel (groups > 1, whole groups per rank); anything else that cannot be
/// split is refused here, the same on every rank (every rank holds the same specs).
TransposeParallel transpose_parallel_kind(const ShardSpec& w, size_t m, const TransposeDims& dims) {
  const Placement& p = w.placements[m];
  if (!p.is_shard() || p.dim > 1) return TransposeParallel::none;
  if (dims.groups == 1) return p.dim == 1 ? TransposeParallel::filter : TransposeParallel::channel;
  check_arg(p.dim == 0, kOp,
            "w is sharded on its output channels (dim 1) over mesh dim {} with groups {}: each "
            "rank's output channels would not be contiguous; shard w on dim 0 in whole groups",
            m, dims.groups);
  const int64_t per_group = w.global_shape[0] / dims.groups;
  for (const int64_t extent : w.extents[m])
    check_arg(extent % per_group == 0, kOp,
              "w's input channels {} are split {} over mesh dim {}: with groups {} every part "
              "must hold whole groups of {} channels (a tp size that divides the groups)",
              w.global_shape[0], w.extents[m], m, dims.groups, per_group);
  return TransposeParallel::group;
}

OpRule conv_transpose_rule(const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
  check_arg(inputs.size() == 2 || inputs.size() == 3, kOp, "expects inputs x, w[, b], got {}",
            inputs.size());
  const ShardSpec& x_given = inputs[0];
  const ShardSpec& w_given = inputs[1];
  const TransposeDims dims = resolve(x_given.global_shape, w_given.global_shape, attrs);
  if (inputs.size() == 3)
    check_arg(inputs[2].global_shape == Shape{dims.out_channels}, kOp,
              "bias of shape {}, expected [{}]", inputs[2].global_shape, dims.out_channels);
  // x: channels whole (but over channel- and group-parallel mesh dims), no pending partial sums;
  // w and b replicated but over the tensor-parallel mesh dims.
  const size_t mesh_dims = x_given.mesh_shape.size();
  ShardSpec x = without_partial(x_given);
  std::vector<Placement> w_placements(mesh_dims, Placement::replicate());
  std::vector<Placement> b_placements(mesh_dims, Placement::replicate());
  std::vector<std::vector<int64_t>> w_extents(mesh_dims), b_extents(mesh_dims);
  std::vector<Placement> y_placements(mesh_dims, Placement::replicate());
  std::vector<std::vector<int64_t>> out_extents(mesh_dims);
  int channel_split_dims = 0;
  for (size_t m = 0; m < mesh_dims; ++m) {
    const TransposeParallel kind = transpose_parallel_kind(w_given, m, dims);
    if (kind == TransposeParallel::none) {
      if (x.placements[m].is_shard() && x.placements[m].dim == 1) {
        x.placements[m] = Placement::replicate();
        x.extents[m].clear();
      }
      continue;
    }
    ++channel_split_dims;
    if (kind == TransposeParallel::filter) {  // Cout split: x whole, y Shard(1)
      x.placements[m] = Placement::replicate();
      x.extents[m].clear();
      w_placements[m] = Placement::shard(1);
      b_placements[m] = Placement::shard(0);
      w_extents[m] = b_extents[m] = w_given.extents[m];
      y_placements[m] = Placement::shard(1);
      out_extents[m] = w_given.extents[m];
    } else if (kind == TransposeParallel::channel) {  // Cin split: x Shard(1), y Partial(sum)
      check_arg(inputs.size() == 2, kOp,
                "w is sharded on its input channels (channel-parallel) over mesh dim {}: a bias "
                "would be added once per rank of the sum; add it after the reduction",
                m);
      x.placements[m] = Placement::shard(1);
      x.extents[m] = w_given.extents[m];
      w_placements[m] = Placement::shard(0);
      w_extents[m] = w_given.extents[m];
      y_placements[m] = Placement::partial(ReduceOp::sum);
    } else {  // whole groups: x, w, b and y all split by group
      const int64_t in_per_group = w_given.global_shape[0] / dims.groups;
      const int64_t out_per_group = w_given.global_shape[1];
      x.placements[m] = Placement::shard(1);
      x.extents[m] = w_given.extents[m];
      w_placements[m] = Placement::shard(0);
      w_extents[m] = w_given.extents[m];
      y_placements[m] = Placement::shard(1);
      b_placements[m] = Placement::shard(0);
      for (const int64_t extent : w_given.extents[m])
        out_extents[m].push_back(extent / in_per_group * out_per_group);
      b_extents[m] = out_extents[m];
    }
  }
  check_arg(channel_split_dims <= 1, kOp,
            "w's channels are split over {} mesh dims; at most one mesh dim may split them",
            channel_split_dims);
  x = ShardSpec::make(x.global_shape, x.mesh_shape, x.placements, x.extents, kOp);
  OpRule rule;
  rule.inputs.push_back(x);
  rule.inputs.push_back(
      ShardSpec::make(w_given.global_shape, x.mesh_shape, w_placements, w_extents, kOp));
  if (inputs.size() == 3)
    rule.inputs.push_back(
        ShardSpec::make(inputs[2].global_shape, x.mesh_shape, b_placements, b_extents, kOp));

  Shape out_shape{x.global_shape[0], dims.out_channels};
  for (int i = 0; i < dims.spatial; ++i) out_shape.push_back(dims.output[i]);
  for (size_t m = 0; m < mesh_dims; ++m) {
    if (!x.placements[m].is_shard() || x.placements[m].dim == 1) continue;
    const int dim = x.placements[m].dim;
    y_placements[m] = x.placements[m];
    out_extents[m] =
        dim == 0 ? x.extents[m]
                 : upsampled_output_extents(x.extents[m], dims.input[dim - 2], dims.output[dim - 2],
                                            dims.stride[dim - 2], dims.padding[dim - 2]);
  }
  const ShardSpec y = ShardSpec::make(out_shape, x.mesh_shape, y_placements, out_extents, kOp);
  rule.outputs.push_back(y);

  // Halo of x: the inputs whose taps land in each rank's outputs (zero outside the tensor).
  HaloNeed need;
  need.boundary.assign(x.global_shape.size(), BoundaryMode::zero);
  for (int rank = 0; rank < mesh_size(x.mesh_shape); ++rank) {
    Box box = x.local_box_of_rank(rank);
    const Box out_box = y.local_box_of_rank(rank);
    for (int i = 0; i < dims.spatial; ++i) {
      const ConvTransposeSpan span =
          conv_transpose_span(dims.input[i], dims.kernel[i], dims.stride[i], dims.padding[i],
                              dims.dilation[i], out_box.lo[2 + i], out_box.hi[2 + i]);
      box.lo[2 + i] = span.in_lo;
      box.hi[2 + i] = span.in_hi;
    }
    need.needed.push_back(box);
  }
  rule.halos.push_back(need);
  for (size_t i = 1; i < inputs.size(); ++i) rule.halos.push_back(std::nullopt);
  return rule;
}

/// The conv whose data gradient computes a rank's piece: `geometry` (non-negative padding) maps
/// the box `reached` of the local outputs (local coordinates; outside it no input lands) to the
/// haloed input piece. `empty` when no input lands in the outputs at all.
struct PieceConv {
  ConvGeometry geometry;
  Box reached;
  bool empty = false;
};

/// The PieceConv of the haloed input (global box `haloed`) computing the outputs `out` (global
/// box).
PieceConv piece_conv(const OpAttrs& attrs, const Shape& x, const Shape& w, const Box& haloed,
                     const Box& out) {
  const TransposeDims dims = resolve(x, w, attrs);
  PieceConv piece;
  // Group-parallel: the piece holds whole groups of the input channels, so its conv has as many
  // groups as it holds (at least one, for the kernel's sake, when it holds none).
  const int64_t local_in = haloed.hi[1] - haloed.lo[1];
  const int64_t local_groups =
      dims.groups == 1 ? 1 : std::max<int64_t>(1, dims.groups * local_in / x[1]);
  piece.geometry =
      ConvGeometry{dims.stride, dims.dilation, local_groups, std::vector<int64_t>(dims.spatial, 0),
                   std::vector<int64_t>(dims.spatial, 0)};
  const Shape out_shape = out.shape();
  piece.reached = Box{Shape(out_shape.size(), 0), out_shape};
  for (int i = 0; i < dims.spatial; ++i) {
    const ConvTransposeSpan span =
        conv_transpose_span(dims.input[i], dims.kernel[i], dims.stride[i], dims.padding[i],
                            dims.dilation[i], out.lo[2 + i], out.hi[2 + i]);
    check_arg(span.in_lo == haloed.lo[2 + i] && span.in_hi == haloed.hi[2 + i], kOp,
              "haloed input [{}, {}) along spatial dim {}, the rule needs [{}, {})",
              haloed.lo[2 + i], haloed.hi[2 + i], i, span.in_lo, span.in_hi);
    const int64_t outputs = out_shape[2 + i];
    if (span.in_hi == span.in_lo || outputs == 0) {
      piece.empty = true;
      continue;
    }
    piece.reached.lo[2 + i] = std::max<int64_t>(0, -span.pad_lo);
    piece.reached.hi[2 + i] = outputs - std::max<int64_t>(0, -span.pad_hi);
    piece.geometry.pad_lo[i] = std::max<int64_t>(0, span.pad_lo);
    piece.geometry.pad_hi[i] = std::max<int64_t>(0, span.pad_hi);
  }
  return piece;
}

/// piece_conv of a kernel call.
PieceConv piece_conv(const KernelContext& context) {
  return piece_conv(context.attrs, context.input_specs[0].global_shape,
                    context.input_specs[1].global_shape, context.input_boxes[0],
                    context.output_boxes[0]);
}

/// y[n, c, ...] += bias[c] on y's device (the bias read with stride 0 along every other dim).
void add_channel_bias(Tensor& y, const Tensor& bias) {
  if (y.numel() == 0) return;
  const Tensor values = bias.contiguous();
  std::vector<int64_t> strides(y.ndim(), 0);
  strides[1] = 1;
  const StridedRef source{values.raw_data(), y.shape().data(), strides.data(), y.ndim()};
  backend_for(y.device())
      .accumulate(strided_ref(y), source, y.dtype(), ReduceOp::sum, compute_stream_for(y.device()));
}

/// The local kernel of both devices (cpu: reference or oneDNN; cuda: cuDNN on the compute stream).
std::vector<Tensor> conv_transpose_local(const KernelContext& context,
                                         const std::vector<Tensor>& inputs) {
  const PieceConv piece = piece_conv(context);
  const Tensor& x = inputs[0];
  const Shape y_shape = context.output_boxes[0].shape();
  Tensor y;
  if (piece.empty || x.numel() == 0 || shape_numel(y_shape) == 0) {
    y = Tensor::zeros(y_shape, x.dtype(), x.device());
  } else if (piece.reached.shape() == y_shape) {
    y = conv_backward_data(x, inputs[1], y_shape, piece.geometry);
  } else {
    y = Tensor::zeros(y_shape, x.dtype(), x.device());
    y.view_box(piece.reached)
        .copy_from(conv_backward_data(x, inputs[1], piece.reached.shape(), piece.geometry));
  }
  if (inputs.size() == 3) add_channel_bias(y, inputs[2]);
  return {y};
}

std::vector<std::optional<ShardTensor>> conv_transpose_backward(
    const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads) {
  const ShardTensor& x = record.inputs[0];
  const ShardTensor& w = record.inputs[1];
  const ShardSpec& y = record.outputs[0].spec();
  const PieceConv piece = piece_conv(record.attrs, x.global_shape(), w.global_shape(),
                                     record.plans[0]->needed_box(), record.outputs[0].local_box());
  // The gradient of a Partial(sum) y (channel-parallel) is the same on every rank of the sum.
  const ShardSpec g_spec = without_partial(y);
  const ShardTensor g = grads[0]->spec() == g_spec
                            ? *grads[0]
                            : grads[0]->redistribute(g_spec.placements, g_spec.extents);
  const Tensor& x_haloed = record.kernel_inputs[0];
  const Tensor g_local = g.to_local();
  const Tensor w_local = w.to_local();
  Tensor dx_haloed, dw;
  if (piece.empty || x_haloed.numel() == 0 || g_local.numel() == 0) {
    dx_haloed = Tensor::zeros(x_haloed.shape(), x_haloed.dtype(), x_haloed.device());
    dw = Tensor::zeros(w_local.shape(), w_local.dtype(), w_local.device());
  } else {
    // The outputs no input reaches carry no gradient back.
    const Tensor g_reached = g_local.view_box(piece.reached).contiguous();
    dx_haloed = conv_forward(g_reached, w_local, nullptr, piece.geometry);
    dw = conv_backward_weight(g_reached, x_haloed, w_local.shape(), piece.geometry);
  }
  // dx: gradient of the haloed piece, its halo cells sent back to their owners and added;
  // Partial(sum) over the filter-parallel mesh dims (each rank's share of the out channels).
  const Tensor dx = halo_adjoint(*record.plans[0], dx_haloed, x.mesh().comm());
  std::vector<Placement> dx_placements = x.spec().placements;
  std::vector<std::vector<int64_t>> dx_extents = x.spec().extents;
  for (size_t m = 0; m < dx_placements.size(); ++m)
    if (w.placements()[m].is_shard() && w.placements()[m].dim == 1) {
      dx_placements[m] = Placement::partial(ReduceOp::sum);
      dx_extents[m].clear();
    }
  std::vector<std::optional<ShardTensor>> result;
  result.emplace_back(ShardTensor(
      dx, x.mesh(),
      ShardSpec::make(x.global_shape(), x.spec().mesh_shape, dx_placements, dx_extents)));
  // dw, db: local sums over this rank's outputs; w's (b's) Shard kept, partial along the other
  // mesh dims that shard x.
  result.emplace_back(ShardTensor(dw, w.mesh(), param_grad_layout(x.spec(), w.spec())));
  // conv_backward_bias reads any strides itself (the cuda reduction, the cpu copy): no copy here.
  if (record.inputs.size() == 3)
    result.emplace_back(ShardTensor(conv_backward_bias(g_local), w.mesh(),
                                    param_grad_layout(x.spec(), record.inputs[2].spec())));
  return result;
}

}  // namespace

int64_t conv_transpose_extent(int64_t length, int64_t kernel, int64_t stride, int64_t padding,
                              int64_t dilation, int64_t output_padding) {
  const int64_t grown = checked_mul(length - 1, stride, kOp, "(input extent - 1) x stride");
  const int64_t taps = checked_mul(dilation, kernel - 1, kOp, "dilation x (kernel extent - 1)");
  return checked_add(checked_add(grown, taps, kOp, "output extent"), output_padding + 1, kOp,
                     "output extent") -
         2 * padding;
}

ConvTransposeSpan conv_transpose_span(int64_t length, int64_t kernel, int64_t stride,
                                      int64_t padding, int64_t dilation, int64_t out_lo,
                                      int64_t out_hi) {
  ConvTransposeSpan span;
  const int64_t reach = dilation * (kernel - 1);
  if (out_hi <= out_lo) {  // no outputs: no inputs (an empty range where the outputs would start)
    span.in_lo = span.in_hi = std::clamp<int64_t>(floor_div(out_lo + padding, stride), 0, length);
    return span;
  }
  span.in_lo = std::clamp<int64_t>(ceil_div(out_lo + padding - reach, stride), 0, length);
  span.in_hi = std::clamp<int64_t>(floor_div(out_hi - 1 + padding, stride) + 1, span.in_lo, length);
  if (span.in_hi == span.in_lo) return span;  // no input lands in the outputs
  // Local output t is uncropped position t + out_lo + p; input in_lo + q starts at
  // (in_lo + q)*s. The conv's input (the outputs) starts pad_lo before the first tap of in_lo and
  // ends pad_hi past the outputs at the last tap of in_hi - 1.
  span.pad_lo = out_lo + padding - span.in_lo * stride;
  span.pad_hi = (span.in_hi - 1) * stride + reach + 1 - (out_hi + padding);
  return span;
}

void register_conv_transpose_op() {
  const auto per_dim = [](const char* name, int64_t value, const char* doc) {
    return OpAttr{.name = name,
                  .type = AttrType::int_list,
                  .default_value = std::vector<int64_t>{value},
                  .doc = doc};
  };
  register_op(OpDef{
      .name = kOp,
      .summary = "conv_transpose1d/2d/3d (by the rank of x) of x [N, Cin, spatial..] with w [Cin, "
                 "Cout/groups, k..] (+ b [Cout])",
      .inputs = {{.name = "x"}, {.name = "w"}, {.name = "b", .optional = true}},
      .outputs = {"y"},
      .attrs = {per_dim("stride", 1, "per spatial dim, or one for all"),
                per_dim("padding", 0, "cut from both ends of each spatial dim, or one for all"),
                per_dim("output_padding", 0,
                        "added after each spatial dim (< max(stride, dilation)), or one for all"),
                per_dim("dilation", 1, "per spatial dim, or one for all"),
                {.name = "groups",
                 .type = AttrType::int_scalar,
                 .default_value = int64_t{1},
                 .doc = "channel groups"}},
      .rule = conv_transpose_rule,
      .cpu = conv_transpose_local,
      .cuda = conv_transpose_local,
      .backward = conv_transpose_backward,
      .cost = conv_transpose_cost});
}

ShardTensor conv_transpose(const ShardTensor& x, const ShardTensor& w,
                           const std::optional<ShardTensor>& b,
                           const ConvTransposeOptions& options) {
  OpAttrs attrs;
  attrs.set("stride", options.stride)
      .set("padding", options.padding)
      .set("output_padding", options.output_padding)
      .set("dilation", options.dilation)
      .set("groups", options.groups);
  std::vector<ShardTensor> inputs{x, w};
  if (b) inputs.push_back(*b);
  return apply_op(kOp, inputs, attrs)[0];
}

}  // namespace tessera::ops
