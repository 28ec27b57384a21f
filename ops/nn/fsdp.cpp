// FullyShardedDataParallel (ops/nn/fsdp.hpp).
#include "ops/nn/fsdp.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "core/agree.hpp"
#include "core/comm/comm.hpp"
#include "core/device_mesh.hpp"
#include "core/trace.hpp"
#include "ops/nn/layers.hpp"

namespace tessera::nn {

namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The layout a parameter gets: Shard(0) over `shard_dim` (0-d parameters stay whole),
/// Replicate on every other mesh dim.
std::vector<Placement> sharded_placements(const ShardTensor& value, int shard_dim) {
  std::vector<Placement> placements(value.placements().size(), Placement::replicate());
  if (!value.global_shape().empty()) placements[shard_dim] = Placement::shard(0);
  return placements;
}

/// Why `module`'s tree cannot be recomputed in backward (nullopt when it can).
std::optional<std::string> recompute_problem(const Module& module, const std::string& path) {
  if (dynamic_cast<const Dropout*>(&module))
    return fmt::format("layer '{}' is a Dropout, whose forward changes its state", path);
  const auto buffers = module.named_buffers();
  if (!buffers.empty())
    return fmt::format("layer '{}' keeps buffers ('{}') that its forward may update", path,
                       buffers.front().first);
  for (const auto& [name, child] : module.named_children())
    if (auto problem = recompute_problem(*child, path + "." + name)) return problem;
  return std::nullopt;
}

}  // namespace

struct FullyShardedDataParallel::State {
  /// A unit: one layer of the model and its parameters.
  struct Unit {
    std::string name;
    std::shared_ptr<Module> module;
    std::vector<Parameter> parameters;
  };
  /// One unit's parameters being gathered (or gathered): full buffers and the collectives.
  struct Gather {
    std::vector<Tensor> full;  // per parameter: the full tensor (filled once wait() returned)
    std::vector<std::unique_ptr<PendingCollective>> pending;
    std::shared_ptr<Comm> comm;  // kept alive while in flight
  };

  DeviceMesh mesh;
  FsdpOptions options;
  int shard_dim = 0;
  std::vector<int> batch_dims;
  std::shared_ptr<Sequential> model;
  std::vector<Unit> units;
  std::vector<std::optional<Gather>> gathers;  // per unit: started and not yet taken
  std::vector<std::shared_ptr<const OpDef>> unit_ops;
  FsdpStats stats;
  int64_t gathered_alive = 0;  // bytes of gathered parameters held now

  explicit State(const DeviceMesh& mesh) : mesh(mesh) {}

  /// Starts gathering unit `u`'s parameters (nothing if already started). Every rank starts the
  /// same gathers in the same order.
  void start_gather(size_t u) {
    if (gathers[u]) return;
    NoGrad plain;
    Gather gather;
    gather.comm = mesh.sub_comm({shard_dim});
    for (const Parameter& parameter : units[u].parameters) {
      const ShardTensor& value = parameter.stored();
      const Tensor& local = value.to_local();
      Tensor full = Tensor::empty(value.global_shape(), value.dtype(), value.device());
      if (value.placements()[shard_dim].is_shard()) {
        std::vector<size_t> counts;
        const int64_t row = value.global_shape().empty()
                                ? 1
                                : shape_numel(value.global_shape()) / value.global_shape()[0];
        for (int64_t extent : value.spec().extents[shard_dim])
          counts.push_back(static_cast<size_t>(extent * row));
        // Shard(0) of a row-major tensor: the rank-ordered concatenation is the full tensor.
        gather.pending.push_back(
            gather.comm->start_all_gather_v(local.comm_data(), static_cast<size_t>(local.numel()),
                                            full.comm_data(), counts, value.dtype()));
      } else {
        full.copy_from(local);
        gather.pending.push_back(nullptr);
      }
      stats.bytes_gathered += static_cast<int64_t>(full.nbytes());
      gathered_alive += static_cast<int64_t>(full.nbytes());
      gather.full.push_back(std::move(full));
    }
    stats.max_gathered_bytes = std::max(stats.max_gathered_bytes, gathered_alive);
    ++stats.gathers;
    gathers[u] = std::move(gather);
  }

