// Pipeline parallelism (ops/nn/pipeline.hpp): 10 steps (f64) of a pipelined model give the losses
// and final parameters of the unpipelined model on one rank (1e-10 relative) with 2 and 4 stages
// under GPipe, 1F1B and interleaved 1F1B, with and without dp (the reducer, or FSDP per stage);
// the 4-d composition pp x dp x tp x domain (a filter/channel-parallel conv block sharded in space,
// then a tensor-parallel MLP taking another layout) on 16 ranks; every rank keeps at most the
// activations its schedule allows; the bytes sent between stages in a step equal the analytic
// volume; bad input is one error on every rank, and so is an error raised inside one stage.
#include "ops/nn/pipeline.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/tessera.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/fsdp.hpp"
#include "ops/nn/layers.hpp"
#include "ops/nn/tensor_parallel.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"
#include "tests/dist/counting_comm.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"
#include "tests/dist/training_support.hpp"

namespace tessera {
namespace {

using nn::PipelineSchedule;
using testing::values_of;
using P = Placement;

using testing::adamw;
using testing::MakeOptimizer;
using testing::sgd;

/// Builds the model's layers for a tp setting (empty dim: the plain layers).
using ModelLayers = std::function<std::vector<nn::LayerBuilder>(nn::TensorParallelOptions)>;

/// 9 layers on x [B, 6]: Linear 6 -> 8, then (tanh, Linear 8 -> 8) three times, tanh, Linear 8
/// -> 4.
std::vector<nn::LayerBuilder> linear_stack(const nn::TensorParallelOptions&) {
  std::vector<nn::LayerBuilder> layers;
  const std::vector<std::pair<int64_t, int64_t>> sizes{{6, 8}, {8, 8}, {8, 8}, {8, 8}, {8, 4}};
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0)
      layers.push_back([](const DeviceMesh&) { return std::make_shared<nn::Activation>("tanh"); });
    layers.push_back([i, in = sizes[i].first, out = sizes[i].second](const DeviceMesh& mesh) {
      return std::make_shared<nn::Linear>(mesh, in, out, true, 70 + i, DType::f64);
    });
  }
  return layers;
}

/// Stage 0: filter-parallel conv 2 -> 4, tanh, channel-parallel conv 4 -> 2 on x [N, 2, 11, 8];
/// stage 1: a tensor-parallel MLP over the last dim (8 -> 16 -> 8).
std::vector<nn::LayerBuilder> conv_then_mlp(const nn::TensorParallelOptions& tp) {
  auto config = [](int64_t in, int64_t out) {
    return nn::ConvConfig{.in_channels = in, .out_channels = out, .dtype = DType::f64};
  };
  return {[=](const DeviceMesh& mesh) {
            return std::make_shared<nn::FilterParallelConv>(mesh, config(2, 4), 43, tp);
          },
          [](const DeviceMesh&) { return std::make_shared<nn::Activation>("tanh"); },
          [=](const DeviceMesh& mesh) {
            return std::make_shared<nn::ChannelParallelConv>(mesh, config(4, 2), 44, tp);
          },
          [=](const DeviceMesh& mesh) {
            return std::make_shared<nn::ParallelMlp>(mesh, 8, 16, 11, DType::f64, tp);
          }};
}

/// One pipelined run: the mesh, the pipeline, and how the data and gradients are laid out.
struct RunSetup {
  std::vector<int> shape;
  std::vector<std::string> names;
  nn::PipelineOptions options;
  std::vector<Placement> input_placements, target_placements;  ///< on the stage meshes
  nn::TensorParallelOptions tp{.dim = ""};
  enum class Dp { none, reducer, fsdp } dp = Dp::none;
};

struct Data {
  Tensor x, target;
};

