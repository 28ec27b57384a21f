// GradReducer (ops/nn/data_parallel.hpp).
#include "ops/nn/data_parallel.hpp"

#include <algorithm>
#include <optional>
#include <utility>

#include "core/comm/comm.hpp"
#include "core/device_mesh.hpp"
#include "core/trace.hpp"

namespace tessera::nn {

namespace {

/// The mesh dims a gradient is Partial over, and their one reduce op (nullopt when the dims
/// mix ops: such a gradient is reduced on its own, through redistribute).
struct PartialDims {
  std::vector<int> dims;
  std::optional<ReduceOp> op;
};

PartialDims partial_dims_of(const ShardTensor& grad) {
  PartialDims partial;
  for (int m = 0; m < static_cast<int>(grad.placements().size()); ++m) {
    const Placement& placement = grad.placements()[m];
    if (!placement.is_partial()) continue;
    if (partial.dims.empty()) partial.op = placement.reduce;
    if (partial.op != placement.reduce) partial.op.reset();
    partial.dims.push_back(m);
  }
  if (!partial.dims.empty() && partial.op && *partial.op != ReduceOp::sum &&
      *partial.op != ReduceOp::avg)
    partial.op.reset();
  return partial;
}

/// The layout of `grad` once its Partial dims are reduced: Replicate there.
ShardSpec reduced_spec(const ShardTensor& grad) {
  ShardSpec spec = grad.spec();
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_partial()) {
      spec.placements[m] = Placement::replicate();
      spec.extents[m].clear();
    }
  return spec;
}

}  // namespace

struct GradReducer::State {
  struct Bucket {
    std::vector<size_t> members;
    size_t received = 0;   // members whose gradient of this round arrived
    bool started = false;  // its collective of this round is in flight
  };
  /// One collective in flight: the flat buffer of its members' gradients.
  struct InFlight {
    std::vector<size_t> members;
    std::vector<ShardSpec> specs;  // each member's reduced layout
    std::vector<Shape> shapes;     // each member's local shape
    Tensor flat;
    std::unique_ptr<PendingCollective> pending;
    std::shared_ptr<Comm> comm;  // kept alive while in flight
  };

  ReducerOptions options;
  std::vector<Parameter> parameters;
  std::vector<GradHookHandle> sinks;
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;
  std::vector<std::optional<ShardTensor>> pending;    // unreduced gradients, summed locally
  std::vector<bool> received;                         // this round, per parameter
  std::vector<InFlight> in_flight;                    // in start order
  std::vector<std::pair<size_t, ShardTensor>> ready;  // reduced without a bucket collective
  bool sync = true;
  ReducerStats stats;

  void receive(size_t index, const ShardTensor& grad) {
    NoGrad plain;
    pending[index] = pending[index] ? add_same_shape(*pending[index], grad) : grad;
    if (!sync || received[index]) return;
    received[index] = true;
    Bucket& bucket = buckets[bucket_of[index]];
    ++bucket.received;
    if (options.overlap && !bucket.started && bucket.received == bucket.members.size()) {
      start(bucket.members);
      bucket.started = true;
    }
  }

  /// Starts the reduction of the members with a pending gradient: one collective per group of
  /// members that are Partial over the same mesh dims with the same op, dtype and device.
  void start(const std::vector<size_t>& members) {
    NoGrad plain;
    struct Group {
      std::vector<int> dims;
      ReduceOp op;
      DType dtype;
      Device device;
      const Comm* mesh_comm;
      std::vector<std::pair<size_t, ShardTensor>> grads;  // parameter index, unreduced gradient
    };
    std::vector<Group> groups;
    for (size_t index : members) {
      if (!pending[index]) continue;
      ShardTensor grad = std::move(*pending[index]);
      pending[index].reset();
      const PartialDims partial = partial_dims_of(grad);
      if (partial.dims.empty()) {  // nothing to reduce
        ready.emplace_back(index, std::move(grad));
        continue;
      }
      if (!partial.op) {  // mixed reductions: the generic path, on its own
        ready.emplace_back(index, grad.redistribute_to(parameters[index].tensor().spec()));
        continue;
      }
      const Tensor& local = grad.to_local();
      const Comm* mesh_comm = &grad.mesh().comm();
      auto group = std::find_if(groups.begin(), groups.end(), [&](const Group& g) {
        return g.dims == partial.dims && g.op == *partial.op && g.dtype == local.dtype() &&
               g.device == local.device() && g.mesh_comm == mesh_comm;
      });
      if (group == groups.end()) {
        groups.push_back({partial.dims, *partial.op, local.dtype(), local.device(), mesh_comm, {}});
        group = std::prev(groups.end());
      }
      group->grads.emplace_back(index, std::move(grad));
    }
    for (const Group& group : groups) {
      InFlight flight;
      int64_t total = 0;
      for (const auto& [index, grad] : group.grads) total += grad.to_local().numel();
      flight.flat = Tensor::empty({total}, group.dtype, group.device);
      int64_t offset = 0;
      for (const auto& [index, grad] : group.grads) {
        const Tensor& local = grad.to_local();
        flight.flat.slice(0, offset, offset + local.numel())
            .reshape(local.shape())
            .copy_from(local);
        offset += local.numel();
        flight.members.push_back(index);
        flight.specs.push_back(reduced_spec(grad));
        flight.shapes.push_back(local.shape());
      }
      flight.comm = group.grads.front().second.mesh().sub_comm(group.dims);
      flight.pending =
          flight.comm->start_all_reduce(flight.flat.comm_data(), flight.flat.comm_data(),
                                        static_cast<size_t>(total), group.dtype, group.op);
      ++stats.collectives;
      stats.bytes_reduced += static_cast<int64_t>(flight.flat.nbytes());
      in_flight.push_back(std::move(flight));
    }
  }
};

