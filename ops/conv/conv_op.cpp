// The sharded convolution: rule (output ownership, halo), kernel call and backward.
//
// Along a spatial dim with input extent L, kernel K, stride s, dilation d and padding (lo, hi),
// output o reads input indices o*s - lo + j*d, j < K. Output o is owned by the rank that owns
// input clamp(o*s, 0, L-1); a rank owning outputs [a, b) reads the window [a*s - lo,
// (b-1)*s - lo + d*(K-1) + 1). With circular padding the halo plan fills all of it (wrapping
// past the global edges). With zero padding the window is cut to [0, L): the halo plan fills
// the part inside the tensor and the part outside stays virtual, handed to the local kernel as
// its padding (oneDNN and cuDNN take it without the zeros ever being written; one rank copies
// nothing at all). So sharded and unsharded calls run the same code. The same kernels serve cpu and
// cuda tensors (conv_kernels.hpp dispatches on the device: reference/oneDNN or cuDNN).
//
// Tensor parallelism (groups 1): w sharded over a mesh dim splits the channels there, composed
// with any spatial or batch sharding of x on the other mesh dims. Filter-parallel, w Shard(0)
// (Cout split): x is replicated there, y is Shard(1) with w's extents, b is split like w; dx is
// Partial(sum) there. Channel-parallel, w Shard(1) (Cin split): x is Shard(1) with w's extents, y
// is Partial(sum) (each rank's share of the channel sum; a bias would be counted once per rank,
// so it is refused: add it after the reduction); the gradient of y arrives replicated there. dw
// (db) keeps w's (b's) Shard and is Partial(sum) over the other mesh dims that shard x.
#include "ops/conv/conv_op.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/checked_math.hpp"
#include "core/halo/halo_exchange.hpp"
#include "core/op_registry.hpp"
#include "ops/conv/conv_kernels.hpp"
#include "ops/op_costs.hpp"
#include "ops/op_helpers.hpp"