/// x and target (small integers / 4).
Data data(const Shape& x_shape, const Shape& target_shape) {
  testing::CaseRng rng(91);
  auto values = [&](const Shape& shape) {
    Tensor t = testing::integer_tensor(shape, DType::f64, rng, -4, 4).to_dtype(DType::f64);
    for (double& v : std::span(t.data<double>(), t.numel())) v /= 4;
    return t;
  };
  return {values(x_shape), values(target_shape)};
}

/// Losses and final parameters by name.
struct TrainingRun {
  std::vector<double> losses;
  std::map<std::string, std::vector<double>> parameters;
  nn::PipelineStats stats;
  std::vector<int> stages;
};

/// The unpipelined model on one rank (plain layers), the whole batch per step.
TrainingRun train_alone(std::shared_ptr<Comm> comm, const ModelLayers& model, const Data& batch,
                        const MakeOptimizer& make, int steps) {
  auto alone = comm->split(comm->rank(), 0);
  DeviceMesh mesh(alone, {1}, {"d"});
  nn::Sequential net;
  for (const nn::LayerBuilder& build : model({.dim = ""})) net.append(build(mesh));
  auto optimizer = make(net.parameters());
  const ShardTensor x = ShardTensor::distribute(batch.x, mesh, {P::replicate()});
  const ShardTensor target = ShardTensor::distribute(batch.target, mesh, {P::replicate()});
  TrainingRun run;
  run.losses = testing::train_steps(net, *optimizer, x, target, steps);
  for (const auto& [name, parameter] : net.named_parameters())
    run.parameters[name] = values_of(parameter.tensor().full_tensor());
  return run;
}

TrainingRun train_pipelined(std::shared_ptr<Comm> comm, const RunSetup& setup,
                            const ModelLayers& model, const Data& batch, const MakeOptimizer& make,
                            int steps) {
  DeviceMesh mesh(comm, setup.shape, setup.names);
  nn::PipelineOptions options = setup.options;
  if (setup.dp == RunSetup::Dp::fsdp)
    options.wrap_stage = [](const DeviceMesh& stage_mesh, std::shared_ptr<nn::Sequential> layers) {
      return std::make_shared<nn::FullyShardedDataParallel>(stage_mesh, layers,
                                                            nn::FsdpOptions{.shard_dim = "dp"});
    };
  nn::Pipeline pipe(mesh, model(setup.tp), options);
  auto optimizer = make(pipe.parameters());
  std::unique_ptr<nn::GradReducer> reducer;
  if (setup.dp == RunSetup::Dp::reducer) {
    reducer = std::make_unique<nn::GradReducer>(pipe.parameters());
    pipe.set_grad_reducer(reducer.get());
  }
  std::optional<ShardTensor> x, target;
  if (pipe.holds_first_stage())
    x = ShardTensor::distribute(batch.x, pipe.stage_mesh(), setup.input_placements);
  if (pipe.holds_last_stage())
    target = ShardTensor::distribute(batch.target, pipe.stage_mesh(), setup.target_placements);
  TrainingRun run;
  for (int step = 0; step < steps; ++step) {
    optimizer->zero_grad();
    run.losses.push_back(pipe.step(x, target));
    if (reducer) reducer->finish();
    optimizer->step();
  }
  for (const auto& [name, parameter] : pipe.named_parameters())
    run.parameters[name] = values_of(parameter.tensor().full_tensor());
  run.stats = pipe.stats();
  run.stages = pipe.stages();
  return run;
}

/// Losses within 1e-10 relative; every parameter this rank holds equals the one-rank model's.
void expect_same_training(const TrainingRun& got, const TrainingRun& expected,
                          const std::string& what) {
  testing::RunResult got_result{got.losses, {}}, expected_result{expected.losses, {}};
  for (const auto& [name, values] : got.parameters) {
    auto it = expected.parameters.find(name);
    ASSERT_NE(it, expected.parameters.end()) << what << ": unknown parameter " << name;
    got_result.parameters.push_back(values);
    expected_result.parameters.push_back(it->second);
  }
  testing::expect_close(got_result, expected_result, what);
}

