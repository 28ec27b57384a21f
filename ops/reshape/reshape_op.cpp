// split_last and merge_last: rules, kernel, backward and registration.
//
// Layouts: the dims before the reshaped ones keep their placements. split_last: the one mesh dim
// sharding the last dim keeps sharding it (now the dim n) when every rank's extent is a whole
// number of rows of `inner`; otherwise (or for a second mesh dim sharding it) it replicates
// first. merge_last: the mesh dim sharding dim n keeps sharding the merged dim (extents times
// inner); one sharding the inner dim replicates first. Partial placements pass through (both ops
// are linear). Every rank's piece is then a contiguous block of the reshaped dims, so the kernel
// is a local reshape and the backward the other op's local reshape.
#include "ops/reshape/reshape_op.hpp"

#include <algorithm>
#include <functional>

#include "core/autograd.hpp"
#include "ops/op_helpers.hpp"

namespace tessera::ops {

namespace {

/// `spec` with the mesh dims that shard tensor dims [first, end) replicated, except the first
/// one sharding `keep` when `keep_if(extents)` holds; returns that mesh dim (-1: none).
int keep_one_sharding(ShardSpec& spec, int first, int keep,
                      const std::function<bool(const std::vector<int64_t>&)>& keep_if) {
  int kept = -1;
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    Placement& p = spec.placements[m];
    if (!p.is_shard() || p.dim < first) continue;
    if (kept < 0 && p.dim == keep && keep_if(spec.extents[m])) {
      kept = static_cast<int>(m);
      continue;
    }
    p = Placement::replicate();
    spec.extents[m].clear();
  }
  spec = ShardSpec::make(spec.global_shape, spec.mesh_shape, spec.placements, spec.extents);
  return kept;
}

/// The output layout: the input's placements, the kept mesh dim sharding `out_dim` with its
/// extents scaled by `multiply` / `divide`.
ShardSpec reshaped_layout(const ShardSpec& in, const Shape& shape, int kept, int out_dim,
                          int64_t multiply, int64_t divide) {
  std::vector<Placement> placements = in.placements;
  std::vector<std::vector<int64_t>> extents = in.extents;
  if (kept >= 0) {
    placements[kept] = Placement::shard(out_dim);
    for (int64_t& e : extents[kept]) e = e * multiply / divide;
  }
  return ShardSpec::make(shape, in.mesh_shape, placements, extents);
}

/// Both ops' kernel: this rank's piece in the output piece's shape (a contiguous block of the
/// reshaped dims, as the rules ensure).
std::vector<Tensor> local_reshape(const KernelContext& context, const std::vector<Tensor>& inputs) {
  return {inputs[0].contiguous().reshape(context.output_boxes[0].shape())};
}

/// The gradient of the input: the output's, reshaped to the input's local shape.
ShardTensor local_reshape_grad(const OpRecord& record,
                               const std::vector<std::optional<ShardTensor>>& grads) {
  // The gradient of a Partial(sum) piece is the gradient of the sum: replicated there.
  const ShardTensor& x = record.inputs[0];
  const ShardSpec y_spec = without_partial(record.outputs[0].spec());
  const ShardTensor g = grads[0]->spec() == y_spec
                            ? *grads[0]
                            : grads[0]->redistribute(y_spec.placements, y_spec.extents);
  return ShardTensor(g.to_local().contiguous().reshape(x.to_local().shape()), x.mesh(),
                     without_partial(x.spec()));
}

void register_split_last() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    check_arg(inputs.size() == 1, "split_last", "expects one input x, got {}", inputs.size());
    const int64_t inner = attrs.get_int("inner");
    const Shape& shape = inputs[0].global_shape;
    check_arg(!shape.empty(), "split_last", "x has no dims (a scalar)");
    check_arg(inner >= 1 && shape.back() % inner == 0, "split_last",
              "attribute 'inner' = {} does not divide x's last extent {} (x of shape {})", inner,
              shape.back(), shape);
    const int last = static_cast<int>(shape.size()) - 1;
    ShardSpec x = inputs[0];
    const int kept = keep_one_sharding(x, last, last, [&](const std::vector<int64_t>& extents) {
      return std::all_of(extents.begin(), extents.end(), [&](int64_t e) { return e % inner == 0; });
    });
    Shape y = shape;
    y.back() = shape.back() / inner;
    y.push_back(inner);
    return OpRule{{x}, {std::nullopt}, {reshaped_layout(x, y, kept, last, 1, inner)}};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> { return {local_reshape_grad(record, grads)}; };
  register_op(OpDef{.name = "split_last",
                    .summary = "x[..., n * inner] as [..., n, inner] (x sharded on any dim)",
                    .inputs = {{.name = "x"}},
                    .outputs = {"y"},
                    .attrs = {{.name = "inner",
                               .type = AttrType::int_scalar,
                               .required = true,
                               .doc = "the extent of the new last dim"}},
                    .rule = std::move(rule),
                    .cpu = local_reshape,
                    .cuda = local_reshape,
                    .backward = std::move(backward)});
}

void register_merge_last() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs&) {
    check_arg(inputs.size() == 1, "merge_last", "expects one input x, got {}", inputs.size());
    const Shape& shape = inputs[0].global_shape;
    check_arg(shape.size() >= 2, "merge_last", "x of shape {}: expected at least 2 dims", shape);
    const int n_dim = static_cast<int>(shape.size()) - 2;
    ShardSpec x = inputs[0];
    const int kept =
        keep_one_sharding(x, n_dim, n_dim, [](const std::vector<int64_t>&) { return true; });
    Shape y(shape.begin(), shape.end() - 1);
    y.back() *= shape.back();
    return OpRule{{x}, {std::nullopt}, {reshaped_layout(x, y, kept, n_dim, shape.back(), 1)}};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> { return {local_reshape_grad(record, grads)}; };
  register_op(OpDef{.name = "merge_last",
                    .summary = "x[..., n, inner] as [..., n * inner] (x sharded on any dim)",
                    .inputs = {{.name = "x"}},
                    .outputs = {"y"},
                    .rule = std::move(rule),
                    .cpu = local_reshape,
                    .cuda = local_reshape,
                    .backward = std::move(backward)});
}

}  // namespace

void register_reshape_ops() {
  register_split_last();
  register_merge_last();
}

ShardTensor split_last(const ShardTensor& x, int64_t inner) {
  return apply_op("split_last", {x}, OpAttrs().set("inner", inner))[0];
}

ShardTensor merge_last(const ShardTensor& x) {
  return apply_op("merge_last", {x})[0];
}

}  // namespace tessera::ops
