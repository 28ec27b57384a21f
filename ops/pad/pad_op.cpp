// The sharded op pad: attributes, rule (output ownership, halo), kernels and backward.
//
// The padded dims are the last len(pad)/2 dims of x (PyTorch's order: the first pair pads the
// last dim). Along a padded dim with input extent L and (lo, hi) added cells (negative: removed
// cells, a crop), output j reads t = j - lo (pad_taps.hpp). Output j is owned by the rank owning
// input clamp(j - lo, 0, L-1): the cells added before the input go to the owner of its first cell,
// those after it to the owner of its last cell, and every other output stays with its input. A rank
// owning outputs [a, b) needs the sources of those outputs: constant: the inside part of [a - lo, b
// - lo); replicate: that range clamped; reflect: the range of the reflected sources (the padding
// mirrors cells next to the edge, which a thin edge shard may not own); circular: [a - lo, b - lo)
// itself, which runs past the tensor and is filled by the halo plan's periodic boundary. The
// kernels are told the global boxes of their haloed piece and output, so one kernel serves sharded
// and unsharded calls.
#include "ops/pad/pad_op.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/halo/halo_exchange.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/op_helpers.hpp"
#include "ops/pad/pad_cpu.hpp"
#include "ops/pad/pad_cuda.hpp"

