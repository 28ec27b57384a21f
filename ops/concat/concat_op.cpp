// concat and split: rules, kernels, backward and registration.
//
// Along the joined dim a mesh dim shards, the output's extent on rank r is the sum of the
// inputs' extents there (an input sharded another way counts its default split), so every rank
// keeps its share of elements. Input i is moved to the layout whose box on rank r is the part of
// rank r's output box that falls in input i's range [offset_i, offset_i + L_i); each rank then
// joins its pieces in input order, which is exactly its output box. Split is the inverse with
// no movement at all: part k on rank r is the part of r's box of x in part k's range (possibly
// empty). A second mesh dim sharding the same tensor dim replicates instead. concat's kernel
// copies slices (Tensor::copy_from: strided copies on cpu or cuda, large ones on the compute
// threads); split's kernel and concat's backward return views of their input, no copy, as
// torch.split and torch.cat's backward do; split's backward joins the gradients.
#include "ops/concat/concat_op.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "core/autograd.hpp"
#include "core/streaming_stores.hpp"
#include "ops/op_helpers.hpp"

namespace tessera::ops {

namespace {

int resolve_dim(const std::string& op, int64_t dim, size_t ndim) {
  const int64_t rank = static_cast<int64_t>(ndim);
  check_arg(rank > 0, op, "inputs have no dims (scalars)");
  check_arg(dim >= -rank && dim < rank, op, "attribute 'dim' = {} is not a dim of a {}-d tensor",
            dim, rank);
  return static_cast<int>(dim < 0 ? dim + rank : dim);
}

/// `spec` without Partial and with every mesh dim but the first that shards `dim` replicated;
/// returns the mesh dim that shards `dim` (-1: none).
int single_sharding(ShardSpec& spec, int dim) {
  for (Placement& placement : spec.placements)
    if (placement.is_partial()) placement = Placement::replicate();
  int found = -1;
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    if (!spec.placements[m].is_shard() || spec.placements[m].dim != dim) continue;
    if (found < 0) {
      found = static_cast<int>(m);
    } else {
      spec.placements[m] = Placement::replicate();
      spec.extents[m].clear();
    }
  }
  return found;
}

/// The extents, on each part of a split of [0, sum(boxes)) into `boxes`, of the range
/// [first, first + length).
std::vector<int64_t> overlaps(const std::vector<int64_t>& boxes, int64_t first, int64_t length) {
  std::vector<int64_t> result;
  int64_t lo = 0;
  for (int64_t extent : boxes) {
    const int64_t a = std::max(lo, first), b = std::min(lo + extent, first + length);
    result.push_back(std::max<int64_t>(0, b - a));
    lo += extent;
  }
  return result;
}

/// `like` with shape `shape` and extents `extents` along `dim` on mesh dim `m` (m < 0: none).
ShardSpec with_dim(const ShardSpec& like, Shape shape, int m, std::vector<int64_t> extents) {
  std::vector<std::vector<int64_t>> all = like.extents;
  if (m >= 0) all[m] = std::move(extents);
  return ShardSpec::make(std::move(shape), like.mesh_shape, like.placements, std::move(all));
}

/// The pieces joined along `dim` into one new tensor on their device.
Tensor join(const std::vector<Tensor>& pieces, int dim) {
  Shape shape = pieces[0].shape();
  shape[dim] = 0;
  for (const Tensor& piece : pieces) shape[dim] += piece.shape()[dim];
  Tensor out = Tensor::empty(shape, pieces[0].dtype(), pieces[0].device());
  // The pieces' copies stream past the caches by the whole join's traffic (read and written).
  const StreamingScope scope(2 * static_cast<int64_t>(out.nbytes()));
  int64_t offset = 0;
  for (const Tensor& piece : pieces) {
    const int64_t length = piece.shape()[dim];
    if (piece.numel() > 0) out.slice(dim, offset, offset + length).copy_from(piece);
    offset += length;
  }
  return out;
}

/// Consecutive pieces of `whole` along `dim` with `lengths`, as views of its storage (no copy,
/// as torch.cat's backward gives narrowed views of the gradient; consumers of a gradient read
/// it through its strides, as they do permute's).
std::vector<Tensor> cut(const Tensor& whole, int dim, const std::vector<int64_t>& lengths) {
  std::vector<Tensor> parts;
  int64_t offset = 0;
  for (int64_t length : lengths) {
    parts.push_back(whole.slice(dim, offset, offset + length));
    offset += length;
  }
  return parts;
}

// --- concat ---------------------------------------------------------------------------------

struct ConcatPlan {
  int dim = 0;
  std::vector<ShardSpec> inputs;  // the layouts the inputs move to
  ShardSpec output;
};

ConcatPlan concat_plan(const std::vector<ShardSpec>& given, const OpAttrs& attrs) {
  check_arg(given.size() >= 2 && given.size() <= kMaxConcatParts, "concat",
            "expects 2 to {} inputs, got {}", kMaxConcatParts, given.size());
  ConcatPlan plan;
  const Shape& first = given[0].global_shape;
  plan.dim = resolve_dim("concat", attrs.has("dim") ? attrs.get_int("dim") : 0, first.size());
  Shape out_shape = first;
  out_shape[plan.dim] = 0;
  for (size_t i = 0; i < given.size(); ++i) {
    const Shape& shape = given[i].global_shape;
    bool same = shape.size() == first.size();
    for (size_t d = 0; same && d < shape.size(); ++d)
      same = static_cast<int>(d) == plan.dim || shape[d] == first[d];
    check_arg(same, "concat",
              "input x{} of shape {} does not match x0 of shape {} but along dim {}", i, shape,
              first, plan.dim);
    out_shape[plan.dim] += shape[plan.dim];
  }
  ShardSpec lead = given[0];
  const int m = single_sharding(lead, plan.dim);
  std::vector<int64_t> out_extents;
  if (m >= 0) {
    const int parts = lead.mesh_shape[m];
    out_extents.assign(parts, 0);
    for (const ShardSpec& input : given) {
      const bool same_way = input.placements[m].is_shard() && input.placements[m].dim == plan.dim;
      const std::vector<int64_t> e =
          same_way ? input.extents[m] : default_split(input.global_shape[plan.dim], parts);
      for (int r = 0; r < parts; ++r) out_extents[r] += e[r];
    }
  }
  plan.output = with_dim(lead, out_shape, m, out_extents);
  int64_t offset = 0;
  for (const ShardSpec& input : given) {
    const int64_t length = input.global_shape[plan.dim];
    plan.inputs.push_back(
        with_dim(lead, input.global_shape, m,
                 m >= 0 ? overlaps(out_extents, offset, length) : std::vector<int64_t>{}));
    offset += length;
  }
  return plan;
}

OpAttr dim_attr() {
  return {.name = "dim",
          .type = AttrType::int_scalar,
          .default_value = int64_t{0},
          .doc = "the dim joined or cut (negative: from the end)"};
}

void register_concat() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    ConcatPlan plan = concat_plan(inputs, attrs);
    return OpRule{plan.inputs, std::vector<std::optional<HaloNeed>>(inputs.size()), {plan.output}};
  };
  KernelFn kernel = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    for (const Tensor& input : inputs)
      check_arg(input.dtype() == inputs[0].dtype(), "concat", "inputs of dtypes {} and {}",
                dtype_name(inputs[0].dtype()), dtype_name(input.dtype()));
    const int dim =
        resolve_dim("concat", context.attrs.has("dim") ? context.attrs.get_int("dim") : 0,
                    inputs[0].shape().size());
    return std::vector<Tensor>{join(inputs, dim)};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardSpec& y = record.outputs[0].spec();
    const ShardTensor g =
        grads[0]->spec() == y ? *grads[0] : grads[0]->redistribute(y.placements, y.extents);
    const int dim = resolve_dim("concat", record.attrs.has("dim") ? record.attrs.get_int("dim") : 0,
                                y.global_shape.size());
    std::vector<int64_t> lengths;
    for (const ShardTensor& input : record.inputs) lengths.push_back(input.to_local().shape()[dim]);
    const std::vector<Tensor> pieces = cut(g.to_local(), dim, lengths);
    std::vector<std::optional<ShardTensor>> result;
    for (size_t i = 0; i < pieces.size(); ++i)
      result.push_back(ShardTensor(pieces[i], record.inputs[i].mesh(), record.inputs[i].spec()));
    return result;
  };
  std::vector<OpInput> inputs;
  for (int i = 0; i < kMaxConcatParts; ++i)
    inputs.push_back({.name = fmt::format("x{}", i), .optional = i >= 2});
  register_op(OpDef{.name = "concat",
                    .summary = "x0, x1, ... (2 to 8) joined along dim (torch.cat; dim may be "
                               "sharded)",
                    .inputs = std::move(inputs),
                    .outputs = {"y"},
                    .attrs = {dim_attr()},
                    .rule = std::move(rule),
                    .cpu = kernel,
                    .cuda = kernel,
                    .backward = std::move(backward)});
}