GradReducer::GradReducer(std::vector<Parameter> parameters, ReducerOptions options)
    : state_(std::make_unique<State>()) {
  State& state = *state_;
  state.options = options;
  state.parameters = std::move(parameters);
  const size_t count = state.parameters.size();
  state.pending.resize(count);
  state.received.assign(count, false);
  state.bucket_of.assign(count, 0);
  for (const Parameter& parameter : state.parameters)
    check_arg(parameter.defined(), "reducer", "an undefined parameter cannot be reduced");
  // Buckets in the reverse of the parameters' order (backward finalizes the last layers first);
  // a bucket holds one dtype on one device and at most bucket_bytes (or one parameter).
  size_t bytes = 0;
  for (size_t k = count; k-- > 0;) {
    const Tensor local = state.parameters[k].tensor().to_local();
    bool fresh = state.buckets.empty() || bytes + local.nbytes() > state.options.bucket_bytes;
    if (!fresh) {
      const Tensor first =
          state.parameters[state.buckets.back().members.front()].tensor().to_local();
      fresh = first.dtype() != local.dtype() || first.device() != local.device();
    }
    if (fresh) {
      state.buckets.emplace_back();
      bytes = 0;
    }
    state.buckets.back().members.push_back(k);
    state.bucket_of[k] = state.buckets.size() - 1;
    bytes += local.nbytes();
  }
  State* raw = state_.get();
  for (size_t k = 0; k < count; ++k)
    state.sinks.push_back(
        set_grad_sink(state.parameters[k].tensor().id(),
                      [raw, k](const ShardTensor& grad) { raw->receive(k, grad); }));
}

GradReducer::~GradReducer() = default;

void GradReducer::finish() {
  State& state = *state_;
  if (!state.sync) return;  // accumulating without communication
  trace::Span span("comm", "gradient reducer finish");
  NoGrad plain;
  // Buckets with gradients not started yet (unused parameters, overlap off, or gradients that
  // arrived after their bucket started), in bucket order: the same on every rank.
  for (State::Bucket& bucket : state.buckets) {
    state.start(bucket.members);
    bucket.received = 0;
    bucket.started = false;
  }
  std::fill(state.received.begin(), state.received.end(), false);
  const bool reduced_any = !state.in_flight.empty() || !state.ready.empty();
  for (State::InFlight& flight : state.in_flight) {
    flight.pending->wait();
    int64_t offset = 0;
    for (size_t i = 0; i < flight.members.size(); ++i) {
      const int64_t numel = shape_numel(flight.shapes[i]);
      const Tensor local = flight.flat.slice(0, offset, offset + numel).reshape(flight.shapes[i]);
      offset += numel;
      Parameter& parameter = state.parameters[flight.members[i]];
      parameter.accumulate_grad(ShardTensor(local, parameter.tensor().mesh(), flight.specs[i]));
    }
  }
  state.in_flight.clear();
  for (auto& [index, grad] : state.ready) state.parameters[index].accumulate_grad(grad);
  state.ready.clear();
  if (reduced_any) ++state.stats.backward_passes;
}

void GradReducer::set_sync(bool sync) {
  state_->sync = sync;
}

ReducerStats GradReducer::stats() const {
  return state_->stats;
}

std::vector<std::vector<size_t>> GradReducer::buckets() const {
  std::vector<std::vector<size_t>> result;
  for (const State::Bucket& bucket : state_->buckets) result.push_back(bucket.members);
  return result;
}

}  // namespace tessera::nn