namespace tessera::ops {

namespace {

/// Per-spatial-dim geometry resolved from the attrs.
struct ConvDims {
  int spatial = 0;
  std::vector<int64_t> stride, dilation, pad_lo, pad_hi, kernel, input, output;
  int64_t groups = 1;
  bool circular = false;
};

ConvDims resolve(const Shape& x, const Shape& w, const OpAttrs& attrs) {
  ConvDims dims;
  check_arg(x.size() >= 3 && x.size() <= 5, "conv",
            "expected a 3-d, 4-d or 5-d input [N, C, spatial..], got shape {}", x);
  dims.spatial = static_cast<int>(x.size()) - 2;
  check_arg(w.size() == x.size(), "conv",
            "weight of shape {} for an input of shape {} (conv{}d needs a {}-d weight)", w, x,
            dims.spatial, x.size());
  dims.groups = attrs.get_int("groups", 1);
  check_arg(dims.groups >= 1 && x[1] % dims.groups == 0 && w[0] % dims.groups == 0, "conv",
            "channels {} (input) and {} (output) must be divisible by groups {}", x[1], w[0],
            dims.groups);
  check_arg(w[1] * dims.groups == x[1], "conv",
            "weight expects {} input channels per group ({} in all), the input has {}", w[1],
            w[1] * dims.groups, x[1]);
  dims.circular = attrs.get_string("padding_mode", "zeros") == "circular";
  auto per_dim = [&](const char* name, int64_t fallback) {
    std::vector<int64_t> values =
        attrs.has(name) ? attrs.get_ints(name) : std::vector<int64_t>{fallback};
    if (values.size() == 1) values.assign(dims.spatial, values[0]);
    check_arg(static_cast<int>(values.size()) == dims.spatial, "conv", "{} {} for conv{}d", name,
              values, dims.spatial);
    return values;
  };
  dims.stride = per_dim("stride", 1);
  dims.dilation = per_dim("dilation", 1);
  dims.pad_lo = per_dim("pad_lo", 0);
  dims.pad_hi = per_dim("pad_hi", 0);
  for (int i = 0; i < dims.spatial; ++i) {
    check_arg(
        dims.stride[i] >= 1 && dims.dilation[i] >= 1 && dims.pad_lo[i] >= 0 && dims.pad_hi[i] >= 0,
        "conv", "stride {}, dilation {} and padding ({}, {}) must be positive / non-negative",
        dims.stride, dims.dilation, dims.pad_lo, dims.pad_hi);
    const int64_t length = x[2 + i], kernel = w[2 + i];
    const int64_t span = checked_add(checked_mul(dims.dilation[i], std::max<int64_t>(kernel - 1, 0),
                                                 "conv", "dilation x (kernel extent - 1)"),
                                     1, "conv", "dilated kernel extent");
    const int64_t padded = checked_add(checked_add(length, dims.pad_lo[i], "conv", "padded extent"),
                                       dims.pad_hi[i], "conv", "padded extent");
    check_arg(span <= padded, "conv",
              "kernel extent {} (dilation {}) is larger than the padded input extent {} along "
              "spatial dim {}",
              kernel, dims.dilation[i], padded, i);
    check_arg(!dims.circular || (dims.pad_lo[i] <= length && dims.pad_hi[i] <= length), "conv",
              "circular padding ({}, {}) larger than the input extent {} along spatial dim {}",
              dims.pad_lo[i], dims.pad_hi[i], length, i);
    dims.kernel.push_back(kernel);
    dims.input.push_back(length);
    dims.output.push_back((padded - span) / dims.stride[i] + 1);
  }
  return dims;
}

/// A window [lo, hi) of input indices cut to [0, extent): the part inside and the zero padding
/// the cut-off parts become. A window wholly outside keeps nothing (an empty range) and is all
/// padding.
struct ClippedWindow {
  int64_t lo = 0, hi = 0;          // the part inside [0, extent)
  int64_t pad_lo = 0, pad_hi = 0;  // padding before and after it
};

ClippedWindow clip_window(int64_t lo, int64_t hi, int64_t extent) {
  ClippedWindow window;
  window.lo = std::clamp<int64_t>(lo, 0, extent);
  window.hi = std::clamp<int64_t>(hi, window.lo, extent);
  if (hi <= lo) {  // no output reads anything: an empty range, no padding
    window.hi = window.lo;
    return window;
  }
  if (window.lo == window.hi) {  // wholly outside: all padding
    window.pad_hi = hi - lo;
    return window;
  }
  window.pad_lo = window.lo - lo;
  window.pad_hi = hi - window.hi;
  return window;
}

/// The input window [lo, hi) that outputs [first, last) read along spatial dim i (unclipped).
std::pair<int64_t, int64_t> input_window(const ConvDims& dims, int i, int64_t first, int64_t last) {
  const int64_t lo = first * dims.stride[i] - dims.pad_lo[i];
  const int64_t hi = last > first ? (last - 1) * dims.stride[i] - dims.pad_lo[i] +
                                        dims.dilation[i] * (dims.kernel[i] - 1) + 1
                                  : lo;
  return {lo, hi};
}

/// How conv's w is split over one mesh dim (tensor parallelism; groups 1 only, grouped weights
/// replicate).
enum class ConvParallel { none, filter, channel };

/// Shard(0) of w over mesh dim m: filter-parallel; Shard(1): channel-parallel.
ConvParallel conv_parallel_kind(const ShardSpec& w, size_t m, int64_t groups) {
  const Placement& p = w.placements[m];
  if (groups != 1 || !p.is_shard() || p.dim > 1) return ConvParallel::none;
  return p.dim == 0 ? ConvParallel::filter : ConvParallel::channel;
}

OpRule conv_rule(const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
  check_arg(inputs.size() == 2 || inputs.size() == 3, "conv", "expects inputs x, w[, b], got {}",
            inputs.size());
  const ShardSpec& x_given = inputs[0];
  const ConvDims dims = resolve(x_given.global_shape, inputs[1].global_shape, attrs);
  if (inputs.size() == 3)
    check_arg(inputs[2].global_shape == Shape{inputs[1].global_shape[0]}, "conv",
              "bias of shape {}, expected [{}]", inputs[2].global_shape, inputs[1].global_shape[0]);
  // x: channels whole (but over channel-parallel mesh dims), no pending partial sums; w and b
  // replicated but over the tensor-parallel mesh dims.
  const ShardSpec& w_given = inputs[1];
  const size_t mesh_dims = x_given.mesh_shape.size();
  ShardSpec x = without_partial(x_given);
  std::vector<Placement> w_placements(mesh_dims, Placement::replicate());
  std::vector<Placement> b_placements(mesh_dims, Placement::replicate());
  std::vector<std::vector<int64_t>> w_extents(mesh_dims), b_extents(mesh_dims);
  std::vector<Placement> y_placements(mesh_dims, Placement::replicate());
  std::vector<std::vector<int64_t>> out_extents(mesh_dims);
  for (size_t m = 0; m < mesh_dims; ++m) {
    const ConvParallel kind = conv_parallel_kind(w_given, m, dims.groups);
    if (kind == ConvParallel::none && x.placements[m].is_shard() && x.placements[m].dim == 1) {
      x.placements[m] = Placement::replicate();
      x.extents[m].clear();
    } else if (kind == ConvParallel::filter) {
      x.placements[m] = Placement::replicate();
      x.extents[m].clear();
      w_placements[m] = b_placements[m] = Placement::shard(0);
      w_extents[m] = b_extents[m] = w_given.extents[m];
      y_placements[m] = Placement::shard(1);
      out_extents[m] = w_given.extents[m];
    } else if (kind == ConvParallel::channel) {
      check_arg(inputs.size() == 2, "conv",
                "w is sharded on its input channels (channel-parallel) over mesh dim {}: a bias "
                "would be added once per rank of the sum; add it after the reduction",
                m);
      x.placements[m] = Placement::shard(1);
      x.extents[m] = w_given.extents[m];
      w_placements[m] = Placement::shard(1);
      w_extents[m] = w_given.extents[m];
      y_placements[m] = Placement::partial(ReduceOp::sum);
    }
  }
  x = ShardSpec::make(x.global_shape, x.mesh_shape, x.placements, x.extents, "conv");
  OpRule rule;
  rule.inputs.push_back(x);
  rule.inputs.push_back(
      ShardSpec::make(w_given.global_shape, x.mesh_shape, w_placements, w_extents, "conv"));
  if (inputs.size() == 3)
    rule.inputs.push_back(
        ShardSpec::make(inputs[2].global_shape, x.mesh_shape, b_placements, b_extents, "conv"));

  Shape out_shape{x.global_shape[0], inputs[1].global_shape[0]};
  for (int i = 0; i < dims.spatial; ++i) out_shape.push_back(dims.output[i]);
  for (size_t m = 0; m < mesh_dims; ++m) {
    if (!x.placements[m].is_shard() || x.placements[m].dim == 1) continue;
    const int dim = x.placements[m].dim;
    y_placements[m] = x.placements[m];
    out_extents[m] = dim == 0 ? x.extents[m]
                              : strided_output_extents(x.extents[m], dims.input[dim - 2],
                                                       dims.output[dim - 2], dims.stride[dim - 2]);
  }
  const ShardSpec y = ShardSpec::make(out_shape, x.mesh_shape, y_placements, out_extents, "conv");
  rule.outputs.push_back(y);

  // Halo of x: every rank's outputs, mapped back to the input range they read (cut to the
  // tensor with zero padding: the rest is the kernel's padding).
  HaloNeed need;
  need.boundary.assign(x.global_shape.size(), BoundaryMode::zero);
  for (int i = 0; i < dims.spatial; ++i)
    need.boundary[2 + i] = dims.circular ? BoundaryMode::periodic : BoundaryMode::zero;
  for (int rank = 0; rank < mesh_size(x.mesh_shape); ++rank) {
    Box box = x.local_box_of_rank(rank);
    const Box out_box = y.local_box_of_rank(rank);
    for (int i = 0; i < dims.spatial; ++i) {
      auto [lo, hi] = input_window(dims, i, out_box.lo[2 + i], out_box.hi[2 + i]);
      if (!dims.circular) {
        const ClippedWindow clipped = clip_window(lo, hi, dims.input[i]);
        lo = clipped.lo;
        hi = clipped.hi;
      }
      box.lo[2 + i] = lo;
      box.hi[2 + i] = hi;
    }
    need.needed.push_back(box);
  }
  rule.halos.push_back(need);
  for (size_t i = 1; i < inputs.size(); ++i) rule.halos.push_back(std::nullopt);
  return rule;
}

/// The local conv of the haloed piece (global box `haloed`) computing the outputs `out` (global
/// box): stride, dilation, groups, and the zero padding the rule cut off the piece's window.
ConvGeometry local_geometry(const OpAttrs& attrs, const Shape& x, const Shape& w, const Box& haloed,
                            const Box& out) {
  const ConvDims dims = resolve(x, w, attrs);
  ConvGeometry geometry{dims.stride, dims.dilation, dims.groups, {}, {}};
  if (dims.circular) return geometry;
  geometry.pad_lo.assign(dims.spatial, 0);
  geometry.pad_hi.assign(dims.spatial, 0);
  for (int i = 0; i < dims.spatial; ++i) {
    const auto [lo, hi] = input_window(dims, i, out.lo[2 + i], out.hi[2 + i]);
    const ClippedWindow clipped = clip_window(lo, hi, dims.input[i]);
    check_arg(clipped.lo == haloed.lo[2 + i] && clipped.hi == haloed.hi[2 + i], "conv",
              "haloed input [{}, {}) along spatial dim {}, the rule needs [{}, {})",
              haloed.lo[2 + i], haloed.hi[2 + i], i, clipped.lo, clipped.hi);
    geometry.pad_lo[i] = clipped.pad_lo;
    geometry.pad_hi[i] = clipped.pad_hi;
  }
  return geometry;
}

/// local_geometry of a kernel call.
ConvGeometry local_geometry(const KernelContext& context) {
  return local_geometry(context.attrs, context.input_specs[0].global_shape,
                        context.input_specs[1].global_shape, context.input_boxes[0],
                        context.output_boxes[0]);
}

/// The local kernel of both devices (cpu: reference or oneDNN; cuda: cuDNN on the compute stream).
std::vector<Tensor> conv_local(const KernelContext& context, const std::vector<Tensor>& inputs) {
  const ConvGeometry geometry = local_geometry(context);
  const Tensor* bias = inputs.size() == 3 ? &inputs[2] : nullptr;
  return {conv_forward(inputs[0], inputs[1], bias, geometry)};
}

// ---- overlap of the forward with the halo exchange ----
//
// In the haloed input (global box H = context.input_boxes[0], with local padding p before it)
// output j (local index along a spatial dim) reads input H.lo - p + j*s .. H.lo - p + j*s +
// (k-1)*d. Outputs whose whole window lies in the rank's owned box W are "interior": computable
// before any halo cell has landed. The rest of the output box is covered by at most two slabs
// per spatial dim, computed afterwards (each with the part of the padding its windows reach).
// On cuda every region is a strided view of the haloed input and of the output, which cuDNN
// reads and writes in place, queued on the compute stream (the interior while the halos travel
// on the comm stream); on cpu each region is copied out and back.

/// The interior outputs, as a box in local output coordinates (possibly empty).
Box interior_outputs(const KernelContext& context, const ConvGeometry& geometry,
                     const Shape& w_shape) {
  const Box& haloed = context.input_boxes[0];
  const Box& owned = context.owned_boxes[0];
  const Shape out = context.output_boxes[0].shape();
  Box interior{Shape(out.size(), 0), out};
  for (size_t i = 0; i + 2 < out.size(); ++i) {
    const size_t dim = i + 2;
    const int64_t stride = geometry.stride[i];
    const int64_t reach = geometry.dilation[i] * (w_shape[dim] - 1);
    const int64_t pad = geometry.pad_lo.empty() ? 0 : geometry.pad_lo[i];
    // In window-start coordinates (output j starts at j*s): the first owned input, and one past
    // the last start whose window ends inside the owned box.
    const int64_t first = owned.lo[dim] - haloed.lo[dim] + pad;
    const int64_t last = owned.hi[dim] - haloed.lo[dim] + pad - reach;
    interior.lo[dim] =
        std::clamp<int64_t>(first <= 0 ? 0 : (first + stride - 1) / stride, 0, out[dim]);
    interior.hi[dim] =
        std::clamp<int64_t>(last <= 0 ? 0 : (last - 1) / stride + 1, interior.lo[dim], out[dim]);
  }
  return interior;
}

/// Computes the outputs in `region` (local output coordinates) into `y`, from the haloed piece
/// `x` conv'd with `geometry` (its local padding): the region's window of x, with the part of
/// the padding that window reaches.
void conv_region(const Tensor& x, const Tensor& w, const Tensor* bias, const ConvGeometry& geometry,
                 const Box& region, Tensor& y) {
  if (region.empty()) return;
  Box input{Shape(x.ndim(), 0), x.shape()};
  input.lo[0] = region.lo[0];
  input.hi[0] = region.hi[0];
  ConvGeometry region_geometry = geometry;
  for (size_t i = 0; i + 2 < region.lo.size(); ++i) {
    const size_t dim = i + 2;
    const int64_t pad = geometry.pad_lo.empty() ? 0 : geometry.pad_lo[i];
    const int64_t lo = region.lo[dim] * geometry.stride[i] - pad;
    const int64_t hi = (region.hi[dim] - 1) * geometry.stride[i] - pad +
                       geometry.dilation[i] * (w.shape(static_cast<int>(dim)) - 1) + 1;
    const ClippedWindow clipped = clip_window(lo, hi, x.shape(static_cast<int>(dim)));
    input.lo[dim] = clipped.lo;
    input.hi[dim] = clipped.hi;
    if (!region_geometry.pad_lo.empty()) {
      region_geometry.pad_lo[i] = clipped.pad_lo;
      region_geometry.pad_hi[i] = clipped.pad_hi;
    }
  }
  Tensor y_region = y.view_box(region);
  conv_forward_into(x.view_box(input), w, bias, region_geometry, y_region);
}

std::vector<Tensor> conv_interior(const KernelContext& context, const std::vector<Tensor>& inputs) {
  const ConvGeometry geometry = local_geometry(context);
  const Tensor* bias = inputs.size() == 3 ? &inputs[2] : nullptr;
  Tensor y = Tensor::empty(context.output_boxes[0].shape(), inputs[0].dtype(), inputs[0].device());
  conv_region(inputs[0], inputs[1], bias, geometry,
              interior_outputs(context, geometry, inputs[1].shape()), y);
  return {y};
}

void conv_boundary(const KernelContext& context, const std::vector<Tensor>& inputs,
                   std::vector<Tensor>& outputs) {
  const ConvGeometry geometry = local_geometry(context);
  const Tensor* bias = inputs.size() == 3 ? &inputs[2] : nullptr;
  const Shape out = context.output_boxes[0].shape();
  const Box whole{Shape(out.size(), 0), out};
  for (const Box& piece :
       boxes_around(whole, interior_outputs(context, geometry, inputs[1].shape()), 2, out.size()))
    conv_region(inputs[0], inputs[1], bias, geometry, piece, outputs[0]);
}

std::vector<std::optional<ShardTensor>> conv_backward(
    const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads) {
  const ShardTensor& x = record.inputs[0];
  const ShardTensor& w = record.inputs[1];
  const ShardSpec& y = record.outputs[0].spec();
  const ConvGeometry geometry =
      local_geometry(record.attrs, x.global_shape(), w.global_shape(),
                     record.plans[0]->needed_box(), record.outputs[0].local_box());
  // The gradient of a Partial(sum) y (channel-parallel) is the same on every rank of the sum.
  const ShardSpec g_spec = without_partial(y);
  const ShardTensor g = grads[0]->spec() == g_spec
                            ? *grads[0]
                            : grads[0]->redistribute(g_spec.placements, g_spec.extents);
  const Tensor& x_haloed = record.kernel_inputs[0];
  const Tensor g_local = g.to_local().contiguous();
  // dx: gradient of the haloed piece, its halo cells sent back to their owners and added;
  // Partial(sum) over the filter-parallel mesh dims (each rank's share of the out channels).
  const Tensor dx_haloed = conv_backward_data(g_local, w.to_local(), x_haloed.shape(), geometry);
  const Tensor dx = halo_adjoint(*record.plans[0], dx_haloed, x.mesh().comm());
  std::vector<Placement> dx_placements = x.spec().placements;
  std::vector<std::vector<int64_t>> dx_extents = x.spec().extents;
  for (size_t m = 0; m < dx_placements.size(); ++m)
    if (w.placements()[m].is_shard() && w.placements()[m].dim == 0) {
      dx_placements[m] = Placement::partial(ReduceOp::sum);
      dx_extents[m].clear();
    }
  std::vector<std::optional<ShardTensor>> result;
  result.emplace_back(ShardTensor(
      dx, x.mesh(),
      ShardSpec::make(x.global_shape(), x.spec().mesh_shape, dx_placements, dx_extents)));
  // dw, db: local sums over this rank's outputs; partial along the mesh dims that shard x.
  result.emplace_back(
      ShardTensor(conv_backward_weight(x_haloed, g_local, w.to_local().shape(), geometry), w.mesh(),
                  param_grad_layout(x.spec(), w.spec())));
  if (record.inputs.size() == 3)
    result.emplace_back(ShardTensor(conv_backward_bias(g_local), w.mesh(),
                                    param_grad_layout(x.spec(), record.inputs[2].spec())));
  return result;
}

}  // namespace

void register_conv_transpose_op();  // conv_transpose.cpp

void register_conv_ops() {
  const OverlapKernel overlap{conv_interior, conv_boundary};
  const auto per_dim = [](const char* name, int64_t value, const char* doc) {
    return OpAttr{.name = name,
                  .type = AttrType::int_list,
                  .default_value = std::vector<int64_t>{value},
                  .doc = doc};
  };
  register_op(OpDef{
      .name = "conv",
      .summary = "conv1d/2d/3d (by the rank of x) of x [N, C, spatial..] with w [Cout, C/groups, "
                 "k..] (+ b [Cout])",
      .inputs = {{.name = "x"}, {.name = "w"}, {.name = "b", .optional = true}},
      .outputs = {"y"},
      .attrs = {per_dim("stride", 1, "per spatial dim, or one for all"),
                per_dim("dilation", 1, "per spatial dim, or one for all"),
                per_dim("pad_lo", 0, "padding before each spatial dim, or one for all"),
                per_dim("pad_hi", 0, "padding after each spatial dim, or one for all"),
                {.name = "groups",
                 .type = AttrType::int_scalar,
                 .default_value = int64_t{1},
                 .doc = "channel groups"},
                {.name = "padding_mode",
                 .type = AttrType::string,
                 .default_value = std::string("zeros"),
                 .doc = "zeros or circular"}},
      .rule = conv_rule,
      .cpu = conv_local,
      .cuda = conv_local,
      .backward = conv_backward,
      .cpu_overlap = overlap,
      .cuda_overlap = overlap,
      .cost = conv_cost});
  register_conv_transpose_op();
}

ShardTensor conv(const ShardTensor& x, const ShardTensor& w, const std::optional<ShardTensor>& b,
                 const ConvOptions& options) {
  const int spatial =
      x.spec().global_shape.size() >= 3 ? static_cast<int>(x.global_shape().size()) - 2 : 1;
  auto per_dim = [&](std::vector<int64_t> values) {
    if (values.size() == 1) values.assign(spatial, values[0]);
    return values;
  };
  std::vector<int64_t> stride = per_dim(options.stride), dilation = per_dim(options.dilation);
  std::vector<int64_t> lo = per_dim(options.padding);
  std::vector<int64_t> hi = options.padding_hi.empty() ? lo : per_dim(options.padding_hi);
  if (options.padding_name == "valid") {
    lo.assign(spatial, 0);
    hi.assign(spatial, 0);
  } else if (options.padding_name == "same") {
    for (int i = 0; i < spatial && i + 2 < static_cast<int>(w.global_shape().size()); ++i) {
      check_arg(stride[i] == 1, "conv", "padding 'same' needs stride 1, got stride {}", stride);
      const int64_t total =
          checked_mul(dilation[i], std::max<int64_t>(w.global_shape()[2 + i] - 1, 0), "conv",
                      "dilation x (kernel extent - 1)");
      lo[i] = total / 2;
      hi[i] = total - lo[i];
    }
  } else {
    check_arg(options.padding_name.empty(), "conv",
              "padding '{}' (expected same, valid or explicit sizes)", options.padding_name);
  }
  check_arg(options.padding_mode == "zeros" || options.padding_mode == "circular", "conv",
            "padding mode '{}' (expected zeros or circular)", options.padding_mode);
  OpAttrs attrs;
  attrs.set("stride", stride).set("dilation", dilation).set("pad_lo", lo).set("pad_hi", hi);
  attrs.set("groups", options.groups).set("padding_mode", options.padding_mode);
  std::vector<ShardTensor> inputs{x, w};
  if (b) inputs.push_back(*b);
  return apply_op("conv", inputs, attrs)[0];
}

}  // namespace tessera::ops
