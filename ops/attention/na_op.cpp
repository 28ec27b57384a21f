// The sharded neighborhood attention: rule (layouts, exact key boxes), kernel call and backward.
//
// Queries stay where they are: o and lse have q's layout. Along a spatial axis with global
// extent L, query i reads the keys of na_window(i, L, k, d, causal), computed from the GLOBAL
// index and extent, so windows shift only at the global borders. A rank owning queries [a, b)
// needs the union of their windows. Away from the borders that is [a - (k//2)*d,
// b + (k//2 + k%2 - 1)*d) (causal: [a - (k-1)*d, b)), but a clamped window near a border
// reaches further into the domain (L=20, k=7: query 0 reads keys [0, 7)), so the rule computes
// the union exactly. The halo plan fills that box from whichever ranks own it (several for thin
// shards); the box never leaves [0, L), so there are no padded keys.
//
// Backward: dq is local; dk and dv are computed on the haloed tile and the halo rows are sent
// back to their owners, who add them (halo_adjoint); d rpb is a local sum over this rank's
// queries, Partial(sum) over the mesh dims that shard q.
#include "ops/attention/na_op.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "core/agree.hpp"
#include "core/halo/halo_exchange.hpp"
#include "core/op_registry.hpp"
#include "ops/attention/na_cpu.hpp"
#include "ops/attention/na_cuda.hpp"
#include "ops/attention/na_problem.hpp"
#include "ops/op_costs.hpp"
#include "ops/op_helpers.hpp"