// --- split ----------------------------------------------------------------------------------

/// The parts' lengths from the sizes attribute (one size: torch.split's chunks of that size).
std::vector<int64_t> part_lengths(const std::vector<int64_t>& sizes, int64_t length) {
  check_arg(!sizes.empty(), "split", "attribute 'sizes' is empty");
  for (int64_t size : sizes)
    check_arg(size >= 0, "split", "attribute 'sizes' = [{}] has a negative size",
              fmt::join(sizes, ","));
  std::vector<int64_t> lengths = sizes;
  if (sizes.size() == 1 && sizes[0] != length) {
    check_arg(sizes[0] > 0, "split", "attribute 'sizes' = 0 for a dim of extent {}", length);
    lengths.clear();
    for (int64_t at = 0; at < length; at += sizes[0])
      lengths.push_back(std::min(sizes[0], length - at));
    if (lengths.empty()) lengths.push_back(0);
  }
  check_arg(std::accumulate(lengths.begin(), lengths.end(), int64_t{0}) == length, "split",
            "attribute 'sizes' = [{}] does not sum to the dim's extent {}", fmt::join(sizes, ","),
            length);
  check_arg(static_cast<int>(lengths.size()) <= kMaxConcatParts, "split", "{} parts (at most {})",
            lengths.size(), kMaxConcatParts);
  return lengths;
}

