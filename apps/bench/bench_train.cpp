// `tessera bench train`: one training step (forward, backward, gradient reduction, AdamW) of a
// conv3d network on a dp x domain mesh, with the gradients reduced three ways: by the tape (each
// parameter on its own, blocking, as its gradient becomes final), by the bucketed GradReducer
// overlapped with backward, and by the reducer with overlap off (every bucket in finish()). The
// time spent in finish() is the exposed reduction; with overlap off it is all of it. A fourth row
// shards the model over dp instead (FSDP / ZeRO-3, ops/nn/fsdp.hpp): its exposed communication is
// the time blocked on parameter gathers and gradient reductions. Peak host
// memory is the process's allocator peak (local ranks share one process: per rank = peak /
// local ranks; under mpiexec each rank is its own process). `--mixed bf16|f16` adds the DDP
// (overlapped) and FSDP rows again with f32 master weights computing in that dtype
// (ops/nn/mixed_precision.hpp; f16 with the GradScaler). `--pp P` benchmarks pipeline
// parallelism instead (ops/nn/pipeline.hpp): the same conv3d layers split into stages over a
// pp x dp x domain mesh (x tp with `--tp N`: filter- and channel-parallel convs in turn), one row
// per schedule with the step time and the measured bubble (1 - busy / wall per rank, mean and
// max over the ranks) beside the formula's (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <thread>

#include "apps/bench/bench_harness.hpp"
#include "apps/bench/timed_comm.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/compute_threads.hpp"
#include "core/host_allocator.hpp"
#include "core/tessera.hpp"
#include "core/trace.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/fsdp.hpp"
#include "ops/nn/layers.hpp"
#include "ops/nn/mixed_precision.hpp"
#include "ops/nn/pipeline.hpp"
#include "ops/nn/tensor_parallel.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"

