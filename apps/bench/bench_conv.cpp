// `tessera bench conv`: sharded convolution forward and forward+backward (conv backward data,
// weight and bias through the tape), unsharded on 1 rank vs sharded over P ranks along the
// first spatial dim, with GFLOP/s, the halo exchange's own time, and a correctness check of
// the sharded output against the 1-rank output (#wrong). PyTorch's figures for the same shapes
// come from apps/bench/torch_conv_bench.py.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "apps/bench/bench_table.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/compute_threads.hpp"
#include "core/halo/halo_exchange.hpp"
#include "core/tessera.hpp"
#include "ops/ops.hpp"

namespace tessera::cli {

namespace {

using bench::random_tensor;

struct ConvBenchOptions {
  std::vector<std::string> shapes{"1,16,512,512", "1,16,128,128,128"};
  int64_t kernel = 3;
  std::string ranks = "1,2";
  int threads = 0;  // per rank; 0 = cores / ranks
  int iterations = 3;
  bool json = false;
};

struct ConvFigures {
  double forward = 0, forward_backward = 0, halo = 0;
  Tensor y;  // full output (rank 0) for the check
};

/// Runs the benchmark of one shape on `world` (all ranks shard the first spatial dim).
ConvFigures measure(std::shared_ptr<Comm> world, const Shape& x_shape, int64_t kernel,
                    int iterations) {
  DeviceMesh mesh(world, {world->size()}, {"domain"});
  const int64_t channels = x_shape[1];
  const int spatial = static_cast<int>(x_shape.size()) - 2;
  Shape w_shape{channels, channels};
  for (int i = 0; i < spatial; ++i) w_shape.push_back(kernel);
  const std::vector<Placement> sharded{Placement::shard(2)}, replicated{Placement::replicate()};
  // Only this rank's piece of x is generated from the global pattern (seeded by global index).
  const Tensor full_x = random_tensor(x_shape, 11);
  ShardTensor x = ShardTensor::distribute(full_x, mesh, sharded);
  ShardTensor w = ShardTensor::distribute(random_tensor(w_shape, 12), mesh, replicated);
  ShardTensor b = ShardTensor::distribute(random_tensor({channels}, 13), mesh, replicated);
  ops::ConvOptions same;
  same.padding_name = "same";
  ConvFigures figures;
  auto timed = [&](auto&& body) {
    body();  // warm-up: primitives, plans, allocator
    world->barrier();
    const double start = now_seconds();
    for (int i = 0; i < iterations; ++i) body();
    double seconds = (now_seconds() - start) / iterations;
    world->all_reduce(&seconds, &seconds, 1, DType::f64, ReduceOp::max);
    return seconds;
  };
  ShardTensor y = ops::conv(x, w, b, same);
  figures.forward = timed([&] { y = ops::conv(x, w, b, same); });
  const ShardTensor gy = ShardTensor::distribute(random_tensor(y.global_shape(), 14), mesh,
                                                 y.placements(), y.spec().extents);
  x.set_requires_grad();
  w.set_requires_grad();
  b.set_requires_grad();
  figures.forward_backward = timed([&] {
    Tape tape;
    const ShardTensor out = ops::conv(x, w, b, same);
    tape.backward(out, gy);
  });
  // The halo exchange alone, on the plan the conv uses.
  std::vector<int64_t> lo(x_shape.size(), 0), hi(x_shape.size(), 0);
  lo[2] = hi[2] = kernel / 2;
  const auto plan = cached_halo_plan(
      x.spec(), lo, hi, std::vector<BoundaryMode>(x_shape.size(), BoundaryMode::zero), mesh.rank());
  figures.halo = timed([&] {
    HaloExchange exchange = halo_begin(*plan, x.to_local(), mesh.comm());
    halo_end(exchange);
  });
  figures.y = y.gather(0);
  return figures;
}

double conv_flops(const Shape& x_shape, int64_t kernel) {
  double flops = 2.0 * x_shape[0] * x_shape[1] * x_shape[1];  // N * Cout * Cin, 2 per MAC
  for (size_t d = 2; d < x_shape.size(); ++d) flops *= static_cast<double>(x_shape[d]) * kernel;
  return flops;
}

void run_conv_bench(const ConvBenchOptions& options) {
  parse_rank_counts(options.ranks, "--ranks");  // a bad list fails before any measurement
  nlohmann::json rows = nlohmann::json::array();
  const Backend backend = backend_from_env();
  // Under mpiexec every process runs this function; only world rank 0 reports.
  const bool reporter = backend != Backend::mpi || mpi_world()->rank() == 0;
  if (!options.json && reporter)
    fmt::print(
        "# tessera bench conv: f32, padding same, Cout = C, sharded along the first spatial dim\n"
        "# {:<22} {:>5} {:>7} {:>12} {:>9} {:>14} {:>9} {:>10} {:>7}\n",
        "shape N,C,spatial", "ranks", "threads", "forward ms", "GFLOP/s", "fwd+bwd ms", "GFLOP/s",
        "halo ms", "#wrong");
  for (const std::string& shape_text : options.shapes) {
    const Shape x_shape = parse_list(shape_text);
    check_arg(x_shape.size() >= 3 && x_shape.size() <= 5, "bench", "shape {} is not N,C,spatial..",
              x_shape);
    const double flops = conv_flops(x_shape, options.kernel);
    Tensor reference;
    for (int64_t ranks : parse_rank_counts(options.ranks, "--ranks")) {
      ConvFigures figures;
      const int threads = options.threads;
      launch(backend, static_cast<int>(ranks), [&](std::shared_ptr<Comm> world) {
        if (threads > 0) set_compute_threads(threads);
        ConvFigures mine = measure(world, x_shape, options.kernel, options.iterations);
        if (world->rank() == 0) figures = std::move(mine);
      });
      // The first configuration (normally 1 rank) is the reference output.
      int64_t wrong = 0;
      if (reference.numel() == 0) {
        reference = figures.y;
      } else {
        const float* a = figures.y.data<float>();
        const float* r = reference.data<float>();
        for (int64_t i = 0; i < reference.numel(); ++i)
          wrong += std::fabs(a[i] - r[i]) > 1e-4f * (1 + std::fabs(r[i]));
      }
      const int used_threads =
          threads > 0 ? threads
                      : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) /
                                        static_cast<int>(ranks));
      const double backward_flops = 3 * flops;  // forward + backward data + backward weight
      if (!options.json && reporter)
        fmt::print("  {:<22} {:>5} {:>7} {:>12.2f} {:>9.1f} {:>14.2f} {:>9.1f} {:>10.3f} {:>7}\n",
                   shape_text, ranks, used_threads, figures.forward * 1e3,
                   flops / figures.forward / 1e9, figures.forward_backward * 1e3,
                   backward_flops / figures.forward_backward / 1e9, figures.halo * 1e3, wrong);
      rows.push_back({{"shape", x_shape},
                      {"kernel", options.kernel},
                      {"ranks", ranks},
                      {"threads_per_rank", used_threads},
                      {"backend", backend_name(backend)},
                      {"forward_ms", figures.forward * 1e3},
                      {"forward_gflops", flops / figures.forward / 1e9},
                      {"forward_backward_ms", figures.forward_backward * 1e3},
                      {"forward_backward_gflops", backward_flops / figures.forward_backward / 1e9},
                      {"halo_ms", figures.halo * 1e3},
                      {"halo_overlapped", 0.0},
                      {"wrong", wrong}});
    }
  }
  if (options.json)
    std::cout << nlohmann::json{{"benchmark", "conv"}, {"rows", rows}}.dump(2) << "\n";
}

}  // namespace

void register_conv_bench(CLI::App& bench) {
  auto options = std::make_shared<ConvBenchOptions>();
  auto* conv =
      bench.add_subcommand("conv", "Sharded conv forward and forward+backward vs one rank");
  conv->add_option("--shape", options->shapes, "Input shapes N,C,spatial.. (repeatable)")
      ->capture_default_str();
  conv->add_option("--kernel", options->kernel, "Kernel extent per spatial dim (at least 1)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  conv->add_option("--ranks", options->ranks, "Rank counts to run, e.g. 1,2,4")
      ->capture_default_str();
  conv->add_option("--threads", options->threads, "Compute threads per rank (0: cores / ranks)")
      ->check(CLI::Range(0, 4096));
  conv->add_option("--iterations", options->iterations, "Timed iterations (at least 1)")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  conv->add_flag("--json", options->json, "Print JSON instead of the table");
  conv->callback([options] { run_conv_bench(*options); });
}

}  // namespace tessera::cli
