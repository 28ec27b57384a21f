// `tessera bench ops`: every op of the op library on one representative 3-d shape, forward and
// forward+backward (the tape's backward from a given output gradient), on 1 rank and sharded
// over 2 ranks (the first spatial dim split in halves), f32. The ranks share the machine's
// cores (threads per rank = cores / ranks unless --threads), so "2 ranks / 1 rank" compares the
// same cores: 1.0 is perfect, the bar is 1.15. With --baseline (the JSON of
// apps/bench/torch_ops_bench.py, run with the same shape and threads) each 1-rank row shows
// PyTorch's time and the ratio.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <thread>

#include "apps/bench/bench_harness.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/compute_threads.hpp"
#include "core/tessera.hpp"
#include "ops/cpu_isa.hpp"
#include "ops/ops.hpp"

namespace tessera::cli {

namespace {

struct OpsBenchOptions {
  std::string shape = "2,16,48,48,48";  // N, C, X, Y, Z
  std::string ops;                      // empty: every recipe
  std::string ranks = "1,2";
  int threads = 0;
  int iterations = 3;
  std::string baseline;
  bool json = false;
  bool cpu_time = false;  // the ranks' thread cpu time instead of wall time (needs --threads 1)
};

/// How one op is benchmarked: its inputs (shapes from the bench shape) and attributes.
struct Recipe {
  std::string name;  ///< the row's name (the op, with a variant)
  std::string op;
  std::vector<Shape> inputs;
  OpAttrs attrs{};
  bool positive = false;  ///< inputs shifted to (0.5, 1.5) (sqrt, log, pow)
  int shard_dim = 2;      ///< the input dim split over the ranks
};

std::vector<Recipe> recipes(const Shape& x) {
  const int64_t n = x[0], c = x[1], d = x[2], h = x[3], w = x[4];
  const Shape channels_last{n, d, h, w, c};
  std::vector<Recipe> list;
  for (const char* unary : {"relu", "gelu", "silu", "tanh", "exp", "sigmoid", "softplus",
                            "leaky_relu", "erf", "abs", "neg"})
    list.push_back({unary, unary, {x}});
  list.push_back({"sqrt", "sqrt", {x}, {}, true});
  list.push_back({"log", "log", {x}, {}, true});
  list.push_back({"clamp", "clamp", {x}, OpAttrs().set("min", -0.25).set("max", 0.25)});
  for (const char* binary : {"add", "mul", "div", "maximum"})
    list.push_back({binary, binary, {x, x}, {}, std::string(binary) == "div"});
  list.push_back({"pow", "pow", {x, x}, {}, true});
  list.push_back({"bias_add", "bias_add", {x, {c}}});
  list.push_back({"where", "where", {x, x, x}});
  list.push_back({"sum dim 1", "sum", {x}, OpAttrs().set("dims", std::vector<int64_t>{1})});
  list.push_back({"mean all", "mean", {x}});
  list.push_back({"softmax dim 1", "softmax", {x}, OpAttrs().set("dim", int64_t{1})});
  list.push_back({"log_softmax dim 1", "log_softmax", {x}, OpAttrs().set("dim", int64_t{1})});
  list.push_back({"softmax last", "softmax", {x}, OpAttrs().set("dim", int64_t{-1})});
  list.push_back({"log_softmax last", "log_softmax", {x}, OpAttrs().set("dim", int64_t{-1})});
  list.push_back(
      {"max_pool k2", "max_pool", {x}, OpAttrs().set("kernel_size", std::vector<int64_t>{2})});
  list.push_back({"avg_pool k3 s1 p1",
                  "avg_pool",
                  {x},
                  OpAttrs()
                      .set("kernel_size", std::vector<int64_t>{3})
                      .set("stride", std::vector<int64_t>{1})
                      .set("padding", std::vector<int64_t>{1})});
  list.push_back(
      {"group_norm g4", "group_norm", {x, {c}, {c}}, OpAttrs().set("groups", int64_t{4})});
  list.push_back({"batch_norm", "batch_norm", {x}});
  list.push_back({"instance_norm", "instance_norm", {x, {c}, {c}}});
  list.push_back({"layer_norm last", "layer_norm", {channels_last, {c}, {c}}, {}, false, 1});
  list.push_back({"linear C->C", "linear", {channels_last, {c, c}, {c}}, {}, false, 1});
  list.push_back({"matmul by CxC", "matmul", {channels_last, {c, c}}, {}, false, 1});
  list.push_back({"conv k3",
                  "conv",
                  {x, {c, c, 3, 3, 3}, {c}},
                  OpAttrs()
                      .set("pad_lo", std::vector<int64_t>{1, 1, 1})
                      .set("pad_hi", std::vector<int64_t>{1, 1, 1})});
  list.push_back({"conv_transpose k2 s2",
                  "conv_transpose",
                  {x, {c, c, 2, 2, 2}, {c}},
                  OpAttrs().set("stride", std::vector<int64_t>{2})});
  Shape half = x;
  half[1] = c / 2;
  list.push_back({"concat dim 1", "concat", {half, half}, OpAttrs().set("dim", int64_t{1})});
  list.push_back(
      {"split dim 1",
       "split",
       {x},
       OpAttrs().set("sizes", std::vector<int64_t>{c / 2, c - c / 2}).set("dim", int64_t{1})});
  list.push_back({"dropout p0.1", "dropout", {x}, OpAttrs().set("p", 0.1).set("seed", int64_t{5})});
  // Attention over a sequence: [N, 1024, 4 heads, 2C].
  const Shape sequence{n, 1024, 4, 2 * c};
  list.push_back({"attention", "attention", {sequence, sequence, sequence}, {}, false, 1});
  return list;
}

struct OpFigures {
  double forward = 0, forward_backward = 0;
};

/// Seconds per run of body: the slowest rank's wall time (bench::time_collective), or with
/// `cpu_time` its thread's cpu time, which leaves out the time the thread waited for a core (on a
/// machine shared with other work, most of the wall time of a one-thread run).
double timed(Comm& world, int iterations, bool cpu_time, const std::function<void()>& body) {
  if (!cpu_time) return bench::time_collective(world, Device::cpu(), 1, iterations, body);
  body();
  world.barrier();
  const double start = ops::thread_cpu_seconds();
  for (int i = 0; i < iterations; ++i) body();
  double seconds = (ops::thread_cpu_seconds() - start) / iterations;
  world.all_reduce(&seconds, &seconds, 1, DType::f64, ReduceOp::max);
  return seconds;
}

OpFigures measure(std::shared_ptr<Comm> world, const Recipe& recipe, int iterations,
                  bool cpu_time) {
  DeviceMesh mesh(world, {world->size()});
  std::vector<ShardTensor> inputs;
  uint64_t seed = 11;
  for (size_t i = 0; i < recipe.inputs.size(); ++i) {
    Tensor values = bench::random_tensor(recipe.inputs[i], seed++);
    if (recipe.positive) {  // (0.5, 1.5): in the domain of sqrt, log and pow's base
      float* data = values.data<float>();
      for (int64_t e = 0; e < values.numel(); ++e) data[e] += 1.0f;
    }
    const bool sharded = i == 0 || recipe.inputs[i] == recipe.inputs[0];
    inputs.push_back(ShardTensor::distribute(
        values, mesh, {sharded ? Placement::shard(recipe.shard_dim) : Placement::replicate()}));
  }
  OpFigures figures;
  figures.forward = timed(*world, iterations, cpu_time, [&] {
    NoGrad no_grad;
    apply_op(recipe.op, inputs, recipe.attrs);
  });
  for (ShardTensor& input : inputs) input.set_requires_grad();
  std::vector<ShardTensor> gys;
  {
    const std::vector<ShardTensor> outputs = apply_op(recipe.op, inputs, recipe.attrs);
    for (size_t o = 0; o < outputs.size(); ++o)
      gys.push_back(ShardTensor::distribute(bench::random_tensor(outputs[o].global_shape(), 99 + o),
                                            mesh, outputs[o].placements(),
                                            outputs[o].spec().extents));
  }
  figures.forward_backward = timed(*world, iterations, cpu_time, [&] {
    Tape tape;
    const std::vector<ShardTensor> outputs = apply_op(recipe.op, inputs, recipe.attrs);
    tape.backward(outputs[0], gys[0]);
  });
  return figures;
}

/// PyTorch's seconds per op from the baseline JSON: name -> (forward, forward+backward).
std::map<std::string, std::pair<double, double>> read_baseline(const std::string& path) {
  std::map<std::string, std::pair<double, double>> baseline;
  if (path.empty()) return baseline;
  std::ifstream file(path);
  check_arg(static_cast<bool>(file), "bench", "--baseline {}: cannot open the file", path);
  nlohmann::json document;
  try {
    document = nlohmann::json::parse(file);
  } catch (const nlohmann::json::exception& error) {
    throw InvalidArgument("bench", fmt::format("--baseline {}: not JSON ({})", path, error.what()));
  }
  for (const nlohmann::json& row : document.value("rows", nlohmann::json::array()))
    baseline[row.value("op", "")] = {row.value("forward_ms", 0.0) / 1e3,
                                     row.value("forward_backward_ms", 0.0) / 1e3};
  return baseline;
}

void run_ops_bench(const OpsBenchOptions& options) {
  const Shape shape = parse_list(options.shape);
  check_arg(shape.size() == 5 && shape[1] >= 2, "bench",
            "--shape needs N,C,X,Y,Z with C >= 2, got '{}'", options.shape);
  check_arg(options.iterations >= 1, "bench", "--iterations {} must be at least 1",
            options.iterations);
  check_arg(!options.cpu_time || options.threads == 1, "bench",
            "--cpu-time counts the rank's own thread only: it needs --threads 1, got --threads {}",
            options.threads);
  std::vector<Recipe> chosen;
  const std::vector<Recipe> all = recipes(shape);
  if (options.ops.empty()) {
    chosen = all;
  } else {
    std::vector<std::string> names;
    for (size_t start = 0; start <= options.ops.size();) {
      const size_t comma = std::min(options.ops.find(',', start), options.ops.size());
      names.push_back(options.ops.substr(start, comma - start));
      start = comma + 1;
    }
    for (const std::string& name : names) {
      bool found = false;
      for (const Recipe& recipe : all)
        if (recipe.op == name || recipe.name == name) {
          chosen.push_back(recipe);
          found = true;
        }
      check_arg(found, "bench", "--ops: no benchmark for '{}'", name);
    }
  }
  const auto baseline = read_baseline(options.baseline);
  const Backend backend = backend_from_env();
  bench::BenchReport report("ops", options.json, bench::is_reporter(backend));
  report.set("shape", shape);
  report.set("backend", backend_name(backend));
  report.set("dtype", "f32");
  auto ratio = [](const char* key) {
    return [key](const nlohmann::json& row) { return bench::ratio_text(row, key, 2); };
  };
  bench::BenchTable& table = report.table(
      "rows",
      fmt::format("tessera bench ops: x {} f32 (channels-last and sequence shapes for linear, "
                  "layer_norm; [N, 1024, 4, 2C] for attention), {} backend",
                  shape, backend_name(backend)),
      {{"op", "op", "", 20},
       {"ranks", "ranks", "", 6},
       {"threads_per_rank", "threads", "", 7},
       {"forward_ms", "forward", "ms", 10, 2},
       {"forward_backward_ms", "fwd+bwd", "ms", 10, 2},
       {"", "vs 1 rank", "fwd", 9, -1, ratio("forward_vs_one_rank")},
       {"", "vs 1 rank", "f+b", 9, -1, ratio("forward_backward_vs_one_rank")},
       {"", "vs torch", "fwd", 9, -1, ratio("forward_vs_torch")},
       {"", "vs torch", "f+b", 9, -1, ratio("forward_backward_vs_torch")}});
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  for (const Recipe& recipe : chosen) {
    OpFigures one_rank;
    for (int64_t ranks : parse_list(options.ranks)) {
      check_arg(ranks >= 1, "bench", "--ranks {} must be at least 1", ranks);
      OpFigures figures;
      launch(backend, static_cast<int>(ranks), [&](std::shared_ptr<Comm> world) {
        if (options.threads > 0) choose_compute_threads(options.threads);
        OpFigures mine = measure(world, recipe, options.iterations, options.cpu_time);
        if (world->rank() == 0) figures = mine;
      });
      if (ranks == 1) one_rank = figures;
      nlohmann::json row = {
          {"op", recipe.name},
          {"ranks", ranks},
          {"threads_per_rank",
           options.threads > 0 ? options.threads : std::max(1, cores / static_cast<int>(ranks))},
          {"forward_ms", figures.forward * 1e3},
          {"forward_backward_ms", figures.forward_backward * 1e3}};
      if (ranks > 1 && one_rank.forward > 0) {
        row["forward_vs_one_rank"] = figures.forward / one_rank.forward;
        row["forward_backward_vs_one_rank"] = figures.forward_backward / one_rank.forward_backward;
      }
      if (const auto it = baseline.find(recipe.name); ranks == 1 && it != baseline.end()) {
        row["forward_vs_torch"] = figures.forward / it->second.first;
        row["forward_backward_vs_torch"] = figures.forward_backward / it->second.second;
      }
      table.add(row);
    }
  }
  report.finish();
}

}  // namespace

void register_ops_bench(CLI::App& bench) {
  auto options = std::make_shared<OpsBenchOptions>();
  auto* command = bench.add_subcommand(
      "ops", "Every op of the op library, forward and fwd+bwd, on 1 rank and sharded over 2");
  command->add_option("--shape", options->shape, "x as N,C,X,Y,Z")->capture_default_str();
  command->add_option("--ops", options->ops,
                      "Ops (or row names) to run, comma-separated (default: all)");
  command->add_option("--ranks", options->ranks, "Rank counts, comma-separated")
      ->capture_default_str();
  command->add_option("--threads", options->threads, "Compute threads per rank (0: cores / ranks)")
      ->check(CLI::Range(0, 4096));
  command->add_option("--iterations", options->iterations, "Timed runs per figure")
      ->capture_default_str();
  command->add_option("--baseline", options->baseline,
                      "JSON of apps/bench/torch_ops_bench.py --json (same shape and threads)");
  command->add_flag("--json", options->json, "Print JSON instead of the table");
  command->add_flag("--cpu-time", options->cpu_time,
                    "Time each rank's thread cpu time instead of wall time (needs --threads 1)");
  command->callback([options] { run_ops_bench(*options); });
}

}  // namespace tessera::cli