namespace tessera::cli {

namespace {

struct TrainBenchOptions {
  std::string shape = "4,8,40,40,40";  // N, C, X, Y, Z
  int64_t hidden = 32;
  int64_t layers = 3;
  std::string mesh = "2x2";  // dp x domain (x)
  double bucket_mb = 25;
  int steps = 3;
  int threads = 0;
  std::string mixed;  // "", "bf16" or "f16": compute dtype of the extra rows
  int pp = 0;         // > 0: the pipeline benchmark over this many pp ranks
  int tp = 1;         // tensor-parallel ranks of the pipeline benchmark
  int micro_batches = 4;
  std::string schedule = "all";  // gpipe, 1f1b, interleaved or all
  int chunks = 2;                // model chunks per pp rank of the interleaved schedule
  bool json = false;
};

/// How the gradients of one run are reduced.
enum class Reduction { tape, overlapped, at_finish, fsdp };

const char* reduction_name(Reduction reduction) {
  switch (reduction) {
    case Reduction::tape: return "tape (per parameter)";
    case Reduction::overlapped: return "buckets, overlapped";
    case Reduction::at_finish: return "buckets, at finish";
    case Reduction::fsdp: return "fsdp (sharded over dp)";
  }
  return "?";
}

struct StepFigures {
  double step = 0;     // seconds per step (slowest rank)
  double exposed = 0;  // seconds per step in finish() (slowest rank)
  int64_t collectives = 0;
  int64_t bytes = 0;
  double loss = 0;
};

StepFigures measure(std::shared_ptr<Comm> world, const TrainBenchOptions& options,
                    const Shape& shape, const std::vector<int>& mesh_shape, Reduction reduction,
                    std::optional<DType> mixed) {
  DeviceMesh mesh(world, mesh_shape, {"dp", "x"});
  auto model = std::make_shared<nn::Sequential>();
  int64_t channels = shape[1];
  for (int64_t layer = 0; layer < options.layers; ++layer) {
    const int64_t out = layer + 1 == options.layers ? shape[1] : options.hidden;
    model->append(std::make_shared<nn::Conv>(
        mesh, nn::ConvConfig{.spatial_dims = 3, .in_channels = channels, .out_channels = out},
        100 + static_cast<uint64_t>(layer)));
    if (layer + 1 < options.layers) model->append(std::make_shared<nn::Activation>("gelu"));
    channels = out;
  }
  if (mixed) nn::apply_mixed_precision(*model, {.compute = *mixed});
  std::unique_ptr<nn::FullyShardedDataParallel> fsdp;
  if (reduction == Reduction::fsdp)
    fsdp = std::make_unique<nn::FullyShardedDataParallel>(mesh, model,
                                                          nn::FsdpOptions{.shard_dim = "dp"});
  nn::Module& net = fsdp ? static_cast<nn::Module&>(*fsdp) : *model;
  optim::AdamW optimizer(net.parameters(), {.lr = 1e-3});
  std::unique_ptr<nn::GradReducer> reducer;
  if (reduction == Reduction::overlapped || reduction == Reduction::at_finish)
    reducer = std::make_unique<nn::GradReducer>(
        net.parameters(),
        nn::ReducerOptions{.bucket_bytes = static_cast<size_t>(options.bucket_mb * (1 << 20)),
                           .overlap = reduction == Reduction::overlapped});
  std::unique_ptr<nn::GradScaler> scaler;
  if (mixed == DType::f16) scaler = std::make_unique<nn::GradScaler>(net.parameters());
  const std::vector<Placement> placements{Placement::shard(0), Placement::shard(2)};
  const ShardTensor x = ShardTensor::distribute(bench::random_tensor(shape, 1), mesh, placements);
  const ShardTensor target =
      ShardTensor::distribute(bench::random_tensor(shape, 2), mesh, placements);
  StepFigures figures;
  double exposed = 0;
  auto step = [&] {
    trace::Span span("step", "train step");
    optimizer.zero_grad();
    Tape tape;
    const ShardTensor loss = ops::mse_loss(ops::cast(net.forward(x), DType::f32), target);
    tape.backward(scaler ? scaler->scale(loss) : loss);
    figures.loss = loss.full_tensor().item_as_double({});
    if (reducer) {
      const double start = now_seconds();
      reducer->finish();
      exposed += now_seconds() - start;
    }
    if (scaler) {
      scaler->step(optimizer);
      scaler->update();
    } else {
      optimizer.step();
    }
  };
  figures.step = bench::time_collective(*world, Device::cpu(), 1, options.steps, [&] { step(); });
  if (fsdp) exposed = fsdp->stats().wait_seconds;
  figures.exposed = exposed / (options.steps + 1);  // warm-up included: a mean over every step
  world->all_reduce(&figures.exposed, &figures.exposed, 1, DType::f64, ReduceOp::max);
  if (reducer) {
    figures.collectives = reducer->stats().collectives / (options.steps + 1);
    figures.bytes = reducer->stats().bytes_reduced / (options.steps + 1);
  }
  if (fsdp) {
    const nn::FsdpStats stats = fsdp->stats();
    figures.collectives = (stats.gathers + stats.gradient_reductions) / (options.steps + 1);
    figures.bytes = (stats.bytes_gathered + stats.bytes_reduced) / (options.steps + 1);
  }
  return figures;
}

/// The measured figures of one pipeline schedule (this rank's, then reduced over the world).
struct PipelineFigures {
  double step = 0;         // seconds per step (slowest rank)
  double bubble_mean = 0;  // measured bubble fraction, mean over ranks (last timed step)
  double bubble_max = 0;   // and the largest
  int64_t bytes = 0;       // bytes sent between stages per step, all ranks
  int max_in_flight = 0;   // most micro-batches alive on a rank
  double loss = 0;
  // Tensor parallelism (rank 0's tp communicator, per step): the bytes of its all-reduces,
  // all-gathers and reduce-scatters, the seconds in them (slowest rank), and their bound: each
  // call's bytes over the bandwidth of the same collective at the same size measured alone on
  // the same communicator in the same run, summed (slowest rank).
  int64_t tp_all_reduce_bytes = 0, tp_all_gather_bytes = 0, tp_reduce_scatter_bytes = 0;
  double tp_seconds = 0, tp_bound_seconds = 0;
};

/// Collective over `comm` (a tp communicator, every rank with the same record): the seconds one
/// call of each recorded collective takes alone at its size (f32 buffers, an even split), as
/// bench comm measures a collective: warm-up, a barrier, timed iterations, the slowest rank.
std::map<std::pair<std::string, int64_t>, double> time_alone(
    Comm& comm, const bench::CollectiveRecord& record) {
  std::map<std::pair<std::string, int64_t>, double> seconds;
  const size_t parts = static_cast<size_t>(comm.size());
  for (const auto& [key, calls] : record) {
    const auto& [name, bytes] = key;
    const size_t count = static_cast<size_t>(bytes) / sizeof(float);
    std::vector<float> send(count, 1.0f), recv(count);
    std::vector<size_t> counts(parts, count / parts);
    for (size_t r = 0; r < count % parts; ++r) ++counts[r];
    const size_t mine = counts[static_cast<size_t>(comm.rank())];
    seconds[key] = bench::time_collective(comm, Device::cpu(), 2, 10, [&] {
      if (name == "all_reduce")
        comm.all_reduce(send.data(), recv.data(), count, DType::f32, ReduceOp::sum);
      else if (name == "all_gather")
        comm.all_gather_v(send.data(), mine, recv.data(), counts, DType::f32);
      else
        comm.reduce_scatter_v(send.data(), recv.data(), counts, DType::f32, ReduceOp::sum);
    });
  }
  return seconds;
}

PipelineFigures measure_pipeline(std::shared_ptr<Comm> world, const TrainBenchOptions& options,
                                 const Shape& shape, const std::vector<int>& mesh_shape,
                                 nn::PipelineSchedule schedule) {
  const bool with_tp = options.tp > 1;
  std::vector<int> shape_of_mesh{options.pp, mesh_shape[0]};
  std::vector<std::string> names{"pp", "dp"};
  if (with_tp) {
    shape_of_mesh.push_back(options.tp);
    names.push_back("tp");
  }
  shape_of_mesh.push_back(mesh_shape[1]);
  names.push_back("x");
  // Timed collectives: the tp communicator's record is the tensor-parallel traffic.
  DeviceMesh mesh(std::make_shared<bench::TimedComm>(world), shape_of_mesh, names);
  // The conv3d layers of the other rows (gelu between), filter- and channel-parallel in turn
  // over tp when there is one.
  const nn::TensorParallelOptions tp{.dim = with_tp ? "tp" : ""};
  std::vector<nn::LayerBuilder> layers;
  int64_t channels = shape[1];
  for (int64_t layer = 0; layer < options.layers; ++layer) {
    const int64_t out = layer + 1 == options.layers ? shape[1] : options.hidden;
    const nn::ConvConfig config{.spatial_dims = 3, .in_channels = channels, .out_channels = out};
    const uint64_t seed = 100 + static_cast<uint64_t>(layer);
    layers.push_back([=](const DeviceMesh& stage) -> std::shared_ptr<nn::Module> {
      if (!with_tp) return std::make_shared<nn::Conv>(stage, config, seed);
      if (layer % 2 == 0) return std::make_shared<nn::FilterParallelConv>(stage, config, seed, tp);
      return std::make_shared<nn::ChannelParallelConv>(stage, config, seed, tp);
    });
    if (layer + 1 < options.layers)
      layers.push_back([](const DeviceMesh&) { return std::make_shared<nn::Activation>("gelu"); });
    channels = out;
  }
  const int stages =
      options.pp * (schedule == nn::PipelineSchedule::interleaved ? options.chunks : 1);
  // Stages start at conv layers (each conv with the gelu after it), split as evenly as they go.
  std::vector<int> starts;
  for (int s = 0; s < stages; ++s)
    starts.push_back(2 * static_cast<int>(s * options.layers / stages));
  nn::Pipeline pipe(
      mesh, layers,
      {.schedule = schedule, .micro_batches = options.micro_batches, .stage_starts = starts});
  optim::AdamW optimizer(pipe.parameters(), {.lr = 1e-3});
  nn::GradReducer reducer(pipe.parameters());
  pipe.set_grad_reducer(&reducer);
  std::vector<Placement> placements{Placement::shard(0), Placement::shard(2)};
  if (with_tp) placements.insert(placements.begin() + 1, Placement::replicate());
  std::optional<ShardTensor> x, target;
  if (pipe.holds_first_stage())
    x = ShardTensor::distribute(bench::random_tensor(shape, 1), pipe.stage_mesh(), placements);
  if (pipe.holds_last_stage())
    target = ShardTensor::distribute(bench::random_tensor(shape, 2), pipe.stage_mesh(), placements);
  PipelineFigures figures;
  figures.step = bench::time_collective(*world, Device::cpu(), 1, options.steps, [&] {
    trace::Span span("step", "pipeline train step");
    optimizer.zero_grad();
    figures.loss = pipe.step(x, target);
    reducer.finish();
    optimizer.step();
  });
  const nn::PipelineStats stats = pipe.stats();
  double bubble = stats.bubble_fraction();
  figures.bubble_max = bubble;
  world->all_reduce(&bubble, &figures.bubble_mean, 1, DType::f64, ReduceOp::avg);
  world->all_reduce(&figures.bubble_max, &figures.bubble_max, 1, DType::f64, ReduceOp::max);
  figures.bytes = stats.bytes_sent;
  world->all_reduce(&figures.bytes, &figures.bytes, 1, DType::i64, ReduceOp::sum);
  int32_t alive = stats.max_in_flight;
  world->all_reduce(&alive, &alive, 1, DType::i32, ReduceOp::max);
  figures.max_in_flight = alive;
  if (with_tp) {
    auto tp_comm = std::dynamic_pointer_cast<bench::TimedComm>(pipe.stage_mesh().dim_comm("tp"));
    check_arg(tp_comm != nullptr, "bench", "the tp communicator is not a timed one");
    const bench::CollectiveRecord record = tp_comm->record();  // warm-up step included
    const double steps = options.steps + 1;
    const auto alone = time_alone(tp_comm->inner(), record);
    for (const auto& [key, calls] : record) {
      const int64_t bytes = key.second * calls.calls;
      if (key.first == "all_reduce") figures.tp_all_reduce_bytes += bytes;
      if (key.first == "all_gather") figures.tp_all_gather_bytes += bytes;
      if (key.first == "reduce_scatter") figures.tp_reduce_scatter_bytes += bytes;
      figures.tp_seconds += calls.seconds;
      figures.tp_bound_seconds += alone.at(key) * static_cast<double>(calls.calls);
    }
    for (int64_t* bytes : {&figures.tp_all_reduce_bytes, &figures.tp_all_gather_bytes,
                           &figures.tp_reduce_scatter_bytes})
      *bytes = static_cast<int64_t>(static_cast<double>(*bytes) / steps);
    figures.tp_seconds /= steps;
    figures.tp_bound_seconds /= steps;
    world->all_reduce(&figures.tp_seconds, &figures.tp_seconds, 1, DType::f64, ReduceOp::max);
    world->all_reduce(&figures.tp_bound_seconds, &figures.tp_bound_seconds, 1, DType::f64,
                      ReduceOp::max);
  }
  return figures;
}

void run_pipeline_bench(const TrainBenchOptions& options, const Shape& shape,
                        const std::vector<int>& mesh_shape) {
  check_arg(options.tp >= 1 && options.micro_batches >= 1 && options.chunks >= 2, "bench",
            "--tp {}, --micro-batches {} and --chunks {} (at least 1, 1 and 2)", options.tp,
            options.micro_batches, options.chunks);
  std::vector<nn::PipelineSchedule> schedules;
  if (options.schedule == "all")
    schedules = {nn::PipelineSchedule::gpipe, nn::PipelineSchedule::one_f_one_b,
                 nn::PipelineSchedule::interleaved};
  else
    schedules = {nn::parse_schedule(options.schedule)};
  const int ranks = options.pp * mesh_shape[0] * options.tp * mesh_shape[1];
  const Backend backend = backend_from_env();
  bench::BenchReport report("train_pipeline", options.json, bench::is_reporter(backend));
  report.set("shape", shape);
  report.set("pp", options.pp);
  report.set("mesh", mesh_shape);
  report.set("tp", options.tp);
  report.set("micro_batches", options.micro_batches);
  report.set("layers", options.layers);
  report.set("hidden", options.hidden);
  report.set("backend", backend_name(backend));
  bench::BenchTable& table = report.table(
      "rows",
      fmt::format("tessera bench train --pp {}: {} conv3d layers (hidden {}), x {} f32 on pp {} x "
                  "dp x domain {}{}, {} micro-batches, AdamW, {} backend",
                  options.pp, options.layers, options.hidden, shape, options.pp, options.mesh,
                  options.tp > 1 ? fmt::format(" x tp {}", options.tp) : "", options.micro_batches,
                  backend_name(backend)),
      {{"schedule", "schedule", "", 12},
       {"stages", "stages", "", 7},
       {"ranks", "ranks", "", 6},
       {"step_ms", "step", "ms", 10, 1},
       {"bubble", "bubble", "mean", 8, 3},
       {"bubble_max", "bubble", "max", 8, 3},
       {"bubble_formula", "formula", "", 8, 3},
       {"max_in_flight", "alive", "", 6},
       {"bytes_between_stages", "moved", "bytes", 11}});
  std::vector<std::pair<nn::PipelineSchedule, PipelineFigures>> measured;
  for (nn::PipelineSchedule schedule : schedules) {
    const int chunks = schedule == nn::PipelineSchedule::interleaved ? options.chunks : 1;
    PipelineFigures figures;
    launch(backend, ranks, [&](std::shared_ptr<Comm> world) {
      if (options.threads > 0) choose_compute_threads(options.threads);
      PipelineFigures mine = measure_pipeline(world, options, shape, mesh_shape, schedule);
      if (world->rank() == 0) figures = mine;
    });
    table.add({{"schedule", nn::schedule_name(schedule)},
               {"stages", options.pp * chunks},
               {"ranks", ranks},
               {"step_ms", figures.step * 1e3},
               {"bubble", figures.bubble_mean},
               {"bubble_max", figures.bubble_max},
               {"bubble_formula",
                nn::ideal_bubble_fraction(schedule, options.pp, options.micro_batches, chunks)},
               {"max_in_flight", figures.max_in_flight},
               {"bytes_between_stages", figures.bytes},
               {"loss", figures.loss}});
    measured.emplace_back(schedule, figures);
  }
  // With --tp: a second table of the tensor-parallel collectives per step and rank.
  if (options.tp > 1) {
    bench::BenchTable& tp_table = report.table(
        "tp_rows",
        fmt::format("tensor-parallel collectives per step on rank 0's tp communicator ({} ranks): "
                    "bytes, time in them (slowest rank), and the bound: bytes / bandwidth of the "
                    "same collective at the same size measured alone in this run",
                    options.tp),
        {{"schedule", "schedule", "", 12},
         {"tp_all_reduce_bytes", "all-reduce", "bytes", 11},
         {"tp_all_gather_bytes", "all-gather", "bytes", 11},
         {"tp_reduce_scatter_bytes", "red-scatter", "bytes", 11},
         {"tp_ms", "tp time", "ms", 9, 2},
         {"tp_bound_ms", "bound", "ms", 9, 2},
         {"tp_over_bound", "time/bound", "", 10, 2}});
    for (const auto& [schedule, figures] : measured)
      tp_table.add(
          {{"schedule", nn::schedule_name(schedule)},
           {"tp_all_reduce_bytes", figures.tp_all_reduce_bytes},
           {"tp_all_gather_bytes", figures.tp_all_gather_bytes},
           {"tp_reduce_scatter_bytes", figures.tp_reduce_scatter_bytes},
           {"tp_ms", figures.tp_seconds * 1e3},
           {"tp_bound_ms", figures.tp_bound_seconds * 1e3},
           {"tp_over_bound",
            figures.tp_bound_seconds > 0 ? figures.tp_seconds / figures.tp_bound_seconds : 0.0}});
  }
  report.finish();
}

void run_train_bench(const TrainBenchOptions& options) {
  const Shape shape = parse_list(options.shape);
  check_arg(shape.size() == 5, "bench", "--shape needs N,C,X,Y,Z, got '{}'", options.shape);
  const std::vector<int> mesh_shape = parse_mesh(options.mesh);
  check_arg(mesh_shape.size() == 2, "bench", "--mesh needs dp x domain (e.g. 2x2), got '{}'",
            options.mesh);
  check_arg(options.layers >= 1 && options.hidden >= 1 && options.steps >= 1, "bench",
            "--layers {}, --hidden {} and --steps {} must be at least 1", options.layers,
            options.hidden, options.steps);
  check_arg(options.bucket_mb > 0, "bench", "--bucket-mb {} must be positive", options.bucket_mb);
  if (options.pp > 0) {
    run_pipeline_bench(options, shape, mesh_shape);
    return;
  }
  check_arg(options.mixed.empty() || options.mixed == "bf16" || options.mixed == "f16", "bench",
            "--mixed '{}' (expected bf16 or f16)", options.mixed);
  const std::optional<DType> mixed =
      options.mixed.empty() ? std::nullopt : std::optional<DType>(dtype_from_name(options.mixed));
  check_arg(shape[0] % mesh_shape[0] == 0, "bench",
            "--shape batch {} is not divisible by dp {} (the fsdp row splits it evenly)", shape[0],
            mesh_shape[0]);
  const int ranks = mesh_shape[0] * mesh_shape[1];
  const Backend backend = backend_from_env();
  const bool reporter = bench::is_reporter(backend);
  bench::BenchReport report("train", options.json, reporter);
  report.set("shape", shape);
  report.set("mesh", mesh_shape);
  report.set("layers", options.layers);
  report.set("hidden", options.hidden);
  report.set("bucket_mb", options.bucket_mb);
  report.set("backend", backend_name(backend));
  bench::BenchTable& table = report.table(
      "rows",
      fmt::format("tessera bench train: {} conv3d layers (hidden {}), x {} f32 on dp x domain {}, "
                  "AdamW, {} backend",
                  options.layers, options.hidden, shape, options.mesh, backend_name(backend)),
      {{"reduction", "gradient reduction", "", 28},
       {"ranks", "ranks", "", 6},
       {"threads_per_rank", "threads", "", 7},
       {"step_ms", "step", "ms", 10, 1},
       {"exposed_ms", "exposed", "ms", 9, 1},
       {"collectives", "colls", "", 8},
       {"bytes_reduced", "moved", "bytes", 10},
       {"peak_mib_per_rank", "peak/rank", "MiB", 10, 1}});
  // The f32 rows, then (with --mixed) DDP and FSDP with f32 master weights computing in it.
  std::vector<std::pair<Reduction, std::optional<DType>>> rows{
      {Reduction::tape, std::nullopt},
      {Reduction::overlapped, std::nullopt},
      {Reduction::at_finish, std::nullopt},
      {Reduction::fsdp, std::nullopt}};
  if (mixed) {
    rows.emplace_back(Reduction::overlapped, mixed);
    rows.emplace_back(Reduction::fsdp, mixed);
  }
  for (const auto& [reduction, compute] : rows) {
    StepFigures figures;
    host_allocator_reset_peak();
    launch(backend, ranks, [&](std::shared_ptr<Comm> world) {
      if (options.threads > 0) choose_compute_threads(options.threads);
      StepFigures mine = measure(world, options, shape, mesh_shape, reduction, compute);
      if (world->rank() == 0) figures = mine;
    });
    const int local_ranks = backend == Backend::local ? ranks : 1;
    const int threads =
        options.threads > 0
            ? options.threads
            : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / local_ranks);
    const std::string name =
        compute ? fmt::format("{}, {}", reduction_name(reduction), dtype_name(*compute))
                : std::string(reduction_name(reduction));
    table.add({{"reduction", name},
               {"ranks", ranks},
               {"threads_per_rank", threads},
               {"step_ms", figures.step * 1e3},
               {"step_seconds", figures.step},
               {"exposed_ms", figures.exposed * 1e3},
               {"collectives", figures.collectives},
               {"bytes_reduced", figures.bytes},
               {"peak_mib_per_rank",
                static_cast<double>(host_allocator_stats().peak_in_use) / local_ranks / (1 << 20)},
               {"loss", figures.loss}});
  }
  report.finish();
}

}  // namespace