/// The most micro-batches a schedule keeps alive on pp rank r (stage r, or chunks r, r + p, ..).
int allowed_in_flight(PipelineSchedule schedule, int p, int r, int m, int v) {
  switch (schedule) {
    case PipelineSchedule::gpipe: return m;
    case PipelineSchedule::one_f_one_b: return std::min(p - r, m);
    case PipelineSchedule::interleaved: return std::min((p - r - 1) * 2 + (v - 1) * p + 1, m * v);
  }
  return 0;
}

/// Trains the linear stack on pp `p` (x dp 2 when `dp` says so) under every schedule and
/// compares with one rank; checks the activations alive against the schedule's bound.
void expect_stack_trains_like_one_rank(int p, RunSetup::Dp dp, const MakeOptimizer& make,
                                       const std::vector<PipelineSchedule>& schedules = {
                                           PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b,
                                           PipelineSchedule::interleaved}) {
  const int dp_size = dp == RunSetup::Dp::none ? 1 : 2;
  testing::run_world(p * dp_size, [&](std::shared_ptr<Comm> comm) {
    const Data batch = data({8, 6}, {8, 4});
    const TrainingRun reference = train_alone(comm, linear_stack, batch, make, 10);
    EXPECT_LT(reference.losses.back(), reference.losses.front());
    for (PipelineSchedule schedule : schedules) {
      const int v = schedule == PipelineSchedule::interleaved ? 2 : 1;
      RunSetup setup;
      if (dp == RunSetup::Dp::none) {
        setup.shape = {p};
        setup.names = {"pp"};
        setup.input_placements = setup.target_placements = {P::replicate()};
      } else {
        setup.shape = {p, 2};
        setup.names = {"pp", "dp"};
        setup.input_placements = setup.target_placements = {P::shard(0)};
      }
      setup.dp = dp;
      setup.options.schedule = schedule;
      setup.options.micro_batches = 4;
      // 9 layers: p * v stages of whole (linear, tanh) pairs where they fit.
      const int stages = p * v;
      for (int s = 0; s < stages; ++s) setup.options.stage_starts.push_back(s * 8 / stages);
      const std::string what =
          fmt::format("{} on pp {}{} ({} stages)", nn::schedule_name(schedule), p,
                      dp == RunSetup::Dp::none      ? ""
                      : dp == RunSetup::Dp::reducer ? " x dp 2"
                                                    : " x fsdp 2",
                      stages);
      const TrainingRun run = train_pipelined(comm, setup, linear_stack, batch, make, 10);
      expect_same_training(run, reference, what);
      const int pp_rank = run.stages.front() % p;
      EXPECT_EQ(run.stats.max_in_flight, allowed_in_flight(schedule, p, pp_rank, 4, v))
          << what << " pp rank " << pp_rank;
      if (schedule == PipelineSchedule::one_f_one_b) {
        EXPECT_LE(run.stats.max_in_flight, p - run.stages.front()) << what;
      }
    }
  });
}

TEST(PipelineParallel, TwoAndFourStagesTrainLikeOneRankUnderEverySchedule) {
  for (int p : {2, 4}) expect_stack_trains_like_one_rank(p, RunSetup::Dp::none, sgd);
}

// pp 2 x dp 2 (so mpiexec -n 4 runs it) and pp 4 x dp 2: the batch over dp, the gradients
// reduced once per step by the reducer; pp 2 x dp 2 also with FSDP over dp inside each stage
// (1F1B).
TEST(PipelineParallel, TwoAndFourStagesWithDpTrainLikeOneRankUnderEverySchedule) {
  for (int p : {2, 4}) expect_stack_trains_like_one_rank(p, RunSetup::Dp::reducer, adamw);
  expect_stack_trains_like_one_rank(2, RunSetup::Dp::fsdp, sgd, {PipelineSchedule::one_f_one_b});
}

