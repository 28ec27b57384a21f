// The sharded normalizations: attributes, rule, kernels, backward and registration.
//
// x keeps its layout (any dims sharded, uneven, empty shards; no halo); w, b and batch_norm's
// running statistics are replicated. Each op has statistics slots (norm_geometry.hpp) reduced
// over some tensor dims: batch_norm over N and the spatial dims (slots: the channels), group_norm
// over a group's channels and the spatial dims, instance_norm over the spatial dims, layer_norm
// over the trailing normalized dims. A rank computes the moments (count, mean, M2) of its
// elements of every slot in f64 (two passes per chunk); the ranks that differ only along the mesh
// dims sharding a reduced dim (for batch_norm and group_norm also the channel dim, as their slots
// span the channels) all-gather those triples and combine them by Chan's pairwise formula in
// rank order, so every rank gets bit-identical statistics and none subtracts E[x]^2 from
// E[x^2]. group_norm, instance_norm and layer_norm also return each slot's mean and rstd (as
// PyTorch's native_group_norm and native_layer_norm and ONNX's LayerNormalization do), which
// their backward reads from the tape's record instead of computing them again (x read twice
// instead of four times, no collective for them); batch_norm's backward recomputes the
// statistics the same way (its extra outputs are the running statistics). The backward reduces
// its two per-slot sums (of dxhat and of dxhat * xhat) over the same ranks, summed in rank order;
// dw and db are Partial(sum) over the mesh dims that shard x.
#include "ops/norm/norm_op.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <string>

#include "core/estimate/real_data.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/norm/norm_kernels.hpp"
#include "ops/op_costs.hpp"
#include "ops/op_helpers.hpp"