namespace tessera::ops {

namespace {

using kernels::PadMode;
using kernels::PadPlan;

constexpr const char* kOp = "pad";

/// The resolved attrs: per padded dim (outermost first) its tensor dim, extent and padding.
struct PadDims {
  PadMode mode = PadMode::constant;
  double value = 0.0;
  int first = 0;  ///< the first padded tensor dim
  std::vector<int64_t> input, lo, hi;
};

PadDims resolve(const Shape& x, const OpAttrs& attrs) {
  PadDims dims;
  const std::string mode = attrs.get_string("mode", "constant");
  if (mode == "constant") {
    dims.mode = PadMode::constant;
  } else if (mode == "reflect") {
    dims.mode = PadMode::reflect;
  } else if (mode == "replicate") {
    dims.mode = PadMode::replicate;
  } else if (mode == "circular") {
    dims.mode = PadMode::circular;
  } else {
    check_arg(false, kOp,
              "attribute 'mode' = '{}': expected constant, reflect, replicate or circular", mode);
  }
  dims.value = attrs.has("value") ? attrs.get_double("value") : 0.0;
  check_arg(attrs.has("pad"), kOp, "missing required attribute 'pad'");
  const std::vector<int64_t>& pad = attrs.get_ints("pad");
  const int rank = static_cast<int>(x.size());
  check_arg(!pad.empty() && pad.size() % 2 == 0, kOp,
            "attribute 'pad' = {}: expected (lo, hi) pairs, last dim first", pad);
  const int count = static_cast<int>(pad.size()) / 2;
  // As PyTorch: constant pads any number of dims up to the input's; the others 1, 2 or 3.
  check_arg(dims.mode == PadMode::constant || count <= 3, kOp,
            "attribute 'pad' = {} with mode '{}': expected 1, 2 or 3 (lo, hi) pairs (more only "
            "in mode constant)",
            pad, mode);
  if (dims.mode == PadMode::constant) {
    check_arg(count <= rank, kOp,
              "attribute 'pad' = {}: pads {} dims of an input of shape {} with {} dims", pad, count,
              x, rank);
  } else {
    check_arg(rank == count + 1 || rank == count + 2, kOp,
              "attribute 'pad' = {} with mode '{}': padding {} dim(s) needs a {}-d or {}-d input "
              "(as PyTorch), got shape {}",
              pad, mode, count, count + 1, count + 2, x);
  }
  for (int64_t value : pad)
    check_arg(value >= -(int64_t{1} << 40) && value <= (int64_t{1} << 40), kOp,
              "attribute 'pad' = {}: every value must be in [-2^40, 2^40]", pad);
  dims.first = rank - count;
  for (int i = 0; i < count; ++i) {
    const int dim = dims.first + i;
    const int pair = count - 1 - i;  // pad's first pair is the last dim
    const int64_t lo = pad[2 * pair], hi = pad[2 * pair + 1], length = x[dim];
    check_arg(length >= 1, kOp, "input of shape {}: padded dim {} is empty", x, dim);
    // Negative values crop (PyTorch's F.pad): output j still reads t = j - lo. A padded dim may
    // end empty in constant and circular mode, not in reflect and replicate (as PyTorch).
    const int64_t out = length + lo + hi;
    const int64_t least = dims.mode == PadMode::reflect || dims.mode == PadMode::replicate ? 1 : 0;
    check_arg(out >= least, kOp,
              "attribute 'pad' = {} with mode '{}': padding ({}, {}) of dim {} (extent {}) "
              "leaves {} cells, needs at least {}",
              pad, mode, lo, hi, dim, length, out, least);
    if (dims.mode == PadMode::reflect)
      check_arg(lo < length && hi < length, kOp,
                "attribute 'pad' = {} with mode 'reflect': padding ({}, {}) of dim {} must be "
                "below its extent {}",
                pad, lo, hi, dim, length);
    if (dims.mode == PadMode::circular) {
      check_arg(lo <= length && hi <= length, kOp,
                "attribute 'pad' = {} with mode 'circular': padding ({}, {}) of dim {} must be at "
                "most its extent {}",
                pad, lo, hi, dim, length);
      // PyTorch wraps a dim cropped on one side and padded on the other around the cropped
      // piece in some versions and around the whole input in others: refused rather than guessed.
      check_arg((lo >= 0 && hi >= 0) || (lo <= 0 && hi <= 0), kOp,
                "attribute 'pad' = {} with mode 'circular': dim {} is cropped on one side and "
                "padded on the other ({}, {}); crop and pad it in two calls",
                pad, dim, lo, hi);
    }
    dims.input.push_back(length);
    dims.lo.push_back(lo);
    dims.hi.push_back(hi);
  }
  return dims;
}

/// The source range [lo, hi) that outputs [a, b) of padded dim i read (unwrapped for circular),
/// empty (lo == hi) when they read none.
std::pair<int64_t, int64_t> sources_of(const PadDims& dims, int i, int64_t a, int64_t b) {
  const int64_t length = dims.input[i], lo = dims.lo[i];
  if (b <= a) return {0, 0};
  switch (dims.mode) {
    case PadMode::constant: {
      const int64_t first = std::clamp<int64_t>(a - lo, 0, length);
      return {first, std::clamp<int64_t>(b - lo, first, length)};
    }
    case PadMode::circular: return {a - lo, b - lo};
    default: break;
  }
  // reflect / replicate: the source is monotone between the edges; extremes at the range's ends
  // or at the edges.
  int64_t low = length, high = -1;
  for (int64_t j : {a, b - 1, lo, lo + length - 1}) {
    if (j < a || j >= b) continue;
    const int64_t source = kernels::pad_global_source(dims.mode, lo, length, j);
    low = std::min(low, source);
    high = std::max(high, source);
  }
  return {low, high + 1};
}

OpRule pad_rule(const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
  check_arg(inputs.size() == 1, kOp, "expects one input x, got {}", inputs.size());
  const ShardSpec x = without_partial(inputs[0]);
  const PadDims dims = resolve(x.global_shape, attrs);
  OpRule rule;
  rule.inputs.push_back(x);

  Shape out_shape = x.global_shape;
  for (size_t i = 0; i < dims.input.size(); ++i)
    out_shape[dims.first + i] += dims.lo[i] + dims.hi[i];
  std::vector<std::vector<int64_t>> out_extents(x.mesh_shape.size());
  for (size_t m = 0; m < x.mesh_shape.size(); ++m) {
    if (!x.placements[m].is_shard()) continue;
    const int dim = x.placements[m].dim;
    if (dim < dims.first) {
      out_extents[m] = x.extents[m];
      continue;
    }
    const int i = dim - dims.first;
    const int64_t lo = dims.lo[i];
    out_extents[m] = source_output_extents(x.extents[m], dims.input[i], out_shape[dim],
                                           [lo](int64_t j) { return j - lo; });
  }
  const ShardSpec y = ShardSpec::make(out_shape, x.mesh_shape, x.placements, out_extents, kOp);
  rule.outputs.push_back(y);

  HaloNeed need;
  need.boundary.assign(x.global_shape.size(), dims.mode == PadMode::circular
                                                  ? BoundaryMode::periodic
                                                  : BoundaryMode::zero);
  bool own_piece_only = true;
  for (int rank = 0; rank < mesh_size(x.mesh_shape); ++rank) {
    Box box = x.local_box_of_rank(rank);
    const Box out_box = y.local_box_of_rank(rank);
    for (size_t i = 0; i < dims.input.size(); ++i) {
      const int dim = dims.first + static_cast<int>(i);
      const auto [lo, hi] = sources_of(dims, static_cast<int>(i), out_box.lo[dim], out_box.hi[dim]);
      if (hi <= lo) {
        box.hi[dim] = box.lo[dim];
        continue;
      }
      box.lo[dim] = lo;
      box.hi[dim] = hi;
    }
    own_piece_only = own_piece_only && box == x.local_box_of_rank(rank);
    need.needed.push_back(box);
  }
  rule.halos.push_back(own_piece_only ? std::nullopt : std::optional<HaloNeed>(need));
  return rule;
}

/// One kernel launch of a local pad: its plan and the shapes of the local piece before and after.
struct PadPass {
  PadPlan plan;
  Shape in_shape, out_shape;
};

/// The local pad of a piece whose haloed input covers global box `haloed` and output `out`, as
/// launches of at most three padded dims each (the kernels' limit; only constant mode pads more,
/// and constant padding of one dim never reads another, so the dims may be padded in turns). The
/// first pass pads the last three padded dims; each later one the two padded dims before those
/// already padded, which it folds into one unpadded innermost slot (an identity dim: lo 0, input
/// and output the whole slot).
std::vector<PadPass> passes_of(const OpAttrs& attrs, const Shape& x_shape, const Box& haloed,
                               const Box& out) {
  const PadDims dims = resolve(x_shape, attrs);
  const int count = static_cast<int>(dims.input.size());
  Shape current = haloed.shape();
  std::vector<PadPass> passes;
  for (int done = 0; done < count;) {
    const int group = done == 0 ? std::min(count, 3) : std::min(count - done, 2);
    const int first = dims.first + count - done - group;  // the group's first tensor dim
    PadPass pass;
    pass.in_shape = current;
    PadPlan& plan = pass.plan;
    plan.mode = dims.mode;
    plan.value = dims.value;
    plan.planes = 1;
    for (int d = 0; d < first; ++d) plan.planes *= current[d];
    const int slot0 = done == 0 ? 3 - group : 2 - group;
    for (int g = 0; g < group; ++g) {
      const int dim = first + g, i = dim - dims.first;
      kernels::PadDim& pd = plan.dims[slot0 + g];
      pd.in_lo = haloed.lo[dim];
      pd.in = haloed.hi[dim] - pd.in_lo;
      pd.out_lo = out.lo[dim];
      pd.out = out.hi[dim] - pd.out_lo;
      pd.length = dims.input[i];
      pd.lo = dims.lo[i];
      current[dim] = pd.out;
    }
    if (done > 0) {
      int64_t folded = 1;
      for (size_t d = static_cast<size_t>(first + group); d < current.size(); ++d)
        folded *= current[d];
      plan.dims[2] = {.in = folded, .out = folded, .out_lo = 0, .in_lo = 0, .length = folded};
    }
    pass.out_shape = current;
    passes.push_back(pass);
    done += group;
  }
  return passes;
}

KernelFn forward_kernel() {
  return [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    Tensor y = inputs[0];
    for (const PadPass& pass : passes_of(context.attrs, context.input_specs[0].global_shape,
                                         context.input_boxes[0], context.output_boxes[0]))
      y = y.device().is_cuda() ? pad_forward_cuda(pass.plan, y, pass.out_shape, context.stream)
                               : pad_forward_cpu(pass.plan, y, pass.out_shape);
    return std::vector<Tensor>{y};
  };
}

BackwardFn backward() {
  return [](const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads) {
    return single_input_halo_backward(
        record, grads, [&](const Tensor& g_local, const Tensor& x_haloed, const Box& box) {
          const std::vector<PadPass> passes = passes_of(
              record.attrs, record.inputs[0].global_shape(), box, record.outputs[0].local_box());
          // The adjoint of the passes in reverse order.
          Tensor g = g_local;
          for (auto pass = passes.rbegin(); pass != passes.rend(); ++pass)
            g = x_haloed.device().is_cuda()
                    ? pad_backward_cuda(pass->plan, pass->in_shape, g,
                                        compute_stream_for(x_haloed.device()))
                    : pad_backward_cpu(pass->plan, pass->in_shape, g);
          return g;
        });
  };
}

}  // namespace

void register_pad_ops() {
  register_op(OpDef{
      .name = "pad",
      .summary = "torch.nn.functional.pad of x: constant, reflect, replicate, circular",
      .inputs = {{.name = "x"}},
      .outputs = {"y"},
      .attrs = {{.name = "pad",
                 .type = AttrType::int_list,
                 .required = true,
                 .doc = "(lo, hi) pairs, last dim first (constant: up to x's rank; other modes: "
                        "at most 3); negative values crop"},
                {.name = "mode",
                 .type = AttrType::string,
                 .default_value = std::string("constant"),
                 .doc = "constant | reflect | replicate | circular"},
                {.name = "value",
                 .type = AttrType::float_scalar,
                 .default_value = 0.0,
                 .doc = "the value of constant padding cells"}},
      .rule = pad_rule,
      .cpu = forward_kernel(),
      .cuda = forward_kernel(),
      .backward = backward()});
}

ShardTensor pad(const ShardTensor& x, const PadOptions& options) {
  OpAttrs attrs;
  attrs.set("pad", options.pad).set("mode", options.mode).set("value", options.value);
  return apply_op("pad", {x}, attrs)[0];
}

}  // namespace tessera::ops