// The 4-d mesh pp 2 x dp 2 x tp 2 x domain 2 (16 local ranks): stage 0 a filter- then channel-
// parallel conv block with x's rows over domain (11 = 6 + 5), stage 1 a tensor-parallel MLP that
// takes its input with the channels over domain instead; the batch over dp through the reducer.
// The layers' code is the same as the one-rank model's.
TEST(PipelineParallel, FourDimensionalMeshTrainsLikeOneRank) {
  if (testing::mpi_backend()) GTEST_SKIP() << "16 ranks: local backend only";
  testing::run_world(16, [&](std::shared_ptr<Comm> comm) {
    const Data batch = data({8, 2, 11, 8}, {8, 2, 11, 8});
    const TrainingRun reference = train_alone(comm, conv_then_mlp, batch, sgd, 10);
    RunSetup setup;
    setup.shape = {2, 2, 2, 2};
    setup.names = {"pp", "dp", "tp", "domain"};
    setup.tp = {.dim = "tp"};
    setup.dp = RunSetup::Dp::reducer;
    setup.input_placements = {P::shard(0), P::replicate(), P::shard(2)};
    setup.target_placements = {P::shard(0), P::replicate(), P::shard(1)};
    setup.options = {.schedule = PipelineSchedule::one_f_one_b,
                     .micro_batches = 4,
                     .stage_starts = {0, 3},
                     .input_placements = {{}, {P::shard(0), P::replicate(), P::shard(1)}}};
    const TrainingRun run = train_pipelined(comm, setup, conv_then_mlp, batch, sgd, 10);
    expect_same_training(run, reference, "pp2 x dp2 x tp2 x domain2");
    EXPECT_LE(run.stats.max_in_flight, 2 - run.stages.front());
  });
}

// The bytes every rank sends to another stage in one step, summed over the ranks, equal the
// analytic volume: per boundary and micro-batch, each receiving rank's box of the activation
// (8 bytes an element) forward and each sending rank's box of its gradient backward. pp 2 x dp 2,
// activation [B/M, 8] Shard(0) over dp on stage 0; stage 1 takes it replicated over dp, so the
// forward moves it twice (once per dp rank) and the gradient once. One layout header per
// receiving rank per step goes on the layout tag.
TEST(PipelineParallel, CommunicationPerStepEqualsTheAnalyticVolume) {
  testing::run_world(4, [&](std::shared_ptr<Comm> comm) {
    auto ledger = std::make_shared<testing::CountingComm::Ledger>();
    auto counting = std::make_shared<testing::CountingComm>(comm, ledger);
    DeviceMesh mesh(counting, {2, 2}, {"pp", "dp"});
    const int micro_batches = 4;
    const int64_t batch = 8, features = 8;
    nn::Pipeline pipe(mesh, linear_stack({}),
                      {.micro_batches = micro_batches,
                       .stage_starts = {0, 3},
                       .input_placements = {{}, {P::replicate()}}});
    const Data values = data({batch, 6}, {batch, 4});
    std::optional<ShardTensor> x, target;
    if (pipe.holds_first_stage())
      x = ShardTensor::distribute(values.x, pipe.stage_mesh(), {P::shard(0)});
    if (pipe.holds_last_stage())
      target = ShardTensor::distribute(values.target, pipe.stage_mesh(), {P::shard(0)});
    pipe.step(x, target);  // creates the sub-communicators
    {
      std::lock_guard lock(ledger->mutex);
      ledger->sends.clear();
    }
    pipe.step(x, target);
    int64_t data_bytes = 0, headers = 0;
    {
      std::lock_guard lock(ledger->mutex);
      for (const auto& [tag, bytes] : ledger->sends) {
        if (tag == 20000 || tag == 20001) data_bytes += bytes;
        if (tag == 20002 && bytes > 8 * 8) ++headers;  // the fixed block, not the extents
      }
    }
    comm->all_reduce(&data_bytes, &data_bytes, 1, DType::i64, ReduceOp::sum);
    comm->all_reduce(&headers, &headers, 1, DType::i64, ReduceOp::sum);
    const int64_t activation = batch * features * 8;  // all micro-batches of one boundary
    EXPECT_EQ(data_bytes, 2 * activation + activation);
    EXPECT_EQ(headers, 2);
    // The pipeline's own counters agree with the Comm layer's.
    int64_t counted = pipe.stats().bytes_sent;
    comm->all_reduce(&counted, &counted, 1, DType::i64, ReduceOp::sum);
    EXPECT_EQ(counted, data_bytes);
  });
}

