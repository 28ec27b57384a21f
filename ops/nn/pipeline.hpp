// Pipeline parallelism over a mesh dim the caller names (default "pp"), outermost as torchtitan
// puts it: the model's layers are split into stages at boundaries the caller gives, and stage s
// lives on the slice of ranks whose pp coordinate holds it (the other mesh dims: dp, tp, domain),
// which build and hold only that stage's layers and parameters. Each step splits the batch into
// micro-batches, runs their forwards and backwards under a schedule (GPipe, 1F1B, interleaved
// 1F1B; ops/nn/pipeline_schedule.hpp) and moves activations and gradients between the stages'
// slices point to point (ops/nn/stage_transfer.hpp), each stage taking its input in the layout
// it names. Every micro-batch's loss is scaled by 1/M, so the gradients accumulated over the
// micro-batches are those of the loss over the whole batch (for a loss that is a mean over its
// micro-batch, like mse_loss): the step trains what the unpipelined model trains.
//
//   DeviceMesh mesh(world, {2, 2, 2, 2}, {"pp", "dp", "tp", "domain"});
//   std::vector<nn::LayerBuilder> layers{ /* one builder per layer, given its stage's mesh */ };
//   nn::Pipeline pipe(mesh, layers, {.stage_starts = {0, 3}, .micro_batches = 4,
//                                    .input_placements = {{}, {S(0), R, S(1)}}});
//   nn::GradReducer reducer(pipe.parameters());  // dp: this rank's stages (or FSDP: wrap_stage)
//   pipe.set_grad_reducer(&reducer);              // one reduction per step, not per micro-batch
//   optim::AdamW adam(pipe.parameters(), {.lr = 1e-3});
//   for (...) {
//     adam.zero_grad();
//     const double loss = pipe.step(x, target);  // x on stage 0's ranks, target on the last's
//     reducer.finish();
//     adam.step();
//   }
//
// Order of wrapping (as torchtitan): the pipeline split first, then tensor parallelism (the
// layer builders make tp layers on the stage's mesh), then data parallelism over each stage
// (a GradReducer over parameters(), or FSDP through wrap_stage). The model's code does not change.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops/nn/module.hpp"
#include "ops/nn/pipeline_schedule.hpp"

namespace tessera::nn {

class GradReducer;

/// Builds one layer of the model on `mesh`, the mesh of the stage that holds the layer.
using LayerBuilder = std::function<std::shared_ptr<Module>(const DeviceMesh& mesh)>;

/// Wraps the layers of one stage (a Sequential on the stage's mesh) into the module the stage
/// runs, e.g. FSDP over the stage's dp dim.
using StageWrapper =
    std::function<std::shared_ptr<Module>(const DeviceMesh& mesh, std::shared_ptr<Sequential>)>;

/// The loss of one micro-batch from the last stage's output and the target.
using PipelineLoss =
    std::function<ShardTensor(const ShardTensor& output, const ShardTensor& target)>;

struct PipelineOptions {
  std::string dim = "pp";  ///< the mesh dim the stages are placed along
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int micro_batches = 1;  ///< M: each step's batch split into M equal micro-batches
  int batch_dim = 0;      ///< the tensor dim of input and target that the micro-batches split
  /// Stage s holds layers [stage_starts[s], stage_starts[s + 1]) (the last: to the end); one
  /// entry per stage: the pp size, or a multiple of it (at least 2 per rank) for interleaved.
  /// Empty: one stage per pp rank, the layers split as evenly as they go.
  std::vector<int> stage_starts{};
  /// The layout stage s wants its input in, on its own mesh (one placement per mesh dim, no
  /// Partial); empty (or an empty entry): the layout the previous stage's output has.
  std::vector<std::vector<Placement>> input_placements{};
  /// Wraps each stage's layers after they are built (FSDP over dp); empty: the Sequential.
  StageWrapper wrap_stage{};
};

/// What this rank's pipeline did in its last step (times on this rank).
struct PipelineStats {
  int64_t steps = 0;           ///< steps since construction
  int max_in_flight = 0;       ///< most micro-batches alive at once (forward run, backward not)
  double step_seconds = 0;     ///< the schedule's wall time, first action to last send done
  double busy_seconds = 0;     ///< of which computing (stage forwards and backwards with their
                               ///< collectives), not waiting for another stage
  int64_t bytes_sent = 0;      ///< activation and gradient bytes sent to other stages
  int64_t bytes_received = 0;  ///< activation and gradient bytes received from other stages
  /// 1 - busy / wall: the share of the step this rank waited.
  double bubble_fraction() const { return step_seconds > 0 ? 1 - busy_seconds / step_seconds : 0; }
};

class Pipeline {
 public:
  /// Collective over `mesh`: checks the options (the same error on every rank, before anything
  /// is built: a missing pp dim, stages that do not cover the layers, a stage count the schedule
  /// cannot run, bad input layouts), makes this rank's stage mesh, and builds only the layers of
  /// the stages this rank holds.
  Pipeline(const DeviceMesh& mesh, std::vector<LayerBuilder> layers, PipelineOptions options = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// This rank's stage mesh: the ranks at its pp coordinate, over the other mesh dims (a mesh of
  /// the pp dim alone gives one-rank stage meshes with that dim, of size 1).
  const DeviceMesh& stage_mesh() const;
  /// The stages this rank holds, in chunk order (one unless interleaved).
  std::vector<int> stages() const;
  /// Whether this rank holds the first stage (takes the input) or the last (takes the target).
  bool holds_first_stage() const;
  bool holds_last_stage() const;
  /// The parameters of this rank's stages, in layer order.
  std::vector<Parameter> parameters() const;
  /// The same with the unpipelined model's keys ("<layer index>.<name>", as a Sequential of
  /// every layer names them).
  std::vector<std::pair<std::string, Parameter>> named_parameters() const;

  /// Reduces data-parallel gradients once per step: the pipeline turns the reducer's sync off
  /// for every backward of a step but the last on this rank (null: none). Call reducer->finish()
  /// after step().
  void set_grad_reducer(GradReducer* reducer);

  /// Collective over the mesh: one step's forwards and backwards of every micro-batch under the
  /// schedule, the gradients accumulated into the parameters (scaled so they are the whole
  /// batch's). `input`: the batch on stage_mesh() where this rank holds the first stage,
  /// `target` where it holds the last (elsewhere ignored, may be nullopt). Returns the loss of
  /// the whole batch (the mean of the micro-batches' losses) on every rank. Missing data, a batch
  /// dim the micro-batches do not split evenly on every rank's piece, or data on another mesh is
  /// one error on every rank before anything moves.
  double step(const std::optional<ShardTensor>& input, const std::optional<ShardTensor>& target,
              const PipelineLoss& loss = {});

  /// The last step's figures.
  PipelineStats stats() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace tessera::nn
