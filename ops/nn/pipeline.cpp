// Pipeline parallelism (ops/nn/pipeline.hpp).
#include "ops/nn/pipeline.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include "core/agree.hpp"
#include "core/autograd.hpp"
#include "core/trace.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/stage_transfer.hpp"
#include "ops/ops.hpp"

namespace tessera::nn {

namespace {

// Boundary b (stage b -> b + 1) uses tags kTagBase + 4b .. + 4b + 3 on the mesh's communicator,
// apart from the tags other layers use there (0).
constexpr int kTagBase = 20000;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// The first layer of each of `stages` stages over `layers` layers, split as evenly as they go.
std::vector<int> even_stage_starts(int layers, int stages) {
  std::vector<int> starts;
  for (int s = 0; s < stages; ++s)
    starts.push_back(static_cast<int>(static_cast<int64_t>(s) * layers / stages));
  return starts;
}

/// What is wrong with the options for `mesh` and `layers` layers, or nullopt. Every rank finds
/// the same (the options and the mesh are the same everywhere).
std::optional<std::string> options_problem(const DeviceMesh& mesh, int layers,
                                           const PipelineOptions& options) {
  const auto& names = mesh.names();
  const auto dim = std::find(names.begin(), names.end(), options.dim);
  if (dim == names.end())
    return fmt::format("no mesh dim named '{}' to place the stages along (the mesh has {})",
                       options.dim, names);
  const int pp_size = mesh.size(static_cast<int>(dim - names.begin()));
  if (layers < 1) return std::string("a model without layers");
  const int stages = static_cast<int>(options.stage_starts.size());
  if (stages > 0) {
    if (options.stage_starts[0] != 0)
      return fmt::format("stages starting at layers {}: layers before {} belong to no stage",
                         options.stage_starts, options.stage_starts[0]);
    for (int s = 1; s < stages; ++s)
      if (options.stage_starts[s] <= options.stage_starts[s - 1])
        return fmt::format("stages starting at layers {}: stage {} holds no layer",
                           options.stage_starts, s - 1);
    if (options.stage_starts.back() >= layers)
      return fmt::format(
          "stages starting at layers {} for a model of {} layers: stage {} holds "
          "no layer",
          options.stage_starts, layers, stages - 1);
  }
  const int stage_count =
      stages > 0 ? stages
                 : (options.schedule == PipelineSchedule::interleaved ? 2 * pp_size : pp_size);
  if (stages == 0 && layers < stage_count)
    return fmt::format("{} layers for {} stages", layers, stage_count);
  if (auto problem =
          schedule_problem(options.schedule, pp_size, stage_count, options.micro_batches))
    return problem;
  if (options.batch_dim < 0) return fmt::format("batch dim {}", options.batch_dim);
  const int stage_dims = std::max(1, mesh.ndim() - 1);
  const auto& placements = options.input_placements;
  if (!placements.empty() && static_cast<int>(placements.size()) != stage_count)
    return fmt::format("input placements for {} stages, the pipeline has {}", placements.size(),
                       stage_count);
  for (size_t s = 0; s < placements.size(); ++s) {
    if (placements[s].empty()) continue;
    if (s == 0) return std::string("input placements for stage 0 (it takes the input as given)");
    if (static_cast<int>(placements[s].size()) != stage_dims)
      return fmt::format("{} input placements for stage {}, whose mesh has {} dims",
                         placements[s].size(), s, stage_dims);
    for (const Placement& placement : placements[s])
      if (placement.is_partial())
        return fmt::format("a Partial input placement for stage {} (stages exchange whole values)",
                           s);
  }
  return std::nullopt;
}

/// The problem with `data` (the input or the target) for a step of `micro_batches`, or nullopt.
std::optional<std::string> data_problem(const std::optional<ShardTensor>& data,
                                        const std::string& what, const DeviceMesh& stage_mesh,
                                        int batch_dim, int micro_batches) {
  if (!data)
    return fmt::format("no {} on rank {} of the stage that takes it", what, stage_mesh.rank());
  if (data->mesh().shape() != stage_mesh.shape() || data->mesh().names() != stage_mesh.names())
    return fmt::format("the {} on {} (the stage's mesh is {})", what, data->mesh().str(),
                       stage_mesh.str());
  const ShardSpec& spec = data->spec();
  if (batch_dim >= static_cast<int>(spec.global_shape.size()))
    return fmt::format("batch dim {} of a {} of global shape {}", batch_dim, what,
                       spec.global_shape);
  const int mesh_dim = spec.mesh_dim_sharding(batch_dim);
  const std::vector<int64_t> parts =
      mesh_dim >= 0 ? spec.extents[mesh_dim] : std::vector<int64_t>{spec.global_shape[batch_dim]};
  for (int64_t part : parts)
    if (part % micro_batches != 0)
      return fmt::format(
          "{} micro-batches do not divide the {}'s batch (dim {} of global shape {}, pieces {})",
          micro_batches, what, batch_dim, spec.global_shape, parts);
  return std::nullopt;
}

/// The message of `error` without its "[op] " tag.
std::string untagged_message(const Error& error) {
  const std::string text = error.what();
  const std::string tag = fmt::format("[{}] ", error.op());
  return text.rfind(tag, 0) == 0 ? text.substr(tag.size()) : text;
}

/// Collective over the pipeline's mesh: when any rank's stage failed, every rank throws the
/// error of the lowest failing rank, with its own op tag (agree_on_error tags with one op for
/// all, so the op travels as the first line of the text).
void agree_on_stage_error(Comm& comm, const std::optional<StageError>& failure) {
  std::optional<std::string> text;
  if (failure) text = failure->op + "\n" + failure->message;
  try {
    agree_on_error(comm, "pipeline", text);
  } catch (const AgreedError& error) {
    const std::string agreed = untagged_message(error);
    const size_t newline = agreed.find('\n');
    throw AgreedError(agreed.substr(0, newline), agreed.substr(newline + 1));
  }
}

/// Micro-batch `index` of `count` of `data`: the same slice of every rank's piece along
/// `batch_dim` (no data moves; together the micro-batches hold the whole batch once).
ShardTensor micro_batch(const ShardTensor& data, int batch_dim, int index, int count) {
  ShardSpec spec = data.spec();
  spec.global_shape[batch_dim] /= count;
  const int mesh_dim = spec.mesh_dim_sharding(batch_dim);
  if (mesh_dim >= 0)
    for (int64_t& extent : spec.extents[mesh_dim]) extent /= count;
  const int64_t size = data.to_local().shape(batch_dim) / count;
  const Tensor local = data.to_local().slice(batch_dim, index * size, (index + 1) * size);
  return ShardTensor(local.contiguous(), data.mesh(), spec);
}

}  // namespace

struct Pipeline::State {
  DeviceMesh mesh;
  std::optional<DeviceMesh> stage_mesh;
  PipelineOptions options;
  int pp_dim = 0, pp_size = 1, pp_rank = 0;
  int stage_count = 1, chunks = 1;
  struct Chunk {
    int stage = 0;
    std::shared_ptr<Module> module;
    std::vector<std::pair<std::string, Parameter>> parameters;
  };
  std::vector<Chunk> held;                                   // this rank's stages, chunk order
  std::map<int, std::unique_ptr<StageBoundary>> boundaries;  // by sending stage
  GradReducer* reducer = nullptr;
  PipelineStats stats;