// Bad input: one error naming the problem, the same on every rank, before anything moves.
TEST(PipelineParallel, BadInputIsOneClearErrorOnEveryRank) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2, 2}, {"pp", "dp"});
    auto expect_error = [&](const std::function<void()>& body, const std::string& words) {
      std::string message;
      try {
        body();
      } catch (const Error& error) {
        message = error.what();
      }
      EXPECT_NE(message.find("[pipeline]"), std::string::npos) << message;
      EXPECT_NE(message.find(words), std::string::npos) << message;
      const auto all = testing::all_gather_strings(*comm, message);
      for (const std::string& other : all) EXPECT_EQ(other, all.front()) << "ranks disagree";
    };
    const auto layers = linear_stack({});
    expect_error([&] { nn::Pipeline(mesh, layers, {.dim = "stages"}); },
                 "no mesh dim named 'stages'");
    expect_error(
        [&] {
          nn::Pipeline(mesh, layers, {.stage_starts = {1, 4}});
        },
        "belong to no stage");
    expect_error(
        [&] {
          nn::Pipeline(mesh, layers, {.stage_starts = {0, 9}});
        },
        "stage 1 holds no layer");
    expect_error(
        [&] {
          nn::Pipeline(mesh, layers, {.stage_starts = {0, 3, 6}});
        },
        "3 stages for a pp size of 2");
    expect_error(
        [&] {
          nn::Pipeline(mesh, layers,
                       {.schedule = PipelineSchedule::interleaved, .stage_starts = {0, 2, 4}});
        },
        "interleaved needs a multiple");
    expect_error(
        [&] {
          nn::Pipeline(mesh, layers,
                       {.schedule = PipelineSchedule::interleaved,
                        .micro_batches = 3,
                        .stage_starts = {0, 2, 4, 6}});
        },
        "3 micro-batches for a pp size of 2");
    expect_error(
        [&] {
          nn::Pipeline(mesh, layers,
                       {.stage_starts = {0, 3}, .input_placements = {{}, {P::partial()}}});
        },
        "Partial input placement for stage 1");
    // 3 micro-batches of a batch of 8 split 4 + 4 over dp: found on the first stage's ranks, raised
    // on every rank.
    nn::Pipeline pipe(mesh, layers, {.micro_batches = 3, .stage_starts = {0, 3}});
    const Data values = data({8, 6}, {8, 4});
    std::optional<ShardTensor> x, target;
    if (pipe.holds_first_stage())
      x = ShardTensor::distribute(values.x, pipe.stage_mesh(), {P::shard(0)});
    if (pipe.holds_last_stage())
      target = ShardTensor::distribute(values.target, pipe.stage_mesh(), {P::shard(0)});
    expect_error([&] { pipe.step(x, target); }, "3 micro-batches do not divide the input's batch");
    // No target on the last stage.
    nn::Pipeline whole(mesh, layers, {.micro_batches = 2, .stage_starts = {0, 3}});
    expect_error([&] { whole.step(x, std::nullopt); }, "no target");
  });
}

/// The identity, except that its `fail_at`-th forward (counting from 0) raises an error, the
/// same on every rank of its stage, as an op's collectively decided check does.
class FailingLayer final : public nn::Module {
 public:
  explicit FailingLayer(int fail_at) : fail_at_(fail_at) {}
  ShardTensor forward(const ShardTensor& x) override {
    check_arg(calls_++ != fail_at_, "failing_layer", "forward call {} fails (test)", fail_at_);
    return x;
  }