namespace tessera::ops {

namespace {

using kernels::NormGeometry;
using kernels::NormKind;

const char* name_of(NormKind kind) {
  switch (kind) {
    case NormKind::group: return "group_norm";
    case NormKind::batch: return "batch_norm";
    case NormKind::instance: return "instance_norm";
    case NormKind::layer: return "layer_norm";
  }
  return "norm";
}

/// Positions of the optional inputs of a call (-1: not given).
struct NormInputs {
  int w = -1, b = -1, running_mean = -1, running_var = -1;
};

/// batch_norm takes (x, running_mean, running_var, w, b) as torch.nn.functional.batch_norm does;
/// the others (x, w, b).
NormInputs inputs_of(NormKind kind, size_t count) {
  NormInputs at;
  const int given = static_cast<int>(count);
  if (kind == NormKind::batch) {
    at.running_mean = given > 1 ? 1 : -1;
    at.running_var = given > 2 ? 2 : -1;
    at.w = given > 3 ? 3 : -1;
    at.b = given > 4 ? 4 : -1;
  } else {
    at.w = given > 1 ? 1 : -1;
    at.b = given > 2 ? 2 : -1;
  }
  return at;
}

/// The attributes of a call, checked against x's shape.
struct NormAttrs {
  double eps = 1e-5;
  int64_t groups = 1;           // group_norm
  bool training = true;         // batch_norm
  double momentum = 0.1;        // batch_norm
  int64_t normalized_ndim = 1;  // layer_norm
};

double get_float(const OpAttrs& attrs, const char* name, double fallback) {
  return attrs.has(name) ? attrs.get_double(name) : fallback;
}

NormAttrs resolve(NormKind kind, const Shape& x, const OpAttrs& attrs) {
  const char* op = name_of(kind);
  NormAttrs result;
  result.eps = get_float(attrs, "eps", 1e-5);
  check_arg(std::isfinite(result.eps) && result.eps >= 0, op,
            "attribute 'eps' = {}: expected a finite value >= 0", result.eps);
  const int64_t rank = static_cast<int64_t>(x.size());
  if (kind == NormKind::layer) {
    result.normalized_ndim = attrs.get_int("normalized_ndim", 1);
    check_arg(result.normalized_ndim >= 1 && result.normalized_ndim <= rank, op,
              "attribute 'normalized_ndim' = {}: expected 1 to {} for an input of shape {}",
              result.normalized_ndim, rank, x);
    return result;
  }
  const int64_t min_rank = kind == NormKind::instance ? 3 : 2;
  check_arg(rank >= min_rank, op, "expected an input [N, C{}], got shape {}",
            kind == NormKind::instance ? ", spatial.." : ", spatial..(optional)", x);
  if (kind == NormKind::group) {
    check_arg(attrs.has("groups"), op, "missing required attribute 'groups'");
    result.groups = attrs.get_int("groups");
    check_arg(result.groups >= 1 && x[1] % result.groups == 0, op,
              "attribute 'groups' = {}: expected a divisor (>= 1) of the {} channels of x {}",
              result.groups, x[1], x);
  }
  if (kind == NormKind::batch) {
    result.training = attrs.get_int("training", 1) != 0;
    result.momentum = get_float(attrs, "momentum", 0.1);
    check_arg(std::isfinite(result.momentum), op,
              "attribute 'momentum' = {}: expected a finite "
              "value",
              result.momentum);
    int64_t per_channel = x[0];
    for (int64_t d = 2; d < rank; ++d) per_channel *= x[d];
    check_arg(!result.training || per_channel != 1, op,
              "expected more than 1 value per channel when training, got input of shape {}", x);
  }
  return result;
}

/// Shape of w and b: [C], or layer_norm's normalized dims.
Shape param_shape(NormKind kind, const Shape& x, const NormAttrs& attrs) {
  if (kind != NormKind::layer) return {x[1]};
  return Shape(x.end() - attrs.normalized_ndim, x.end());
}

/// Whether tensor dim `dim` of x takes part in the statistics' reduction (its shards combine).
bool reduced_dim(NormKind kind, const Shape& x, const NormAttrs& attrs, int dim) {
  switch (kind) {
    case NormKind::batch: return true;
    case NormKind::group: return dim >= 1;
    case NormKind::instance: return dim >= 2;
    case NormKind::layer: return dim >= static_cast<int>(x.size() - attrs.normalized_ndim);
  }
  return false;
}

/// The mesh dims whose ranks combine their statistics.
std::vector<int> statistics_mesh_dims(NormKind kind, const ShardSpec& x, const NormAttrs& attrs) {
  std::vector<int> dims;
  for (size_t m = 0; m < x.placements.size(); ++m)
    if (x.placements[m].is_shard() && reduced_dim(kind, x.global_shape, attrs, x.placements[m].dim))
      dims.push_back(static_cast<int>(m));
  return dims;
}

/// The mean and rstd outputs of group_norm, instance_norm and layer_norm (f64, one value per
/// statistics slot): group_norm's [N, groups] and instance_norm's [N, C] (as PyTorch's
/// native_group_norm returns them), layer_norm's x's shape with the normalized dims as 1. They
/// are laid out as x along the dims they keep (N; instance_norm's C; layer_norm's leading dims)
/// and replicated over the mesh dims that shard a reduced dim (their ranks hold the same combined
/// statistics).
ShardSpec statistics_output_spec(NormKind kind, const ShardSpec& x, const NormAttrs& attrs) {
  Shape shape = x.global_shape;
  int kept = 0;  // tensor dims [0, kept) keep x's layout
  switch (kind) {
    case NormKind::group:
      shape = {x.global_shape[0], attrs.groups};
      kept = 1;
      break;
    case NormKind::instance:
      shape = {x.global_shape[0], x.global_shape[1]};
      kept = 2;
      break;
    default:
      kept = static_cast<int>(shape.size() - static_cast<size_t>(attrs.normalized_ndim));
      for (size_t d = static_cast<size_t>(kept); d < shape.size(); ++d) shape[d] = 1;
      break;
  }
  std::vector<Placement> placements = x.placements;
  std::vector<std::vector<int64_t>> extents = x.extents;
  extents.resize(placements.size());
  for (size_t m = 0; m < placements.size(); ++m)
    if (!placements[m].is_shard() || placements[m].dim >= kept) {
      placements[m] = Placement::replicate();
      extents[m].clear();
    }
  return ShardSpec::make(shape, x.mesh_shape, placements, extents, name_of(kind));
}

/// Whether the op returns its statistics' mean and rstd (and its backward reads them).
bool returns_statistics(NormKind kind) {
  return kind != NormKind::batch;
}

OpRule norm_rule(NormKind kind, const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
  const char* op = name_of(kind);
  const size_t most = kind == NormKind::batch ? 5 : 3;
  check_arg(!inputs.empty() && inputs.size() <= most, op, "expects inputs {}, got {}",
            kind == NormKind::batch ? "x[, running_mean, running_var[, w[, b]]]" : "x[, w[, b]]",
            inputs.size());
  const ShardSpec x = without_partial(inputs[0]);
  const NormAttrs resolved = resolve(kind, x.global_shape, attrs);
  const NormInputs at = inputs_of(kind, inputs.size());
  const Shape params = param_shape(kind, x.global_shape, resolved);
  const auto check_shape = [&](int index, const char* name, const Shape& expected) {
    if (index < 0) return;
    check_arg(inputs[index].global_shape == expected, op, "{} of shape {}, expected {}", name,
              inputs[index].global_shape, expected);
  };
  check_shape(at.w, "w", params);
  check_shape(at.b, "b", params);
  check_shape(at.running_mean, "running_mean", params);
  check_shape(at.running_var, "running_var", params);
  if (kind == NormKind::batch) {
    check_arg(at.running_mean < 0 || at.running_var >= 0, op,
              "running_mean is given without running_var");
    check_arg(resolved.training || at.running_mean >= 0, op,
              "eval mode (training=0) needs running_mean and running_var");
  }
  const std::vector<Placement> replicated(x.mesh_shape.size(), Placement::replicate());
  OpRule rule;
  rule.inputs.push_back(x);
  for (size_t i = 1; i < inputs.size(); ++i)
    rule.inputs.push_back(ShardSpec::make(inputs[i].global_shape, x.mesh_shape, replicated));
  rule.halos.assign(inputs.size(), std::nullopt);
  rule.outputs.push_back(x);
  if (kind == NormKind::batch)
    for (int i = 0; i < 2; ++i)
      rule.outputs.push_back(ShardSpec::make(params, x.mesh_shape, replicated));
  if (returns_statistics(kind))
    for (int i = 0; i < 2; ++i) rule.outputs.push_back(statistics_output_spec(kind, x, resolved));
  return rule;
}

/// The geometry of the local piece of x covering global box `box`.
NormGeometry geometry_of(NormKind kind, const Shape& x, const NormAttrs& attrs, const Box& box) {
  NormGeometry g;
  g.kind = kind;
  g.eps = attrs.eps;
  const int rank = static_cast<int>(x.size());
  if (kind == NormKind::layer) {
    const int first = rank - static_cast<int>(attrs.normalized_ndim);
    g.batch = 1;
    g.length = 1;
    for (int d = 0; d < rank; ++d) (d < first ? g.batch : g.length) *= box.extent(d);
    g.channels = 1;
    g.slots = g.batch;
    g.slot_stride = 1;
    g.per_element_affine = true;
    return g;
  }
  g.batch = box.extent(0);
  g.channels = box.extent(1);
  g.length = 1;
  for (int d = 2; d < rank; ++d) g.length *= box.extent(d);
  g.channel_offset = box.lo[1];
  switch (kind) {
    case NormKind::batch:
      g.slots = x[1];
      g.slot_stride = 0;
      g.slot_offset = box.lo[1];
      break;
    case NormKind::group:
      g.slots = g.batch * attrs.groups;
      g.slot_stride = attrs.groups;
      g.slot_offset = box.lo[1];
      g.channels_per_slot = x[1] / attrs.groups;
      break;
    default:  // instance
      g.slots = g.batch * g.channels;
      g.slot_stride = g.channels;
      break;
  }
  return g;
}

/// Every rank's per-slot values `local` [slots, width] (f64, on its device) all-gathered over
/// `dims` of the mesh: [ranks, slots, width] in the sub-communicator's rank order.
Tensor gather_slots(const DeviceMesh& mesh, const std::vector<int>& dims, const Tensor& local) {
  const Shape shape = local.shape();
  if (dims.empty()) return local.reshape({1, shape[0], shape[1]});
  const std::shared_ptr<Comm> comm = mesh.sub_comm(dims);
  const size_t count = static_cast<size_t>(local.numel());
  Tensor gathered = Tensor::empty({comm->size(), shape[0], shape[1]}, DType::f64, local.device());
  comm->all_gather_v(local.comm_data(), count, gathered.comm_data(),
                     std::vector<size_t>(static_cast<size_t>(comm->size()), count), DType::f64);
  return gathered;
}

/// Everything a kernel or the backward needs to know about one call.
struct NormCall {
  NormKind kind;
  NormAttrs attrs;
  NormInputs at;
  NormGeometry g;
  std::vector<int> mesh_dims;  // mesh dims whose ranks combine statistics
  Device device = Device::cpu();
  Stream stream{};
};

NormCall call_of(NormKind kind, const OpAttrs& attrs, const ShardSpec& x, const Box& box,
                 size_t inputs, Device device, Stream stream) {
  NormCall call{
      kind, resolve(kind, x.global_shape, attrs), inputs_of(kind, inputs), {}, {}, device, stream};
  call.g = geometry_of(kind, x.global_shape, call.attrs, box);
  call.mesh_dims = statistics_mesh_dims(kind, x, call.attrs);
  return call;
}

/// The local slice of a replicated w or b: layer_norm's normalized dims of the piece's box.
Tensor param_piece(const NormCall& call, const Tensor& param, const Box& box) {
  if (call.kind != NormKind::layer) return param;
  const size_t first = box.ndim() - static_cast<size_t>(call.attrs.normalized_ndim);
  Box local;
  for (size_t d = first; d < box.ndim(); ++d) {
    local.lo.push_back(box.lo[d]);
    local.hi.push_back(box.hi[d]);
  }
  return param.view_box(local).contiguous();
}

/// The statistics [slots, 4] of the call: combined over the ranks (collective over
/// call.mesh_dims), or batch_norm's running ones in eval mode.
Tensor statistics_of(const NormCall& call, const DeviceMesh& mesh, const Tensor& x,
                     const std::vector<Tensor>& inputs) {
  const bool cuda = call.device.is_cuda();
  if (call.kind == NormKind::batch && !call.attrs.training) {
    const Tensor& mean = inputs[call.at.running_mean];
    const Tensor& var = inputs[call.at.running_var];
    return cuda ? norm_running_statistics_cuda(mean, var, call.attrs.eps, call.stream)
                : norm_running_statistics_cpu(mean, var, call.attrs.eps);
  }
  const Tensor moments =
      cuda ? norm_moments_cuda(call.g, x, call.stream) : norm_moments_cpu(call.g, x);
  const Tensor gathered = gather_slots(mesh, call.mesh_dims, moments);
  return cuda ? norm_statistics_cuda(gathered, call.attrs.eps, call.stream)
              : norm_statistics_cpu(gathered, call.attrs.eps);
}

/// The mean and rstd outputs (local `shape`, one value per slot in slot order): columns 0 and 1
/// of the statistics [slots, 4].
std::pair<Tensor, Tensor> row_mean_and_rstd(const Tensor& statistics, const Shape& shape) {
  const Device device = statistics.device();
  if (statistics.is_shape_only())
    return {Tensor::empty(shape, DType::f64, device), Tensor::empty(shape, DType::f64, device)};
  if (device.is_cpu()) {
    // A plain loop over the rows: the backend's general strided copy of a column was slower.
    const Tensor source = statistics.contiguous();
    Tensor mean = Tensor::empty(shape, DType::f64), rstd = Tensor::empty(shape, DType::f64);
    const double* s = source.data<double>();
    double* m = mean.data<double>();
    double* r = rstd.data<double>();
    for (int64_t row = 0; row < mean.numel(); ++row) {
      m[row] = s[4 * row];
      r[row] = s[4 * row + 1];
    }
    return {mean, rstd};
  }
  Tensor columns[2];
  for (int64_t column = 0; column < 2; ++column) {
    Box box = Box::of_shape(statistics.shape());
    box.lo[1] = column;
    box.hi[1] = column + 1;
    columns[column] = statistics.view_box(box).contiguous().reshape(shape);
  }
  return {columns[0], columns[1]};
}

/// The statistics [slots, 4] (the columns the backward reads: mean, rstd, count) from the
/// forward's mean and rstd outputs: the same values statistics_of would compute again.
Tensor saved_row_statistics(const NormCall& call, const Shape& x, const OpRecord& record) {
  const Tensor mean = record.outputs[1].to_local(), rstd = record.outputs[2].to_local();
  const int64_t rows = call.g.slots;
  if (mean.is_shape_only() || rstd.is_shape_only())
    return Tensor::empty({rows, 4}, DType::f64, call.device);
  // Every slot's global element count: the reduced dims' extents.
  double count = 1;
  for (size_t d = 0; d < x.size(); ++d)
    if (reduced_dim(call.kind, x, call.attrs, static_cast<int>(d)))
      count *= static_cast<double>(x[d]);
  if (call.kind == NormKind::group) count /= static_cast<double>(call.attrs.groups);
  if (call.device.is_cpu()) {
    const Tensor m = mean.contiguous(), r = rstd.contiguous();
    Tensor statistics = Tensor::empty({rows, 4}, DType::f64);
    double* s = statistics.data<double>();
    const double* mp = m.data<double>();
    const double* rp = r.data<double>();
    for (int64_t row = 0; row < rows; ++row) {
      s[4 * row] = mp[row];
      s[4 * row + 1] = rp[row];
      s[4 * row + 2] = count;
      s[4 * row + 3] = 0;  // M2: not read by the backward
    }
    return statistics;
  }
  Tensor statistics = Tensor::zeros({rows, 4}, DType::f64, call.device);
  if (rows == 0) return statistics;
  Tensor counts = Tensor::zeros({rows, 1}, DType::f64, call.device);
  counts.fill(count);
  const Tensor columns[3] = {mean.reshape({rows, 1}), rstd.reshape({rows, 1}), counts};
  for (int64_t column = 0; column < 3; ++column) {
    Box box = Box::of_shape(statistics.shape());
    box.lo[1] = column;
    box.hi[1] = column + 1;
    statistics.view_box(box).copy_from(columns[column]);
  }
  return statistics;
}

std::optional<Tensor> input_at(const std::vector<Tensor>& inputs, int index) {
  return index < 0 ? std::nullopt : std::optional<Tensor>(inputs[index]);
}

/// dx of the backward (and dw, db into `params`): the local sums, combined over the ranks that
/// share the statistics, then dx.
Tensor backward_dx(const NormCall& call, const DeviceMesh& mesh, const Tensor& x, const Tensor& dy,
                   const Tensor& statistics, const std::optional<Tensor>& w, bool want_dw,
                   bool want_db, NormParamGrads& params) {
  const bool cuda = call.device.is_cuda();
  const Tensor sums =
      cuda ? norm_backward_sums_cuda(call.g, x, dy, statistics, w, want_dw, want_db, params,
                                     call.stream)
           : norm_backward_sums_cpu(call.g, x, dy, statistics, w, want_dw, want_db, params);
  // batch_norm's eval mode normalizes with constants: dx = rstd * dxhat.
  std::optional<Tensor> total;
  if (call.kind != NormKind::batch || call.attrs.training) {
    const Tensor gathered = gather_slots(mesh, call.mesh_dims, sums);
    total = cuda ? norm_sum_ranks_cuda(gathered, call.stream) : norm_sum_ranks_cpu(gathered);
  }
  return cuda ? norm_backward_dx_cuda(call.g, x, dy, statistics, total, w, call.stream)
              : norm_backward_dx_cpu(call.g, x, dy, statistics, total, w);
}

KernelFn kernel_of(NormKind kind) {
  return [kind](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const NormCall call =
        call_of(kind, context.attrs, context.input_specs[0], context.input_boxes[0], inputs.size(),
                context.device, context.stream);
    const bool cuda = call.device.is_cuda();
    const Tensor x = inputs[0].contiguous();
    const Tensor statistics = statistics_of(call, context.mesh, x, inputs);
    std::optional<Tensor> w = input_at(inputs, call.at.w), b = input_at(inputs, call.at.b);
    if (w) w = param_piece(call, *w, context.input_boxes[0]);
    if (b) b = param_piece(call, *b, context.input_boxes[0]);
    std::vector<Tensor> outputs{cuda ? norm_forward_cuda(call.g, x, statistics, w, b, call.stream)
                                     : norm_forward_cpu(call.g, x, statistics, w, b)};
    if (returns_statistics(kind)) {
      auto [mean, rstd] = row_mean_and_rstd(statistics, context.output_boxes[1].shape());
      outputs.push_back(std::move(mean));
      outputs.push_back(std::move(rstd));
    }
    if (kind != NormKind::batch) return outputs;
    // The running statistics: updated in training (from PyTorch's initial 0 and 1 when none were
    // given), passed on in eval.
    const Shape channels{context.input_specs[0].global_shape[1]};
    if (!call.attrs.training) {
      outputs.push_back(inputs[call.at.running_mean].clone());
      outputs.push_back(inputs[call.at.running_var].clone());
      return outputs;
    }
    Tensor mean, var;
    if (call.at.running_mean >= 0) {
      mean = inputs[call.at.running_mean];
      var = inputs[call.at.running_var];
    } else {
      mean = Tensor::zeros(channels, x.dtype(), x.device());
      var = Tensor::zeros(channels, x.dtype(), x.device());
      var.fill(1.0);
    }
    auto [new_mean, new_var] =
        cuda ? norm_update_running_cuda(statistics, mean, var, call.attrs.momentum, call.stream)
             : norm_update_running_cpu(statistics, mean, var, call.attrs.momentum);
    outputs.push_back(new_mean);
    outputs.push_back(new_var);
    return outputs;
  };
}

BackwardFn backward_of(NormKind kind) {
  return [kind](const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads) {
    std::vector<std::optional<ShardTensor>> result(record.inputs.size());
    if (!grads[0]) return result;  // only the running statistics got a gradient
    const ShardTensor& xs = record.inputs[0];
    const ShardSpec& y = record.outputs[0].spec();
    const ShardTensor g =
        grads[0]->spec() == y ? *grads[0] : grads[0]->redistribute(y.placements, y.extents);
    const Device device = xs.device();
    const Box box = xs.local_box();
    const NormCall call = call_of(kind, record.attrs, xs.spec(), box, record.inputs.size(), device,
                                  device.is_cuda() ? compute_stream_for(device) : Stream{});
    const bool cuda = device.is_cuda();
    std::vector<Tensor> locals;
    for (const ShardTensor& input : record.inputs) locals.push_back(input.to_local());
    const Tensor x = record.kernel_inputs[0].contiguous();
    const Tensor dy = g.to_local().contiguous();
    const Tensor statistics = returns_statistics(kind) && record.outputs.size() == 3
                                  ? saved_row_statistics(call, xs.global_shape(), record)
                                  : statistics_of(call, xs.mesh(), x, locals);
    std::optional<Tensor> w = input_at(locals, call.at.w);
    if (w) w = param_piece(call, *w, box);
    NormParamGrads params;
    const bool want_dw = call.at.w >= 0, want_db = call.at.b >= 0;
    // layer_norm with whole rows on this rank: one pass over the rows (same results).
    std::optional<Tensor> rows_dx;
    if (!cuda && kind == NormKind::layer && call.mesh_dims.empty())
      rows_dx = norm_backward_rows_cpu(call.g, x, dy, statistics, w, want_dw, want_db, params);
    const Tensor dx =
        rows_dx ? *rows_dx
                : backward_dx(call, xs.mesh(), x, dy, statistics, w, want_dw, want_db, params);
    result[0] = ShardTensor(dx, xs.mesh(), xs.spec());
    // dw, db: this rank's channels (or normalized box) of a zero tensor of the parameter's
    // shape, Partial(sum) over the mesh dims that shard x.
    const Shape shape = param_shape(kind, xs.global_shape(), call.attrs);
    const auto full_param = [&](const Tensor& piece) {
      Tensor full = Tensor::zeros(shape, piece.dtype(), device);
      Box local = Box::of_shape(shape);
      if (kind == NormKind::layer) {
        const size_t first = box.ndim() - shape.size();
        for (size_t d = 0; d < shape.size(); ++d) {
          local.lo[d] = box.lo[first + d];
          local.hi[d] = box.hi[first + d];
        }
      } else {
        local.lo[0] = box.lo[1];
        local.hi[0] = box.hi[1];
      }
      full.view_box(local).copy_from(piece.reshape(local.shape()));
      return ShardTensor(full, xs.mesh(), partial_over_sharding(xs.spec(), shape));
    };
    if (want_dw) result[call.at.w] = full_param(*params.dw);
    if (want_db) result[call.at.b] = full_param(*params.db);
    return result;
  };
}

OpAttr eps_attr() {
  return OpAttr{.name = "eps",
                .type = AttrType::float_scalar,
                .default_value = 1e-5,
                .doc = "added to the variance"};
}

OpAttrs eps_attrs(double eps) {
  OpAttrs attrs;
  attrs.set("eps", eps);
  return attrs;
}

std::vector<ShardTensor> with_optional(std::vector<ShardTensor> inputs,
                                       const std::optional<ShardTensor>& w,
                                       const std::optional<ShardTensor>& b, const char* op) {
  check_arg(w || !b, op, "b is given without w (inputs are positional)");
  if (w) inputs.push_back(*w);
  if (b) inputs.push_back(*b);
  return inputs;
}

}  // namespace

void register_norm_ops() {
  const auto rule = [](NormKind kind) {
    return [kind](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
      return norm_rule(kind, inputs, attrs);
    };
  };
  const auto def = [&](NormKind kind, const char* summary, std::vector<OpInput> inputs,
                       std::vector<std::string> outputs, std::vector<OpAttr> attrs) {
    return OpDef{.name = name_of(kind),
                 .summary = summary,
                 .inputs = std::move(inputs),
                 .outputs = std::move(outputs),
                 .attrs = std::move(attrs),
                 .rule = rule(kind),
                 .cpu = kernel_of(kind),
                 .cuda = kernel_of(kind),
                 .backward = backward_of(kind),
                 .cost = norm_cost};
  };
  // The kernels gather statistics over the ranks: they run in estimate mode too, shape-only.
  for (NormKind kind : {NormKind::group, NormKind::batch, NormKind::layer, NormKind::instance})
    estimate::run_kernel_in_estimate_mode(name_of(kind));
  const OpInput x{.name = "x"}, w{.name = "w", .optional = true}, b{.name = "b", .optional = true};
  register_op(def(NormKind::group,
                  "group_norm of x [N, C, spatial..] over groups of C/groups channels and the "
                  "spatial dims (+ w, b [C]); also each group's mean and rstd [N, groups] (f64)",
                  {x, w, b}, {"y", "mean", "rstd"},
                  {{.name = "groups",
                    .type = AttrType::int_scalar,
                    .required = true,
                    .doc = "channel groups (a divisor of C)"},
                   eps_attr()}));
  register_op(def(NormKind::batch,
                  "batch_norm of x [N, C, spatial..] over N and the spatial dims (running "
                  "statistics updated in training, used in eval; + w, b [C])",
                  {x,
                   {.name = "running_mean", .optional = true},
                   {.name = "running_var", .optional = true},
                   w,
                   b},
                  {"y", "running_mean", "running_var"},
                  {{.name = "training",
                    .type = AttrType::boolean,
                    .default_value = int64_t{1},
                    .doc = "batch statistics (1) or the running ones (0)"},
                   {.name = "momentum",
                    .type = AttrType::float_scalar,
                    .default_value = 0.1,
                    .doc = "weight of the batch statistics in the running ones"},
                   eps_attr()}));
  register_op(def(NormKind::instance,
                  "instance_norm of x [N, C, spatial..]: each (n, c) over the spatial dims (+ w, "
                  "b [C]); also each plane's mean and rstd [N, C] (f64)",
                  {x, w, b}, {"y", "mean", "rstd"}, {eps_attr()}));
  register_op(
      def(NormKind::layer,
          "layer_norm of x over its trailing normalized_ndim dims (+ w, b of their shape); also "
          "each row's mean and rstd (f64, the normalized dims as 1)",
          {x, w, b}, {"y", "mean", "rstd"},
          {{.name = "normalized_ndim",
            .type = AttrType::int_scalar,
            .default_value = int64_t{1},
            .doc = "trailing dims normalized over"},
           eps_attr()}));
}

ShardTensor group_norm(const ShardTensor& x, int64_t groups, const std::optional<ShardTensor>& w,
                       const std::optional<ShardTensor>& b, double eps) {
  OpAttrs attrs = eps_attrs(eps);
  attrs.set("groups", groups);
  return apply_op("group_norm", with_optional({x}, w, b, "group_norm"), attrs)[0];
}

BatchNormResult batch_norm(const ShardTensor& x, const std::optional<ShardTensor>& running_mean,
                           const std::optional<ShardTensor>& running_var,
                           const std::optional<ShardTensor>& w, const std::optional<ShardTensor>& b,
                           const BatchNormOptions& options) {
  check_arg(running_mean.has_value() == running_var.has_value(), "batch_norm",
            "running_mean and running_var are given together or not at all");
  OpAttrs attrs = eps_attrs(options.eps);
  attrs.set("training", int64_t{options.training ? 1 : 0}).set("momentum", options.momentum);
  std::vector<ShardTensor> inputs{x};
  const bool given = running_mean.has_value();
  if (given) {
    inputs.push_back(*running_mean);
    inputs.push_back(*running_var);
  } else if (w) {
    // Inputs are positional: stand-in running statistics (PyTorch's initial 0 and 1) whose update
    // is dropped.
    check_arg(x.global_shape().size() >= 2, "batch_norm",
              "expected an input [N, C, spatial..(optional)], got shape {}", x.global_shape());
    const Shape channels{x.global_shape()[1]};
    const std::vector<Placement> replicated(x.mesh().ndim(), Placement::replicate());
    Tensor ones = Tensor::zeros(channels, x.dtype(), x.device());
    ones.fill(1.0);
    inputs.push_back(ShardTensor::from_local(Tensor::zeros(channels, x.dtype(), x.device()),
                                             x.mesh(), replicated));
    inputs.push_back(ShardTensor::from_local(ones, x.mesh(), replicated));
  }
  inputs = with_optional(std::move(inputs), w, b, "batch_norm");
  std::vector<ShardTensor> outputs = apply_op("batch_norm", inputs, attrs);
  BatchNormResult result{outputs[0], std::nullopt, std::nullopt};
  if (given) {
    result.running_mean = outputs[1];
    result.running_var = outputs[2];
  }
  return result;
}

ShardTensor instance_norm(const ShardTensor& x, const std::optional<ShardTensor>& w,
                          const std::optional<ShardTensor>& b, double eps) {
  return apply_op("instance_norm", with_optional({x}, w, b, "instance_norm"), eps_attrs(eps))[0];
}

ShardTensor layer_norm(const ShardTensor& x, int64_t normalized_ndim,
                       const std::optional<ShardTensor>& w, const std::optional<ShardTensor>& b,
                       double eps) {
  OpAttrs attrs = eps_attrs(eps);
  attrs.set("normalized_ndim", normalized_ndim);
  return apply_op("layer_norm", with_optional({x}, w, b, "layer_norm"), attrs)[0];
}

}  // namespace tessera::ops