void register_train_bench(CLI::App& bench) {
  auto options = std::make_shared<TrainBenchOptions>();
  auto* train = bench.add_subcommand(
      "train",
      "Training step on dp x domain: gradients reduced by the tape, by overlapped "
      "buckets, by buckets at finish (DDP), and the model sharded over dp (FSDP)");
  train->add_option("--shape", options->shape, "Global batch N,C,X,Y,Z")->capture_default_str();
  train->add_option("--hidden", options->hidden, "Hidden channels")->capture_default_str();
  train->add_option("--layers", options->layers, "conv3d layers (k3, gelu between)")
      ->capture_default_str();
  train->add_option("--mesh", options->mesh, "dp x domain mesh (batch over dp, x over domain)")
      ->capture_default_str();
  train->add_option("--bucket-mb", options->bucket_mb, "Reducer bucket size in MiB")
      ->capture_default_str();
  train->add_option("--steps", options->steps, "Timed steps (after one warm-up step)")
      ->capture_default_str();
  train->add_option("--threads", options->threads, "Compute threads per rank (0: cores / ranks)")
      ->check(CLI::Range(0, 4096));
  train->add_option("--mixed", options->mixed,
                    "Also the DDP and FSDP rows with f32 master weights computing in bf16 or f16 "
                    "(f16 with loss scaling)");
  train
      ->add_option("--pp", options->pp,
                   "Pipeline parallelism over this many ranks instead of the DDP/FSDP rows (the "
                   "mesh becomes pp x dp x domain)")
      ->check(CLI::Range(0, 4096));
  train->add_option("--tp", options->tp, "Tensor-parallel ranks of the pipeline rows")
      ->check(CLI::Range(1, 4096));
  train->add_option("--micro-batches", options->micro_batches, "Micro-batches per pipeline step")
      ->capture_default_str();
  train
      ->add_option("--schedule", options->schedule,
                   "Pipeline schedule: gpipe, 1f1b, interleaved or all")
      ->capture_default_str();
  train->add_option("--chunks", options->chunks, "Model chunks per pp rank (interleaved)")
      ->capture_default_str();
  add_trace_option(*train);
  train->add_flag("--json", options->json, "Print JSON instead of the table");
  train->callback([options] { run_train_bench(*options); });
}

}  // namespace tessera::cli