 private:
  int fail_at_, calls_ = 0;
};

// An error raised inside one stage (its layer, at some micro-batch) reaches every rank as one
// error, under every schedule, instead of leaving the other stages waiting for its data; the
// pipeline then runs the next step normally (no transfer of the failed step is left over): its
// loss equals a fresh pipeline's first loss bit for bit.
TEST(PipelineParallel, AStageErrorReachesEveryRankUnderEverySchedule) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    struct Case {
      std::vector<int> shape;
      std::vector<std::string> names;
      PipelineSchedule schedule;
      std::vector<int> stage_starts;
      size_t failing_layer;  // a position in the 10 layers (the stack with the failing one)
      int fail_at;           // the forward call of that layer that fails
    };
    const std::vector<Case> cases{
        // the last of 4 stages, at micro-batch 1 (micro-batch 0 went through)
        {{4}, {"pp"}, PipelineSchedule::one_f_one_b, {0, 2, 4, 6}, 9, 1},
        {{4}, {"pp"}, PipelineSchedule::gpipe, {0, 2, 4, 6}, 9, 1},
        // the first stage, at micro-batch 0 (pp 2 x dp 2)
        {{2, 2}, {"pp", "dp"}, PipelineSchedule::one_f_one_b, {0, 5}, 0, 0},
        // a middle stage of the interleaved schedule (stage 2 on pp rank 0), at micro-batch 1
        {{2, 2}, {"pp", "dp"}, PipelineSchedule::interleaved, {0, 3, 5, 7}, 6, 1},
    };
    for (const Case& test : cases) {
      const std::string what = fmt::format(
          "{} on {} stages, layer {} fails at call {}", nn::schedule_name(test.schedule),
          test.stage_starts.size(), test.failing_layer, test.fail_at);
      DeviceMesh mesh(comm, test.shape, test.names);
      const auto make_layers = [&](int fail_at) {
        std::vector<nn::LayerBuilder> layers = linear_stack({});
        layers.insert(
            layers.begin() + static_cast<int64_t>(test.failing_layer),
            [fail_at](const DeviceMesh&) { return std::make_shared<FailingLayer>(fail_at); });
        return layers;
      };
      const nn::PipelineOptions options{
          .schedule = test.schedule, .micro_batches = 4, .stage_starts = test.stage_starts};
      nn::Pipeline pipe(mesh, make_layers(test.fail_at), options);
      nn::Pipeline fresh(mesh, make_layers(-1), options);
      const Data values = data({8, 6}, {8, 4});
      const std::vector<Placement> layout{test.shape.size() == 1 ? P::replicate() : P::shard(0)};
      const auto batch_of = [&](const nn::Pipeline& on) {
        std::pair<std::optional<ShardTensor>, std::optional<ShardTensor>> batch;
        if (on.holds_first_stage())
          batch.first = ShardTensor::distribute(values.x, on.stage_mesh(), layout);
        if (on.holds_last_stage())
          batch.second = ShardTensor::distribute(values.target, on.stage_mesh(), layout);
        return batch;
      };
      const auto [x, target] = batch_of(pipe);
      std::string message;
      try {
        pipe.step(x, target);
      } catch (const AgreedError& error) {
        message = error.what();
      }
      EXPECT_EQ(message,
                "[failing_layer] forward call " + std::to_string(test.fail_at) + " fails (test)")
          << what;
      const auto all = testing::all_gather_strings(*comm, message);
      for (const std::string& other : all) EXPECT_EQ(other, all.front()) << what;
      const double after = pipe.step(x, target);
      const auto [fresh_x, fresh_target] = batch_of(fresh);
      const double first = fresh.step(fresh_x, fresh_target);
      EXPECT_EQ(after, first) << what;
    }
  });
}

}  // namespace
}  // namespace tessera