  /// Unit `u`'s full parameters (replicated ShardTensors, each a fresh tensor requiring a
  /// gradient), gathered now unless a prefetch started it.
  std::vector<ShardTensor> take_gather(size_t u) {
    start_gather(u);
    Gather gather = std::move(*gathers[u]);
    gathers[u].reset();
    const double start = seconds_now();
    for (auto& pending : gather.pending)
      if (pending) pending->wait();
    stats.wait_seconds += seconds_now() - start;
    std::vector<ShardTensor> full;
    const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
    for (size_t i = 0; i < gather.full.size(); ++i) {
      const Parameter& parameter = units[u].parameters[i];
      ShardTensor value(
          gather.full[i], parameter.stored().mesh(),
          ShardSpec::make(parameter.stored().global_shape(), mesh.shape(), replicated, {}, "fsdp"));
      value.set_requires_grad(true);
      full.push_back(std::move(value));
    }
    return full;
  }

  /// Forgets the gathered bytes of a unit whose full parameters were dropped.
  void release(const std::vector<ShardTensor>& full) {
    for (const ShardTensor& value : full)
      gathered_alive -= static_cast<int64_t>(value.to_local().nbytes());
  }

  /// Waits for gathers nobody took (a backward that stopped before reaching their unit).
  void drain() {
    for (auto& gather : gathers)
      if (gather) {
        for (auto& pending : gather->pending)
          if (pending) pending->wait();
        for (const Tensor& full : gather->full)
          gathered_alive -= static_cast<int64_t>(full.nbytes());
        gather.reset();
      }
  }

  /// The unit with parameters that runs after (step +1) or before (step -1) unit `u`.
  std::optional<size_t> neighbour(size_t u, int step) const {
    for (int64_t k = static_cast<int64_t>(u) + step;
         k >= 0 && k < static_cast<int64_t>(units.size()); k += step)
      if (!units[static_cast<size_t>(k)].parameters.empty()) return static_cast<size_t>(k);
    return std::nullopt;
  }

  /// The first unit with parameters.
  std::optional<size_t> first_with_parameters() const {
    for (size_t u = 0; u < units.size(); ++u)
      if (!units[u].parameters.empty()) return u;
    return std::nullopt;
  }

  /// Runs unit `u` on `x` with its parameters' compute values set to `full`.
  ShardTensor run_unit(size_t u, const ShardTensor& x, const std::vector<ShardTensor>& full) {
    std::vector<Parameter>& parameters = units[u].parameters;
    for (size_t i = 0; i < parameters.size(); ++i) parameters[i].set_compute_value(full[i]);
    try {
      ShardTensor y = units[u].module->forward(x);
      for (Parameter& parameter : parameters) parameter.set_compute_value(std::nullopt);
      return y;
    } catch (...) {
      for (Parameter& parameter : parameters) parameter.set_compute_value(std::nullopt);
      throw;
    }
  }

