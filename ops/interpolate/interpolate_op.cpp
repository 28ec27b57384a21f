// The sharded op interpolate: attributes, rule (output ownership, halo), kernels and backward.
//
// Along a spatial dim with input extent L, output o reads source cells i0(o) and i1(o) (i1 =
// i0 + 1 clamped, linear modes only; interpolate_taps.hpp has PyTorch's rules). Both are
// non-decreasing in o, so output o is owned by the rank owning input i0(o) (the convention of
// conv and pooling, with i0 in place of o*stride), and a rank owning outputs [a, b) needs inputs
// [i0(a), i1(b-1) + 1), which the halo plan fills (no halo at all when that is every rank's own
// piece). Sources never lie outside the tensor, so there is no padding. The kernels are told the
// global boxes of their haloed piece and output, so one kernel serves sharded and unsharded
// calls. The channel and batch dims may stay sharded: every (n, c) plane is interpolated alone.
#include "ops/interpolate/interpolate_op.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/halo/halo_exchange.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/interpolate/interpolate_cpu.hpp"
#include "ops/interpolate/interpolate_cuda.hpp"
#include "ops/op_helpers.hpp"

namespace tessera::ops {

namespace {

using kernels::InterpMode;
using kernels::InterpPlan;

constexpr const char* kOp = "interpolate";

/// Per-spatial-dim geometry resolved from the attrs.
struct InterpDims {
  int spatial = 0;
  InterpMode mode = InterpMode::nearest;
  bool align_corners = false;
  std::vector<int64_t> input, output;
  std::vector<double> scale;  ///< source cells per output cell
};

InterpDims resolve(const Shape& x, const OpAttrs& attrs) {
  InterpDims dims;
  check_arg(x.size() >= 3 && x.size() <= 5, kOp,
            "expected a 3-d, 4-d or 5-d input [N, C, spatial..], got shape {}", x);
  dims.spatial = static_cast<int>(x.size()) - 2;
  const std::string mode = attrs.get_string("mode", "nearest");
  const char* linear_names[] = {"linear", "bilinear", "trilinear"};
  if (mode == "nearest") {
    dims.mode = InterpMode::nearest;
  } else if (mode == "nearest-exact") {
    dims.mode = InterpMode::nearest_exact;
  } else if (mode == "linear" || mode == "bilinear" || mode == "trilinear") {
    dims.mode = InterpMode::linear;
    check_arg(mode == linear_names[dims.spatial - 1], kOp,
              "attribute 'mode' = '{}' needs a {}-d input, got shape {} ({} spatial dim(s): use "
              "'{}')",
              mode,
              mode == "linear"     ? 3
              : mode == "bilinear" ? 4
                                   : 5,
              x, dims.spatial, linear_names[dims.spatial - 1]);
  } else {
    check_arg(false, kOp,
              "attribute 'mode' = '{}': expected nearest, nearest-exact, linear, bilinear or "
              "trilinear",
              mode);
  }
  if (attrs.has("align_corners")) {
    check_arg(dims.mode == InterpMode::linear, kOp,
              "attribute 'align_corners' is only for the linear modes (linear, bilinear, "
              "trilinear), not mode '{}'",
              mode);
    dims.align_corners = attrs.get_int("align_corners") != 0;
  }
  const bool has_size = attrs.has("size"), has_scale = attrs.has("scale_factor");
  check_arg(has_size != has_scale, kOp,
            "expected exactly one of the attributes 'size' and 'scale_factor', got {}",
            has_size ? "both" : "neither");
  const bool recompute = attrs.get_int("recompute_scale_factor", 0) != 0;
  check_arg(!(recompute && has_size), kOp,
            "attribute 'recompute_scale_factor' is only meaningful with 'scale_factor', not with "
            "an explicit 'size'");
  std::vector<int64_t> sizes;
  std::vector<double> factors;
  if (has_size) {
    sizes = attrs.get_ints("size");
    if (sizes.size() == 1) sizes.assign(dims.spatial, sizes[0]);
    check_arg(static_cast<int>(sizes.size()) == dims.spatial, kOp,
              "attribute 'size' = {}: expected 1 or {} values for input shape {}", sizes,
              dims.spatial, x);
  } else {
    factors = attrs.get_doubles("scale_factor");
    if (factors.size() == 1) factors.assign(dims.spatial, factors[0]);
    check_arg(static_cast<int>(factors.size()) == dims.spatial, kOp,
              "attribute 'scale_factor' = {}: expected 1 or {} values for input shape {}", factors,
              dims.spatial, x);
  }
  for (int i = 0; i < dims.spatial; ++i) {
    const int64_t length = x[2 + i];
    check_arg(length >= 1 && length <= (int64_t{1} << 40), kOp,
              "input of shape {}: spatial extents must be at least 1", x);
    int64_t output = 0;
    if (has_size) {
      output = sizes[i];
      check_arg(output >= 1 && output <= (int64_t{1} << 40), kOp,
                "attribute 'size' = {}: every value must be in [1, 2^40]", sizes);
    } else {
      const double factor = factors[i];
      check_arg(std::isfinite(factor) && factor > 0.0, kOp,
                "attribute 'scale_factor' = {}: every value must be positive and finite", factors);
      const double extent = std::floor(static_cast<double>(length) * factor);
      check_arg(extent >= 1.0 && extent <= static_cast<double>(int64_t{1} << 40), kOp,
                "attribute 'scale_factor' = {} on input of shape {}: output extent {} along "
                "spatial dim {} (must be in [1, 2^40])",
                factors, x, extent, i);
      output = static_cast<int64_t>(extent);
    }
    double scale = 0.0;
    if (dims.mode == InterpMode::linear && dims.align_corners)
      scale = output > 1 ? static_cast<double>(length - 1) / static_cast<double>(output - 1) : 0.0;
    else if (has_scale && !recompute)
      scale = 1.0 / factors[i];
    else
      scale = static_cast<double>(length) / static_cast<double>(output);
    dims.input.push_back(length);
    dims.output.push_back(output);
    dims.scale.push_back(scale);
  }
  return dims;
}

/// The global source cells of output o along spatial dim i.
kernels::InterpTap source_of(const InterpDims& dims, int i, int64_t o) {
  return kernels::interp_source(dims.mode, dims.scale[i], dims.align_corners, dims.input[i], o);
}

OpRule interpolate_rule(const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
  check_arg(inputs.size() == 1, kOp, "expects one input x, got {}", inputs.size());
  const ShardSpec x = without_partial(inputs[0]);
  const InterpDims dims = resolve(x.global_shape, attrs);
  OpRule rule;
  rule.inputs.push_back(x);

  Shape out_shape{x.global_shape[0], x.global_shape[1]};
  for (int i = 0; i < dims.spatial; ++i) out_shape.push_back(dims.output[i]);
  std::vector<std::vector<int64_t>> out_extents(x.mesh_shape.size());
  for (size_t m = 0; m < x.mesh_shape.size(); ++m) {
    if (!x.placements[m].is_shard()) continue;
    const int dim = x.placements[m].dim;
    if (dim < 2) {
      out_extents[m] = x.extents[m];
      continue;
    }
    const int i = dim - 2;
    out_extents[m] = source_output_extents(x.extents[m], dims.input[i], dims.output[i],
                                           [&](int64_t o) { return source_of(dims, i, o).i0; });
  }
  const ShardSpec y = ShardSpec::make(out_shape, x.mesh_shape, x.placements, out_extents, kOp);
  rule.outputs.push_back(y);

  // Halo of x: the source cells of every rank's outputs (always inside the tensor).
  HaloNeed need;
  need.boundary.assign(x.global_shape.size(), BoundaryMode::zero);
  bool own_piece_only = true;
  for (int rank = 0; rank < mesh_size(x.mesh_shape); ++rank) {
    Box box = x.local_box_of_rank(rank);
    const Box out_box = y.local_box_of_rank(rank);
    for (int i = 0; i < dims.spatial; ++i) {
      const int64_t first = out_box.lo[2 + i], last = out_box.hi[2 + i];
      if (last <= first) {
        // No outputs: nothing needed (an empty box at the own piece's start).
        box.hi[2 + i] = box.lo[2 + i];
        continue;
      }
      box.lo[2 + i] = source_of(dims, i, first).i0;
      box.hi[2 + i] = source_of(dims, i, last - 1).i1 + 1;
    }
    own_piece_only = own_piece_only && box == x.local_box_of_rank(rank);
    need.needed.push_back(box);
  }
  rule.halos.push_back(own_piece_only ? std::nullopt : std::optional<HaloNeed>(need));
  return rule;
}

/// The plan of a local piece: the haloed input covers global box `haloed`, the output global box
/// `out`.
InterpPlan plan_of(const OpAttrs& attrs, const Shape& x_shape, const Box& haloed, const Box& out) {
  const InterpDims dims = resolve(x_shape, attrs);
  InterpPlan plan;
  plan.mode = dims.mode;
  plan.planes = (haloed.hi[0] - haloed.lo[0]) * (haloed.hi[1] - haloed.lo[1]);
  for (int i = 0; i < dims.spatial; ++i) {
    kernels::InterpDim& dim = plan.dims[3 - dims.spatial + i];
    dim.in_lo = haloed.lo[2 + i];
    dim.in = haloed.hi[2 + i] - dim.in_lo;
    dim.out_lo = out.lo[2 + i];
    dim.out = out.hi[2 + i] - dim.out_lo;
    dim.length = dims.input[i];
    dim.scale = dims.scale[i];
    dim.align_corners = dims.align_corners;
  }
  return plan;
}

KernelFn forward_kernel() {
  return [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const InterpPlan plan = plan_of(context.attrs, context.input_specs[0].global_shape,
                                    context.input_boxes[0], context.output_boxes[0]);
    const Shape y_shape = context.output_boxes[0].shape();
    const Tensor& x = inputs[0];
    return std::vector<Tensor>{x.device().is_cuda()
                                   ? interpolate_forward_cuda(plan, x, y_shape, context.stream)
                                   : interpolate_forward_cpu(plan, x, y_shape)};
  };
}

BackwardFn backward() {
  return [](const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads) {
    return single_input_halo_backward(
        record, grads, [&](const Tensor& g_local, const Tensor& x_haloed, const Box& box) {
          const InterpPlan plan = plan_of(record.attrs, record.inputs[0].global_shape(), box,
                                          record.outputs[0].local_box());
          return x_haloed.device().is_cuda()
                     ? interpolate_backward_cuda(plan, x_haloed.shape(), g_local,
                                                 compute_stream_for(x_haloed.device()))
                     : interpolate_backward_cpu(plan, x_haloed.shape(), g_local);
        });
  };
}

OpAttrs attrs_of(const InterpolateOptions& options) {
  OpAttrs attrs;
  if (!options.size.empty()) attrs.set("size", options.size);
  if (!options.scale_factor.empty()) attrs.set("scale_factor", options.scale_factor);
  attrs.set("mode", options.mode);
  if (options.align_corners) attrs.set("align_corners", int64_t{*options.align_corners ? 1 : 0});
  attrs.set("recompute_scale_factor", int64_t{options.recompute_scale_factor ? 1 : 0});
  return attrs;
}

}  // namespace

void register_interpolate_ops() {
  register_op(OpDef{
      .name = "interpolate",
      .summary = "torch.nn.functional.interpolate of x [N, C, spatial..] (1/2/3-d by the rank of "
                 "x): nearest, nearest-exact, linear, bilinear, trilinear",
      .inputs = {{.name = "x"}},
      .outputs = {"y"},
      .attrs = {{.name = "size",
                 .type = AttrType::int_list,
                 .doc = "output extents, per spatial dim or one for all; unset: from scale_factor"},
                {.name = "scale_factor",
                 .type = AttrType::float_list,
                 .doc = "output extent floor(input * scale_factor), per spatial dim or one for "
                        "all; unset: size"},
                {.name = "mode",
                 .type = AttrType::string,
                 .default_value = std::string("nearest"),
                 .doc =
                     "nearest | nearest-exact | linear (1-d) | bilinear (2-d) | trilinear (3-d)"},
                {.name = "align_corners",
                 .type = AttrType::boolean,
                 .doc = "linear modes only: align the corner cells; unset: 0"},
                {.name = "recompute_scale_factor",
                 .type = AttrType::boolean,
                 .default_value = int64_t{0},
                 .doc = "with scale_factor: source step input/output instead of 1/scale_factor"}},
      .rule = interpolate_rule,
      .cpu = forward_kernel(),
      .cuda = forward_kernel(),
      .backward = backward()});
}

ShardTensor interpolate(const ShardTensor& x, const InterpolateOptions& options) {
  return apply_op("interpolate", {x}, attrs_of(options))[0];
}

}  // namespace tessera::ops