namespace tessera::ops {

namespace {

/// The per-axis geometry of a call on q of global shape `q_shape`, validated.
NaGeometry resolve(const Shape& q_shape, const OpAttrs& attrs) {
  check_arg(q_shape.size() >= 4 && q_shape.size() <= 6, "na",
            "expected q of shape [B, X(, Y(, Z)), heads, D] (4 to 6 dims), got shape {}", q_shape);
  const size_t spatial = q_shape.size() - 3;
  NaGeometry geometry;
  geometry.extent.assign(q_shape.begin() + 1, q_shape.begin() + 1 + spatial);
  geometry.kernel = attrs.get_ints("kernel_size");
  geometry.dilation = attrs.get_ints("dilation");
  geometry.causal = attrs.get_ints("causal");
  geometry.scale = attrs.get_double("scale");
  check_arg(geometry.kernel.size() == spatial && geometry.dilation.size() == spatial &&
                geometry.causal.size() == spatial,
            "na", "na{}d needs {} values per axis: kernel size {}, dilation {}, causal {}", spatial,
            spatial, geometry.kernel, geometry.dilation, geometry.causal);
  for (size_t a = 0; a < spatial; ++a) {
    check_arg(geometry.kernel[a] >= 1 && geometry.dilation[a] >= 1, "na",
              "kernel size {} and dilation {} must be positive", geometry.kernel,
              geometry.dilation);
    check_arg(geometry.causal[a] == 0 || geometry.causal[a] == 1, "na",
              "causal flags {} must be 0 or 1", geometry.causal);
    check_arg(geometry.kernel[a] * geometry.dilation[a] <= geometry.extent[a], "na",
              "kernel size {} with dilation {} does not fit the extent {} of spatial axis {} "
              "(needs kernel * dilation <= extent)",
              geometry.kernel[a], geometry.dilation[a], geometry.extent[a], a);
  }
  return geometry;
}

/// The keys queries [first, last) of one axis read: the union of their windows, [lo, hi).
/// Within one dilation group window starts and ends never decrease with the query, so the
/// lowest key is read by one of the first d queries and the highest by one of the last d.
std::pair<int64_t, int64_t> key_range(int64_t first, int64_t last, int64_t length, int64_t kernel,
                                      int64_t dilation, bool causal) {
  if (last <= first) return {first, first};
  int64_t lo = length, hi = 0;
  for (int64_t i = first; i < std::min(last, first + dilation); ++i)
    lo = std::min(lo, na_window(i, length, kernel, dilation, causal).first);
  for (int64_t i = std::max(first, last - dilation); i < last; ++i)
    hi = std::max(hi, na_window(i, length, kernel, dilation, causal).end());
  return {lo, hi};
}

OpRule na_rule(const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
  check_arg(inputs.size() == 3 || inputs.size() == 4, "na", "expects inputs q, k, v[, rpb], got {}",
            inputs.size());
  const Shape& q_shape = inputs[0].global_shape;
  const NaGeometry geometry = resolve(q_shape, attrs);
  const int spatial = static_cast<int>(geometry.extent.size());
  for (int i = 1; i <= 2; ++i)
    check_arg(inputs[i].global_shape == q_shape, "na", "{} has shape {}, q has shape {}",
              i == 1 ? "k" : "v", inputs[i].global_shape, q_shape);
  const int64_t heads = q_shape[q_shape.size() - 2];
  if (inputs.size() == 4) {
    bool allowed = true;
    for (int a = 0; a < spatial; ++a)
      allowed = allowed && geometry.causal[a] == 0 && geometry.kernel[a] % 2 == 1;
    check_arg(allowed, "na",
              "relative positional bias needs a non-causal odd kernel on every axis, got kernel "
              "size {} causal {}",
              geometry.kernel, geometry.causal);
    check_arg(inputs[3].global_shape == na_rpb_shape(heads, geometry), "na",
              "rpb of shape {}, expected {} ([heads, 2k-1 per axis])", inputs[3].global_shape,
              na_rpb_shape(heads, geometry));
  }
  // q: no pending partial sums, heads and D whole; k and v in q's layout; rpb replicated.
  ShardSpec q = without_partial(inputs[0]);
  const int heads_dim = static_cast<int>(q_shape.size()) - 2;
  for (size_t m = 0; m < q.placements.size(); ++m)
    if (q.placements[m].is_shard() && q.placements[m].dim >= heads_dim) {
      q.placements[m] = Placement::replicate();
      q.extents[m].clear();
    }
  const std::vector<Placement> replicated(q.mesh_shape.size(), Placement::replicate());
  OpRule rule;
  rule.inputs = {q, q, q};
  if (inputs.size() == 4)
    rule.inputs.push_back(ShardSpec::make(inputs[3].global_shape, q.mesh_shape, replicated));

  // Outputs: o in q's layout, lse in q's layout without D.
  Shape lse_shape = q_shape;
  lse_shape.pop_back();
  rule.outputs = {q, ShardSpec::make(lse_shape, q.mesh_shape, q.placements, q.extents, "na")};

  // Halo of k and v: per rank, the exact union of its queries' windows on every spatial axis.
  HaloNeed need;
  need.boundary.assign(q_shape.size(), BoundaryMode::zero);
  for (int rank = 0; rank < mesh_size(q.mesh_shape); ++rank) {
    Box box = q.local_box_of_rank(rank);
    for (int a = 0; a < spatial; ++a) {
      std::tie(box.lo[1 + a], box.hi[1 + a]) =
          key_range(box.lo[1 + a], box.hi[1 + a], geometry.extent[a], geometry.kernel[a],
                    geometry.dilation[a], geometry.causal[a] != 0);
    }
    need.needed.push_back(box);
  }
  rule.halos = {std::nullopt, need, need};
  if (inputs.size() == 4) rule.halos.push_back(std::nullopt);
  return rule;
}

/// Spatial part (dims 1..spatial) of a box's low corner.
std::vector<int64_t> spatial_lo(const Box& box, size_t spatial) {
  return std::vector<int64_t>(box.lo.begin() + 1, box.lo.begin() + 1 + spatial);
}

/// The rank's own k and v where the halo exchange left the tile's interior unfilled
/// (OpDef::owned_in_place), else nullopt.
std::optional<NaOwnedKeys> unfilled_keys(const KernelContext& context, size_t spatial) {
  const Tensor* k = context.interiors.owned(1);
  const Tensor* v = context.interiors.owned(2);
  if (!k || !v || context.interiors.box(1) != context.interiors.box(2)) return std::nullopt;
  return NaOwnedKeys{*k, *v, spatial_lo(context.interiors.box(1), spatial)};
}

/// The cpu forward of queries `q` (all the local ones, or a region's) over the k/v tile of
/// `inputs`: the lane forward reads the rank's own keys where they lie when the halo exchange
/// left them out of the tile; any other kernel gets the tile's interior filled first.
NaForward na_cpu_piece(const KernelContext& context, const std::vector<Tensor>& inputs,
                       const Tensor& q, const NaGeometry& geometry, const NaPieces& pieces) {
  const Tensor* rpb = inputs.size() == 4 ? &inputs[3] : nullptr;
  if (const auto owned = unfilled_keys(context, geometry.extent.size()))
    if (na_cpu_forward_reads_owned(q, inputs[1], inputs[2], rpb, geometry, pieces, *owned))
      return na_cpu_forward(q, inputs[1], inputs[2], rpb, geometry, pieces, 0,
                            NaCpuForward::automatic, &*owned);
  context.interiors.fill_all(inputs);
  return na_cpu_forward(q, inputs[1], inputs[2], rpb, geometry, pieces);
}

/// OpDef::owned_in_place: the cpu forward of all the local queries reads k and v in place.
bool na_owned_in_place(const KernelContext& context, const std::vector<Tensor>& inputs, size_t i) {
  const NaGeometry geometry = resolve(context.input_specs[0].global_shape, context.attrs);
  const size_t spatial = geometry.extent.size();
  const auto owned = unfilled_keys(context, spatial);
  if ((i != 1 && i != 2) || !owned) return false;
  const NaPieces pieces{spatial_lo(context.input_boxes[0], spatial),
                        spatial_lo(context.input_boxes[1], spatial)};
  const Tensor* rpb = inputs.size() == 4 ? &inputs[3] : nullptr;
  return na_cpu_forward_reads_owned(inputs[0], inputs[1], inputs[2], rpb, geometry, pieces, *owned);
}

std::vector<Tensor> na_cpu(const KernelContext& context, const std::vector<Tensor>& inputs) {
  const NaGeometry geometry = resolve(context.input_specs[0].global_shape, context.attrs);
  const size_t spatial = geometry.extent.size();
  const NaPieces pieces{spatial_lo(context.input_boxes[0], spatial),
                        spatial_lo(context.input_boxes[1], spatial)};
  NaForward result = na_cpu_piece(context, inputs, inputs[0], geometry, pieces);
  return {std::move(result.output), std::move(result.lse)};
}

/// The cuda body: the same call on the rank's device, queued on its compute stream; the k/v
/// tiles arrive haloed on the device through the halo plan.
std::vector<Tensor> na_cuda(const KernelContext& context, const std::vector<Tensor>& inputs) {
  const NaGeometry geometry = resolve(context.input_specs[0].global_shape, context.attrs);
  const size_t spatial = geometry.extent.size();
  const NaPieces pieces{spatial_lo(context.input_boxes[0], spatial),
                        spatial_lo(context.input_boxes[1], spatial)};
  const Tensor* rpb = inputs.size() == 4 ? &inputs[3] : nullptr;
  NaForward result =
      na_cuda_forward(inputs[0], inputs[1], inputs[2], rpb, geometry, pieces, context.stream);
  return {std::move(result.output), std::move(result.lse)};
}

// ---- overlap of the forward with the halo exchange (cpu and cuda) ----
//
// A query whose window (along every axis) lies in the rank's own keys is "interior": its o and
// lse can be computed before any halo key has landed. Along each axis the interior is taken as
// one run of queries (below), so it is a box; the rest of the local queries is at most two slabs
// per spatial axis (boxes_around), computed once the halos are in. Each region runs the same kernel
// on its query piece (the k/v tile and its offset unchanged), over the same keys; the kernels tile
// the queries of the piece they are given, so a query may round differently than without the
// split (within 1e-12 in f64).

/// The interior queries of the local piece, in local coordinates of q (possibly empty).
Box na_interior_queries(const KernelContext& context, const NaGeometry& geometry) {
  const Box& queries = context.input_boxes[0];  // global box of the local q piece
  const Box& owned = context.owned_boxes[1];    // global box of the rank's own keys
  Box interior = Box::of_shape(queries.shape());
  for (size_t a = 0; a < geometry.extent.size(); ++a) {
    const size_t dim = 1 + a;
    // With dilation d windows move forward only within each class of queries mod d, so the
    // interior is taken as the run after the last query whose window starts below the own keys
    // and before the first whose window ends past them.
    int64_t first = queries.lo[dim], end = queries.hi[dim];
    for (int64_t t = queries.lo[dim]; t < queries.hi[dim]; ++t) {
      const auto [lo, hi] = key_range(t, t + 1, geometry.extent[a], geometry.kernel[a],
                                      geometry.dilation[a], geometry.causal[a] != 0);
      if (lo < owned.lo[dim]) first = t + 1;
      if (hi > owned.hi[dim] && end == queries.hi[dim]) end = t;
    }
    interior.lo[dim] = first - queries.lo[dim];
    interior.hi[dim] = std::max(first, end) - queries.lo[dim];
  }
  return interior;
}

/// o and lse of the queries in `region` (local coordinates of q) into `o` and `lse`, by the
/// inputs' device's kernel (on a device queued on the compute stream, as the copies are).
void na_region(const KernelContext& context, const std::vector<Tensor>& inputs,
               const NaGeometry& geometry, const Box& region, Tensor& o, Tensor& lse) {
  if (region.empty()) return;
  const size_t spatial = geometry.extent.size();
  std::vector<int64_t> query_offset = spatial_lo(context.input_boxes[0], spatial);
  for (size_t a = 0; a < spatial; ++a) query_offset[a] += region.lo[1 + a];
  const NaPieces pieces{query_offset, spatial_lo(context.input_boxes[1], spatial)};
  const Tensor* rpb = inputs.size() == 4 ? &inputs[3] : nullptr;
  const Tensor q = inputs[0].view_box(region).contiguous();
  const NaForward piece =
      inputs[0].device().is_cuda()
          ? na_cuda_forward(q, inputs[1], inputs[2], rpb, geometry, pieces, context.stream)
          : na_cpu_piece(context, inputs, q, geometry, pieces);
  o.view_box(region).copy_from(piece.output);
  Box lse_region = region;
  lse_region.lo.pop_back();
  lse_region.hi.pop_back();
  lse.view_box(lse_region).copy_from(piece.lse);
}

/// The interior queries, while the k/v halos travel; o and lse allocated whole.
std::vector<Tensor> na_interior(const KernelContext& context, const std::vector<Tensor>& inputs) {
  const NaGeometry geometry = resolve(context.input_specs[0].global_shape, context.attrs);
  Shape lse_shape = inputs[0].shape();
  lse_shape.pop_back();
  const Device device = inputs[0].device();
  Tensor o = Tensor::empty(inputs[0].shape(), inputs[0].dtype(), device);
  Tensor lse = Tensor::empty(lse_shape, na_detail::lse_dtype(inputs[0].dtype()), device);
  na_region(context, inputs, geometry, na_interior_queries(context, geometry), o, lse);
  return {std::move(o), std::move(lse)};
}

/// The rest of the queries, once the halos have landed.
void na_boundary(const KernelContext& context, const std::vector<Tensor>& inputs,
                 std::vector<Tensor>& outputs) {
  const NaGeometry geometry = resolve(context.input_specs[0].global_shape, context.attrs);
  const Box whole = Box::of_shape(inputs[0].shape());
  for (const Box& region :
       boxes_around(whole, na_interior_queries(context, geometry), 1, 1 + geometry.extent.size()))
    na_region(context, inputs, geometry, region, outputs[0], outputs[1]);
}

/// The local gradient of output `index` in that output's layout (zeros when none arrived).
std::optional<Tensor> local_grad(const OpRecord& record,
                                 const std::vector<std::optional<ShardTensor>>& grads,
                                 size_t index) {
  if (index >= grads.size() || !grads[index]) return std::nullopt;
  const ShardSpec& spec = record.outputs[index].spec();
  const ShardTensor& grad = *grads[index];
  return (grad.spec() == spec ? grad : grad.redistribute_to(spec)).to_local().contiguous();
}

std::vector<std::optional<ShardTensor>> na_backward_op(
    const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads) {
  const ShardTensor& q = record.inputs[0];
  const NaGeometry geometry = resolve(q.global_shape(), record.attrs);
  const size_t spatial = geometry.extent.size();
  const NaPieces pieces{spatial_lo(q.local_box(), spatial),
                        spatial_lo(record.plans[1]->needed_box(), spatial)};
  const std::optional<Tensor> grad_lse = local_grad(record, grads, 1);
  std::optional<Tensor> grad_output = local_grad(record, grads, 0);
  const Device device = record.kernel_inputs[0].device();
  if (!grad_output) grad_output = Tensor::zeros(q.to_local().shape(), q.dtype(), device);
  const bool has_rpb = record.inputs.size() == 4;
  const Tensor* rpb = has_rpb ? &record.kernel_inputs[3] : nullptr;
  // On a device the probabilities come back from the forward's lse, and the fused kernel's
  // delta from its o (this rank's pieces).
  const Tensor output = record.outputs[0].to_local();
  const NaGradients local =
      device.is_cuda()
          ? na_cuda_backward(record.kernel_inputs[0], record.kernel_inputs[1],
                             record.kernel_inputs[2], rpb, &output, record.outputs[1].to_local(),
                             *grad_output, grad_lse ? &*grad_lse : nullptr, geometry, pieces,
                             compute_stream_for(device))
          : na_cpu_backward(record.kernel_inputs[0], record.kernel_inputs[1],
                            record.kernel_inputs[2], rpb, *grad_output,
                            grad_lse ? &*grad_lse : nullptr, geometry, pieces);
  Comm& comm = q.mesh().comm();
  std::vector<std::optional<ShardTensor>> result;
  result.emplace_back(ShardTensor(local.dq, q.mesh(), q.spec()));
  // dk, dv: the halo rows go back to their owners, who add them.
  for (int i = 1; i <= 2; ++i) {
    const ShardTensor& input = record.inputs[i];
    const Tensor& tile_grad = i == 1 ? local.dk : local.dv;
    result.emplace_back(ShardTensor(halo_adjoint(*record.plans[i], tile_grad, comm, i),
                                    input.mesh(), input.spec()));
  }
  if (has_rpb) {
    const ShardTensor& rpb = record.inputs[3];
    result.emplace_back(
        ShardTensor(local.drpb, rpb.mesh(), partial_over_sharding(q.spec(), rpb.global_shape())));
  }
  return result;
}

}  // namespace

void register_attention_ops() {
  const auto per_axis = [](const char* name, const char* doc) {
    return OpAttr{.name = name, .type = AttrType::int_list, .required = true, .doc = doc};
  };
  register_op(OpDef{
      .name = "na",
      .summary = "Neighborhood attention 1d/2d/3d (by the rank of q) of q, k, v [B, X(, Y(, Z)), "
                 "heads, D]",
      .inputs = {{.name = "q"}, {.name = "k"}, {.name = "v"}, {.name = "rpb", .optional = true}},
      .outputs = {"o", "lse"},
      .attrs = {per_axis("kernel_size", "window size per spatial axis"),
                per_axis("dilation", "dilation per spatial axis"),
                per_axis("causal", "0 or 1 per spatial axis"),
                {.name = "scale",
                 .type = AttrType::float_scalar,
                 .required = true,
                 .doc = "logits are scale * q.k (ops::neighborhood_attention passes D^-0.5)"}},
      .rule = na_rule,
      .cpu = na_cpu,
      .cuda = na_cuda,
      .backward = na_backward_op,
      .cpu_overlap = OverlapKernel{na_interior, na_boundary},
      .cuda_overlap = OverlapKernel{na_interior, na_boundary},
      .owned_in_place = na_owned_in_place,
      .cost = na_cost});
}

NaResult neighborhood_attention(const ShardTensor& q, const ShardTensor& k, const ShardTensor& v,
                                const NaOptions& options) {
  // These checks see only global shapes, dtypes and options, which every rank shares, so (like a
  // rule's checks in apply_op) their verdict is the same everywhere: an agreed error.
  auto check = [](bool condition, const std::string& message) {
    if (!condition) throw AgreedError("na", message);
  };
  const Shape& shape = q.global_shape();
  check(shape.size() >= 4 && shape.size() <= 6,
        fmt::format("expected q of shape [B, X(, Y(, Z)), heads, D] (4 to 6 dims), got shape {}",
                    shape));
  const size_t spatial = shape.size() - 3;
  auto per_axis = [&](const char* name, std::vector<int64_t> values) {
    if (values.size() == 1) values.assign(spatial, values[0]);
    check(values.size() == spatial,
          fmt::format("{} {} for na{}d (one value or one per axis)", name, values, spatial));
    return values;
  };
  check(q.dtype() == k.dtype() && q.dtype() == v.dtype() && is_floating(q.dtype()),
        fmt::format("q, k, v must share one floating dtype, got {}, {}, {}", dtype_name(q.dtype()),
                    dtype_name(k.dtype()), dtype_name(v.dtype())));
  const double scale =
      options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(shape.back()));
  OpAttrs attrs;
  attrs.set("kernel_size", per_axis("kernel size", options.kernel_size))
      .set("dilation", per_axis("dilation", options.dilation))
      .set("causal", per_axis("causal", options.causal))
      .set("scale", scale);
  std::vector<ShardTensor> inputs{q, k, v};
  if (options.rpb) inputs.push_back(*options.rpb);
  std::vector<ShardTensor> outputs = apply_op("na", inputs, attrs);
  return NaResult{std::move(outputs[0]), std::move(outputs[1])};
}

}  // namespace tessera::ops