  /// Backward of unit `u`: gather again, recompute the forward on an inner tape from the saved
  /// input, reduce the parameter gradients into the shards, return the input's gradient.
  std::optional<ShardTensor> unit_backward(size_t u, const ShardTensor& input,
                                           const ShardTensor& output_grad) {
    std::vector<ShardTensor> full = take_gather(u);
    if (options.prefetch)
      if (auto previous = neighbour(u, -1)) start_gather(*previous);
    // A fresh leaf over the saved input's storage: hooks on the outer tensor must not fire here.
    ShardTensor x(input.to_local(), input.mesh(), input.spec());
    x.set_requires_grad(input.requires_grad());
    std::vector<GradHookHandle> sinks;
    for (size_t i = 0; i < full.size(); ++i)
      sinks.push_back(set_grad_sink(full[i].id(), [this, u, i](const ShardTensor& grad) {
        NoGrad plain;
        Parameter& parameter = units[u].parameters[i];
        const ShardTensor& shard = parameter.stored();
        const double start = seconds_now();
        // Reduce-scatter over shard_dim, all-reduce over the other dims that hold partial sums.
        parameter.accumulate_grad(grad.redistribute_to(shard.spec()));
        stats.wait_seconds += seconds_now() - start;
        ++stats.gradient_reductions;
        stats.bytes_reduced += static_cast<int64_t>(grad.to_local().nbytes());
      }));
    std::optional<ShardTensor> input_grad;
    {
      Tape tape;
      const ShardTensor y = run_unit(u, x, full);
      tape.backward(y, output_grad);
      if (x.requires_grad()) input_grad = tape.grad(x);
    }
    release(full);
    return input_grad;
  }

  /// The op recorded for unit `u`: its backward is unit_backward (the state must outlive the
  /// tape's backward pass).
  std::shared_ptr<const OpDef> make_unit_op(size_t u, std::weak_ptr<State> weak) {
    return std::make_shared<const OpDef>(OpDef{
        .name = "fsdp_unit",
        .summary = "A layer of a fully sharded model, recomputed in backward (not registered)",
        .backward = [weak, u](const OpRecord& record,
                              const std::vector<std::optional<ShardTensor>>& grads)
            -> std::vector<std::optional<ShardTensor>> {
          auto state = weak.lock();
          check_arg(state != nullptr, "fsdp",
                    "backward through a fully sharded model that no longer exists");
          if (!grads[0]) return {std::nullopt};
          return {state->unit_backward(u, record.inputs[0], *grads[0])};
        }});
  }
};

FullyShardedDataParallel::FullyShardedDataParallel(const DeviceMesh& mesh,
                                                   std::shared_ptr<Sequential> model,
                                                   FsdpOptions options)
    : state_(std::make_shared<State>(mesh)) {
  State& state = *state_;
  check_arg(model != nullptr, "fsdp", "no model to shard");
  state.options = options;
  state.model = model;
  if (!state.options.batch_dims)
    state.options.batch_dims = std::vector<std::string>{options.shard_dim};
  // Every check reads what every rank holds alike, except the meshes' communicators: decided
  // together, before any parameter moves.
  std::optional<std::string> error;
  auto dim_of = [&](const std::string& name, const std::string& role) -> int {
    for (int m = 0; m < mesh.ndim(); ++m)
      if (mesh.names()[m] == name) return m;
    if (!error)
      error =
          fmt::format("the {} '{}' is not a dim of the mesh (dims {})", role, name, mesh.names());
    return -1;
  };
  state.shard_dim = dim_of(state.options.shard_dim, "shard dim");
  for (const std::string& name : *state.options.batch_dims)
    state.batch_dims.push_back(dim_of(name, "batch dim"));
  for (const auto& [name, layer] : model->named_children()) {
    State::Unit unit{name, layer, layer->parameters()};
    for (const auto& [path, parameter] : layer->named_parameters()) {
      const ShardTensor& value = parameter.stored();
      const DeviceMesh& on = value.mesh();
      if (!error && (on.shape() != mesh.shape() || on.names() != mesh.names() ||
                     &on.comm().underlying() != &mesh.comm().underlying()))
        error = fmt::format("parameter '{}.{}' lives on {}, not on the sharding mesh {}", name,
                            path, on.str(), mesh.str());
      bool replicated = true;
      for (const Placement& placement : value.placements())
        replicated = replicated && placement.is_replicate();
      if (!error && !replicated)
        error = fmt::format(
            "parameter '{}.{}' has the layout {}: only replicated parameters are "
            "sharded",
            name, path, value.spec().str());
    }
    if (!error && !unit.parameters.empty())
      if (auto problem = recompute_problem(*layer, name))
        error = fmt::format("{}: layers with parameters are recomputed in backward", *problem);
    state.units.push_back(std::move(unit));
  }
  agree_on_error(mesh.comm(), "fsdp", error);
  for (State::Unit& unit : state.units)
    for (Parameter& parameter : unit.parameters)
      parameter.reshard(sharded_placements(parameter.stored(), state.shard_dim));
  state.gathers.resize(state.units.size());
  for (size_t u = 0; u < state.units.size(); ++u)
    state.unit_ops.push_back(state.make_unit_op(u, state_));
  // The model's keys: "<layer>.<parameter>", as the plain model's state_dict has them.
  for (const auto& [name, layer] : model->named_children()) add_module(name, layer);
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  try {
    state_->drain();
  } catch (...) {  // a failed wait while unwinding: the error is lost
  }
}