  explicit State(const DeviceMesh& world) : mesh(world) {}

  /// The world rank of rank `stage_rank` of the stage mesh at pp coordinate `pp_coord`.
  int world_rank(int pp_coord, int stage_rank) const {
    std::vector<int> coord = coord_of(stage_rank, stage_mesh->shape());
    if (mesh.ndim() == 1)
      coord = {pp_coord};
    else
      coord.insert(coord.begin() + pp_dim, pp_coord);
    return rank_of(coord, mesh.shape());
  }

  const std::vector<Placement>& input_placements(int stage) const {
    static const std::vector<Placement> none;
    return options.input_placements.empty() ? none : options.input_placements[stage];
  }

  int64_t boundary_bytes(bool sent) const {
    int64_t bytes = 0;
    for (const auto& [index, boundary] : boundaries)
      bytes += sent ? boundary->stats().bytes_sent : boundary->stats().bytes_received;
    return bytes;
  }

  double boundary_waits() const {
    double seconds = 0;
    for (const auto& [index, boundary] : boundaries) seconds += boundary->stats().wait_seconds;
    return seconds;
  }
};

Pipeline::Pipeline(const DeviceMesh& mesh, std::vector<LayerBuilder> layers,
                   PipelineOptions options)
    : state_(std::make_unique<State>(mesh)) {
  State& state = *state_;
  const int layer_count = static_cast<int>(layers.size());
  agree_on_error_and_description(
      mesh.comm(), "pipeline", options_problem(mesh, layer_count, options), "options", [&] {
        std::vector<std::string> placements;
        for (const auto& entry : options.input_placements) {
          std::vector<std::string> texts;
          for (const Placement& placement : entry) texts.push_back(placement.str());
          placements.push_back(fmt::format("[{}]", fmt::join(texts, " ")));
        }
        return fmt::format(
            "dim {} schedule {} micro-batches {} batch dim {} layers {} stage "
            "starts {} input placements {}",
            options.dim, schedule_name(options.schedule), options.micro_batches, options.batch_dim,
            layer_count, options.stage_starts, placements);
      });
  state.pp_dim = mesh.dim_index(options.dim);
  state.pp_size = mesh.size(state.pp_dim);
  state.pp_rank = mesh.coord()[state.pp_dim];
  if (options.stage_starts.empty())
    options.stage_starts = even_stage_starts(
        layer_count,
        options.schedule == PipelineSchedule::interleaved ? 2 * state.pp_size : state.pp_size);
  state.stage_count = static_cast<int>(options.stage_starts.size());
  state.chunks = state.stage_count / state.pp_size;
  state.options = std::move(options);

  // The stage mesh: this rank's slice at its pp coordinate (collective over the mesh).
  if (mesh.ndim() == 1) {  // each rank alone, on a mesh of the pp dim of size 1
    state.stage_mesh.emplace(mesh.comm().split(state.pp_rank, 0), std::vector<int>{1},
                             std::vector<std::string>{state.options.dim});
  } else {
    std::vector<int> others;
    for (int m = 0; m < mesh.ndim(); ++m)
      if (m != state.pp_dim) others.push_back(m);
    state.stage_mesh = mesh.submesh(others);
  }

  // Only this rank's stages are built, on its stage mesh.
  const std::vector<int>& starts = state.options.stage_starts;
  for (int chunk = 0; chunk < state.chunks; ++chunk) {
    State::Chunk held;
    held.stage = chunk * state.pp_size + state.pp_rank;
    const int first = starts[held.stage];
    const int stop = held.stage + 1 < state.stage_count ? starts[held.stage + 1] : layer_count;
    auto sequential = std::make_shared<Sequential>();
    for (int layer = first; layer < stop; ++layer)
      sequential->append(layers[layer](*state.stage_mesh));
    held.module = state.options.wrap_stage ? state.options.wrap_stage(*state.stage_mesh, sequential)
                                           : sequential;
    // Keys of the unpipelined Sequential: the stage's layer index shifted by its first layer.
    for (auto& [name, parameter] : held.module->named_parameters()) {
      const size_t dot = name.find('.');
      std::string key = fmt::format("stage{}.{}", held.stage, name);
      if (dot != std::string::npos && dot > 0 && name.find_first_not_of("0123456789") == dot)
        key = fmt::format("{}{}", first + std::stoi(name.substr(0, dot)), name.substr(dot));
      held.parameters.emplace_back(key, parameter);
    }
    state.held.push_back(std::move(held));
  }

  // The boundaries this rank sends or receives on (every rank makes the same ones).
  for (int boundary = 0; boundary + 1 < state.stage_count; ++boundary) {
    const int sender = boundary % state.pp_size, receiver = (boundary + 1) % state.pp_size;
    if (state.pp_rank != sender && state.pp_rank != receiver) continue;
    std::vector<int> sender_ranks, receiver_ranks;
    for (int i = 0; i < state.stage_mesh->size(); ++i) {
      sender_ranks.push_back(state.world_rank(sender, i));
      receiver_ranks.push_back(state.world_rank(receiver, i));
    }
    state.boundaries.emplace(boundary, std::make_unique<StageBoundary>(
                                           mesh.comm_ptr(), std::move(sender_ranks),
                                           std::move(receiver_ranks), kTagBase + 4 * boundary));
  }
}

Pipeline::~Pipeline() = default;

const DeviceMesh& Pipeline::stage_mesh() const {
  return *state_->stage_mesh;
}

std::vector<int> Pipeline::stages() const {
  std::vector<int> stages;
  for (const State::Chunk& held : state_->held) stages.push_back(held.stage);
  return stages;
}

bool Pipeline::holds_first_stage() const {
  return state_->pp_rank == 0;
}

bool Pipeline::holds_last_stage() const {
  return (state_->stage_count - 1) % state_->pp_size == state_->pp_rank;
}

std::vector<Parameter> Pipeline::parameters() const {
  std::vector<Parameter> parameters;
  for (const auto& [name, parameter] : named_parameters()) parameters.push_back(parameter);
  return parameters;
}

std::vector<std::pair<std::string, Parameter>> Pipeline::named_parameters() const {
  // Chunk c holds stage c * p + r: chunk order is layer order.
  std::vector<std::pair<std::string, Parameter>> named;
  for (const State::Chunk& held : state_->held)
    named.insert(named.end(), held.parameters.begin(), held.parameters.end());
  return named;
}

void Pipeline::set_grad_reducer(GradReducer* reducer) {
  state_->reducer = reducer;
}

double Pipeline::step(const std::optional<ShardTensor>& input,
                      const std::optional<ShardTensor>& target, const PipelineLoss& loss) {
  State& state = *state_;
  const PipelineOptions& options = state.options;
  const int micro_batches = options.micro_batches;
  const int last_stage = state.stage_count - 1;
  // Every rank agrees on the data before anything moves.
  std::optional<std::string> problem;
  if (holds_first_stage())
    problem = data_problem(input, "input", *state.stage_mesh, options.batch_dim, micro_batches);
  if (!problem && holds_last_stage())
    problem = data_problem(target, "target", *state.stage_mesh, options.batch_dim, micro_batches);
  agree_on_error(state.mesh.comm(), "pipeline", problem);

  trace::Span span("pipeline", "pipeline step");
  std::vector<ShardTensor> inputs, targets;
  for (int m = 0; m < micro_batches; ++m) {
    if (holds_first_stage())
      inputs.push_back(micro_batch(*input, options.batch_dim, m, micro_batches));
    if (holds_last_stage())
      targets.push_back(micro_batch(*target, options.batch_dim, m, micro_batches));
  }
  const std::vector<PipelineAction> actions =
      schedule_actions(options.schedule, state.pp_size, state.pp_rank, micro_batches, state.chunks);
  size_t last_backward = 0;
  for (size_t i = 0; i < actions.size(); ++i)
    if (actions[i].kind == PipelineAction::Kind::backward) last_backward = i;

  // One tape per (chunk, micro-batch) unit, alive from its forward to its backward.
  struct Unit {
    std::unique_ptr<Tape> tape;
    std::optional<ShardTensor> output;    // the scaled loss, or the send's token (none: failed)
    std::optional<ShardTensor> received;  // the input received from the previous stage
  };
  std::map<std::pair<int, int>, Unit> units;
  const double waits_before = state.boundary_waits();
  const int64_t sent_before = state.boundary_bytes(true);
  const int64_t received_before = state.boundary_bytes(false);
  double loss_sum = 0, compute_seconds = 0;
  int most_alive = 0;
  // An error in a stage (its ops, the loss, or one brought by a transfer) is not thrown at once:
  // the stages around would wait for this rank's data. From then on the rank runs the rest of the
  // schedule's transfers with the error in place of its data (StageBoundary::send_failure, ...),
  // so every stage learns it, and the step ends with one agreed error on every rank. The ops
  // decide their errors collectively, so all ranks of a stage fail at the same action.
  std::optional<StageError> failure;
  const auto fail = [&](const Error& error) {
    if (!failure) failure = StageError{error.op(), untagged_message(error)};
  };
  const auto start = Clock::now();
  for (size_t index = 0; index < actions.size(); ++index) {
    const PipelineAction& action = actions[index];
    const State::Chunk& held = state.held[action.chunk];
    const int stage = held.stage;
    const auto began = Clock::now();
    if (action.kind == PipelineAction::Kind::forward) {
      trace::Span forward_span("pipeline", "stage forward");
      Unit unit{std::make_unique<Tape>(Tape::Idle{}), std::nullopt, std::nullopt};
      TapeScope scope(*unit.tape);
      // The receive runs even after a failure: the previous stage's send waits for it.
      if (stage > 0) {
        try {
          unit.received =
              state.boundaries.at(stage - 1)->receive(*state.stage_mesh, action.micro_batch == 0);
        } catch (const Error& error) {
          fail(error);
        }
      }
      if (!failure) {
        try {
          const ShardTensor x = unit.received ? *unit.received : inputs[action.micro_batch];
          const ShardTensor y = held.module->forward(x);
          if (stage == last_stage) {
            ShardTensor value = loss ? loss(y, targets[action.micro_batch])
                                     : ops::mse_loss(y, targets[action.micro_batch]);
            // The batch's loss is the mean of the micro-batches' means: each counts 1/M.
            if (micro_batches > 1) value = ops::scale(value, 1.0 / micro_batches);
            // Estimate mode: the loss is gathered as in a real run, but has no value (NaN).
            const Tensor full = value.full_tensor();
            loss_sum += full.is_shape_only() ? std::nan("") : full.item_as_double({});
            unit.output = value;
          } else {
            unit.output = state.boundaries.at(stage)->send(y, state.input_placements(stage + 1),
                                                           action.micro_batch == 0);
          }
        } catch (const Error& error) {
          fail(error);
        }
      }
      if (failure && stage != last_stage && !unit.output)
        state.boundaries.at(stage)->send_failure(*failure);
      units.emplace(std::make_pair(action.chunk, action.micro_batch), std::move(unit));
      most_alive = std::max(most_alive, static_cast<int>(units.size()));
    } else {
      trace::Span backward_span("pipeline", "stage backward");
      auto it = units.find({action.chunk, action.micro_batch});
      check_arg(it != units.end(), "pipeline", "a backward of micro-batch {} before its forward",
                action.micro_batch);
      Unit& unit = it->second;
      if (!failure) {
        try {
          // Data-parallel gradients are reduced once, from the step's last backward on this rank.
          if (state.reducer) state.reducer->set_sync(index == last_backward);
          unit.tape->backward(*unit.output);
          if (unit.received) state.boundaries.at(stage - 1)->finish_backward(*unit.received);
        } catch (const Error& error) {
          fail(error);
        }
      }
      if (failure) {
        // Take the gradient the next stage owes for this micro-batch, and owe the previous one
        // the error instead of a gradient (each only if it did not move already).
        if (stage != last_stage) state.boundaries.at(stage)->discard_gradient(unit.output);
        if (stage > 0) state.boundaries.at(stage - 1)->answer_failure(unit.received, *failure);
      }
      units.erase(it);
    }
    compute_seconds += seconds_since(began);
  }
  for (auto& [index, boundary] : state.boundaries) boundary->wait_sends();
  const double wall = seconds_since(start);
  agree_on_stage_error(state.mesh.comm(), failure);

  // Every rank returns the loss, which the last stage's ranks computed.
  state.mesh.dim_comm(options.dim)->broadcast(&loss_sum, 1, DType::f64, last_stage % state.pp_size);
  PipelineStats& stats = state.stats;
  ++stats.steps;
  stats.max_in_flight = most_alive;
  stats.step_seconds = wall;
  // Time blocked on another stage's data is not compute (sends never block).
  stats.busy_seconds = compute_seconds - (state.boundary_waits() - waits_before);
  stats.bytes_sent = state.boundary_bytes(true) - sent_before;
  stats.bytes_received = state.boundary_bytes(false) - received_before;
  return loss_sum;
}

PipelineStats Pipeline::stats() const {
  return state_->stats;
}

}  // namespace tessera::nn