struct SplitPlan {
  int dim = 0;
  std::vector<int64_t> lengths;
  ShardSpec input;
  std::vector<ShardSpec> outputs;
};

/// split's dim attribute as a dim of `given`.
int split_dim(const ShardSpec& given, const OpAttrs& attrs) {
  return resolve_dim("split", attrs.has("dim") ? attrs.get_int("dim") : 0,
                     given.global_shape.size());
}

SplitPlan split_plan(const ShardSpec& given, const OpAttrs& attrs) {
  SplitPlan plan;
  plan.dim = split_dim(given, attrs);
  check_arg(attrs.has("sizes"), "split", "missing required attribute 'sizes'");
  plan.lengths = part_lengths(attrs.get_ints("sizes"), given.global_shape[plan.dim]);
  plan.input = given;
  const int m = single_sharding(plan.input, plan.dim);
  int64_t offset = 0;
  for (int64_t length : plan.lengths) {
    Shape shape = given.global_shape;
    shape[plan.dim] = length;
    plan.outputs.push_back(with_dim(
        plan.input, shape, m,
        m >= 0 ? overlaps(plan.input.extents[m], offset, length) : std::vector<int64_t>{}));
    offset += length;
  }
  return plan;
}

void register_split() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    check_arg(inputs.size() == 1, "split", "expects 1 input (x), got {}", inputs.size());
    SplitPlan plan = split_plan(inputs[0], attrs);
    return OpRule{{std::move(plan.input)}, {std::nullopt}, std::move(plan.outputs)};
  };
  KernelFn kernel = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const int dim = split_dim(context.input_specs[0], context.attrs);
    // Every part is a view of x's storage, as torch.split's parts are: no copy. A part cut from
    // further in than the outermost non-trivial dim is strided; apply_op makes it contiguous
    // when an op reads it, redistribute and the IO paths when they move it (ShardTensor's
    // to_local() says so).
    std::vector<Tensor> parts;
    int64_t offset = 0;
    for (const Box& box : context.output_boxes) {
      const int64_t length = box.extent(dim);
      parts.push_back(inputs[0].slice(dim, offset, offset + length));
      offset += length;
    }
    return parts;
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardTensor& x = record.inputs[0];
    const int dim = resolve_dim("split", record.attrs.has("dim") ? record.attrs.get_int("dim") : 0,
                                x.global_shape().size());
    // dx is the parts' gradients joined along dim, written once: each part's slice of dx is
    // copied from its gradient or, for a part that got none, set to zero in place (no zero
    // tensor to copy).
    const Tensor local = x.to_local();
    Tensor dx = Tensor::empty(local.shape(), local.dtype(), local.device());
    int64_t offset = 0;
    for (size_t k = 0; k < record.outputs.size(); ++k) {
      const ShardTensor& y = record.outputs[k];
      const int64_t length = y.to_local().shape()[dim];
      Tensor slice = dx.slice(dim, offset, offset + length);
      offset += length;
      if (slice.numel() == 0) continue;
      if (!grads[k]) {
        slice.fill(0.0);
        continue;
      }
      const ShardTensor g = grads[k]->spec() == y.spec()
                                ? *grads[k]
                                : grads[k]->redistribute(y.placements(), y.spec().extents);
      slice.copy_from(g.to_local());
    }
    return {ShardTensor(dx, x.mesh(), x.spec())};
  };
  std::vector<std::string> outputs;
  for (int k = 0; k < kMaxConcatParts; ++k) outputs.push_back(fmt::format("y{}", k));
  register_op(OpDef{.name = "split",
                    .summary = "x cut along dim into parts of sizes (torch.split; y0, y1, ... as "
                               "many as parts; dim may be sharded)",
                    .inputs = {{.name = "x"}},
                    .outputs = std::move(outputs),
                    .attrs = {{.name = "sizes",
                               .type = AttrType::int_list,
                               .required = true,
                               .doc = "the parts' extents (one size s: parts of s, the last "
                                      "smaller)"},
                              dim_attr()},
                    .rule = std::move(rule),
                    .cpu = kernel,
                    .cuda = kernel,
                    .backward = std::move(backward)});
}

}  // namespace

void register_concat_ops() {
  register_concat();
  register_split();
}

ShardTensor concat(const std::vector<ShardTensor>& inputs, int64_t dim) {
  return apply_op("concat", inputs, OpAttrs().set("dim", dim))[0];
}

std::vector<ShardTensor> split(const ShardTensor& x, const std::vector<int64_t>& sizes,
                               int64_t dim) {
  return apply_op("split", {x}, OpAttrs().set("sizes", sizes).set("dim", dim));
}

}  // namespace tessera::ops