ShardTensor FullyShardedDataParallel::forward(const ShardTensor& x) {
  State& state = *state_;
  trace::Span span("fsdp", "fsdp forward");
  // The batch split evenly over the batch dims (decided from the global layout: the same on
  // every rank).
  for (size_t b = 0; b < state.batch_dims.size(); ++b) {
    const int m = state.batch_dims[b];
    const std::string& name = (*state.options.batch_dims)[b];
    TESSERA_CHECK_ARG(m < static_cast<int>(x.placements().size()) && x.placements()[m].is_shard() &&
                          x.placements()[m].dim == 0,
                      "fsdp",
                      "the input {} is not split along its batch (dim 0) over the batch dim '{}'",
                      x.spec().str(), name);
    const auto& extents = x.spec().extents[m];
    check_arg(std::all_of(extents.begin(), extents.end(),
                          [&](int64_t extent) { return extent == extents.front(); }),
              "fsdp",
              "the batch of {} samples is not split evenly over the batch dim '{}' ({} ranks, "
              "extents {})",
              x.global_shape()[0], name, extents.size(), extents);
  }
  state.drain();
  Tape* tape = Tape::active();
  ShardTensor h = x;
  if (auto first = state.first_with_parameters()) state.start_gather(*first);
  for (size_t u = 0; u < state.units.size(); ++u) {
    if (state.units[u].parameters.empty()) {  // recorded on the tape as it is
      h = state.units[u].module->forward(h);
      continue;
    }
    if (state.options.prefetch)
      if (auto next = state.neighbour(u, +1)) state.start_gather(*next);
    std::vector<ShardTensor> full = state.take_gather(u);
    ShardTensor y = [&] {
      NoGrad plain;  // the unit's activations go as it finishes: backward recomputes them
      return state.run_unit(u, h, full);
    }();
    state.release(full);
    full.clear();
    if (tape) {
      y.set_requires_grad(true);
      tape->record(OpRecord{state.unit_ops[u], {}, {}, {h}, {}, {}, {y}});
    }
    h = std::move(y);
  }
  return h;
}

FsdpStats FullyShardedDataParallel::stats() const {
  return state_->stats;
}

int64_t FullyShardedDataParallel::gathered_bytes_bound() const {
  const State& state = *state_;
  std::vector<int64_t> bytes;
  for (const State::Unit& unit : state.units) {
    if (unit.parameters.empty()) continue;
    int64_t total = 0;
    for (const Parameter& parameter : unit.parameters)
      total += shape_numel(parameter.stored().global_shape()) *
               static_cast<int64_t>(dtype_size(parameter.stored().dtype()));
    bytes.push_back(total);
  }
  int64_t bound = bytes.empty() ? 0 : bytes.front();
  for (size_t k = 1; k < bytes.size(); ++k) bound = std::max(bound, bytes[k - 1] + bytes[k]);
  return bound;
}

}  // namespace tessera::nn
