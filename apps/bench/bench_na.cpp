// `tessera bench na`: the sharded neighborhood attention op (2-d, heads-last [B, X, Y, heads, D]),
// forward and forward+backward (dq, dk, dv through the tape) on 1 rank and on P local ranks that
// share the cores (or, with --device cuda, the GPUs: rank r on cuda:(r % devices)), sharded over
// the spatial axes, with GFLOP/s and a correctness check of the sharded output against the
// 1-rank output (#wrong). A second table times the kernels alone on a smaller size: on cpu the
// fast kernels against the exact reference (which is slow), on cuda the kernel the dispatch picks
// (fused for f16/bf16 with D of 32, 64 or 128) against the plain one, with #wrong of the first
// against the second. PyTorch's figures for the same shapes come from
// apps/bench/torch_na_bench.py. FLOP counts: docs/benchmarks.md.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "apps/bench/bench_harness.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/compute_threads.hpp"
#include "core/gpu_runtime.hpp"
#include "core/tessera.hpp"
#include "core/trace.hpp"
#include "ops/attention/na_cpu.hpp"
#include "ops/attention/na_cuda.hpp"
#include "ops/attention/na_op.hpp"
#include "ops/cpu_isa.hpp"

namespace tessera::cli {

namespace {

using bench::random_tensor;

struct NaBenchOptions {
  std::string device = "cpu";
  std::string dtype = "f32";
  int64_t batch = 1;
  int64_t size = 256;  // tokens per spatial axis
  int64_t heads = 4;
  int64_t dim = 64;
  std::string kernels = "7,13";
  std::string ranks = "1";
  int threads = 0;  // per rank; 0 = cores / ranks
  int iterations = 3;
  int64_t reference_size = 48;  // tokens per axis of the kernel-vs-reference table (0: skip it)
  bool json = false;
};

/// Forward FLOPs: 2 per multiply-add of q.k and of p.v over every (query, key, head, D).
double na_flops(const Shape& shape, int64_t kernel) {
  const int64_t spatial = static_cast<int64_t>(shape.size()) - 3;
  double flops = 4.0 * shape[0] * shape[shape.size() - 2] * shape.back();
  for (int64_t a = 0; a < spatial; ++a) flops *= static_cast<double>(shape[1 + a]) * kernel;
  return flops;
}

/// Mesh over the two spatial axes for P ranks: (px, py) with px >= py, px * py = P, as square
/// as P allows.
std::vector<int> mesh_for(int ranks) {
  int py = static_cast<int>(std::sqrt(static_cast<double>(ranks)));
  while (ranks % py != 0) --py;
  return {ranks / py, py};
}

struct NaFigures {
  double forward = 0, forward_backward = 0;
  /// On cuda: the calls that blocked a host thread on the device (gpu::host_waits) per
  /// forward+backward step, summed over the ranks of this process; -1 on the cpu.
  double host_waits_per_step = -1;
  Tensor output;  // full o (rank 0) for the check
};

/// Where one rank's tensors live: cpu, or cuda:(rank % devices) (cuda:N: that device).
Device rank_device(const std::string& device, int rank) {
  if (device == "cpu") return Device::cpu();
  const int count = gpu::device_count();
  check_arg(count > 0, "bench", "--device {}: no CUDA device is visible", device);
  const Device parsed = Device::parse(device);
  return device == "cuda" ? Device::cuda(rank % count) : parsed;
}

/// A ShardTensor's local piece moved to `device` (same layout).
ShardTensor placed(const ShardTensor& t, Device device) {
  return device.is_cpu() ? t : ShardTensor(t.to_local().to(device), t.mesh(), t.spec());
}

NaFigures measure(std::shared_ptr<Comm> world, const Shape& shape, int64_t kernel, DType dtype,
                  int iterations, Device device) {
  const std::vector<int> mesh_shape = mesh_for(world->size());
  DeviceMesh mesh(world, mesh_shape, {"x", "y"});
  const std::vector<Placement> sharded{Placement::shard(1), Placement::shard(2)};
  auto input = [&](uint64_t seed) {
    return placed(ShardTensor::distribute(random_tensor(shape, seed, dtype), mesh, sharded),
                  device);
  };
  ShardTensor q = input(21), k = input(22), v = input(23);
  ops::NaOptions options;
  options.kernel_size = {kernel};
  // One untimed run first: plans, allocator.
  auto timed = [&](const std::function<void()>& body) {
    return bench::time_collective(*world, device, 1, iterations, body);
  };
  NaFigures figures;
  ops::NaResult result = ops::neighborhood_attention(q, k, v, options);
  figures.forward = timed([&] { result = ops::neighborhood_attention(q, k, v, options); });
  const ShardTensor grad = input(24);
  q.set_requires_grad();
  k.set_requires_grad();
  v.set_requires_grad();
  auto step = [&] {
    trace::Span span("step", "na forward+backward");
    Tape tape;
    const ops::NaResult out = ops::neighborhood_attention(q, k, v, options);
    tape.backward(out.output, grad);
  };
  figures.forward_backward = timed(step);
  if (device.is_cuda()) {
    // Every rank reads the process's counter before the barrier that lets the steps start and
    // after the one that ends them, so the count holds exactly the steps of every local rank.
    constexpr int kSteps = 3;
    synchronize(compute_stream_for(device));
    world->barrier();
    const uint64_t before = gpu::host_waits();
    world->barrier();
    for (int i = 0; i < kSteps; ++i) step();
    world->barrier();
    const uint64_t after = gpu::host_waits();
    world->barrier();
    synchronize(compute_stream_for(device));
    figures.host_waits_per_step = static_cast<double>(after - before) / kSteps;
  }
  figures.output = result.output.gather(0).to(Device::cpu());
  return figures;
}

/// Elements of `a` that differ from `reference` by more than the dtype's tolerance.
int64_t count_wrong(const Tensor& a, const Tensor& reference, double tolerance) {
  const Tensor x = a.to_dtype(DType::f64).contiguous();
  const Tensor r = reference.to_dtype(DType::f64).contiguous();
  int64_t wrong = 0;
  for (int64_t i = 0; i < r.numel(); ++i) {
    const double expected = r.data<double>()[i];
    wrong += std::fabs(x.data<double>()[i] - expected) > tolerance * (1 + std::fabs(expected));
  }
  return wrong;
}

double tolerance_of(DType dtype) {
  switch (dtype) {
    case DType::f64: return 1e-10;
    case DType::f32: return 1e-4;
    default: return 2e-2;
  }
}

/// The kernels alone on one rank: reference vs fast, forward and forward+backward.
struct KernelFigures {
  double reference_forward = 0, reference_forward_backward = 0;
  double fast_forward = 0, fast_forward_backward = 0;
  int64_t wrong = 0;
  // cpu: the forward kernel the fast path picks, and the query tiles' forward asked for (the
  // kernel lane tiles replace where they run).
  std::string fast_kernel;
  double tiles_forward = 0;
};

KernelFigures measure_kernels(const Shape& shape, int64_t kernel, DType dtype, int threads,
                              int iterations) {
  const Tensor q = random_tensor(shape, 31, dtype), k = random_tensor(shape, 32, dtype);
  const Tensor v = random_tensor(shape, 33, dtype), grad = random_tensor(shape, 34, dtype);
  const ops::NaGeometry geometry{{shape[1], shape[2]},
                                 {kernel, kernel},
                                 {1, 1},
                                 {0, 0},
                                 1.0 / std::sqrt(static_cast<double>(shape.back()))};
  const ops::NaPieces whole{{0, 0}, {0, 0}};
  // The reference runs once (after a warm-up), the fast kernels `iterations` times.
  auto timed = [&](int runs, const std::function<void()>& body) {
    return bench::time_rank(Device::cpu(), 1, runs, body);
  };
  KernelFigures figures;
  ops::NaForward exact, fast;
  figures.reference_forward =
      timed(1, [&] { exact = ops::na_forward(q, k, v, nullptr, geometry, whole); });
  figures.fast_forward = timed(iterations, [&] {
    fast = ops::NaForward{};  // released first, so the allocator's cache serves the next call
    fast = ops::na_cpu_forward(q, k, v, nullptr, geometry, whole, threads);
  });
  // The query tiles' forward: the fast one already when the fast path picks them.
  const bool lanes =
      ops::na_cpu_forward_kernel(q, k, v, nullptr, geometry, whole) == ops::NaCpuForward::lanes;
  figures.fast_kernel = lanes ? "lane tiles" : "query tiles";
  figures.tiles_forward =
      lanes ? timed(iterations,
                    [&] {
                      ops::na_cpu_forward(q, k, v, nullptr, geometry, whole, threads,
                                          ops::NaCpuForward::query_tiles);
                    })
            : figures.fast_forward;
  figures.reference_forward_backward = timed(1, [&] {
    ops::na_forward(q, k, v, nullptr, geometry, whole);
    ops::na_backward(q, k, v, nullptr, grad, nullptr, geometry, whole);
  });
  figures.fast_forward_backward = timed(iterations, [&] {
    ops::na_cpu_forward(q, k, v, nullptr, geometry, whole, threads);
    ops::na_cpu_backward(q, k, v, nullptr, grad, nullptr, geometry, whole, threads);
  });
  figures.wrong = count_wrong(fast.output, exact.output, tolerance_of(dtype));
  return figures;
}

/// The cuda kernels alone on one rank: the plain kernel (as "reference") against the one the
/// dispatch picks (as "fast"), both `iterations` times.
KernelFigures measure_cuda_kernels(const Shape& shape, int64_t kernel, DType dtype, int iterations,
                                   Device device) {
  const Tensor q = random_tensor(shape, 31, dtype).to(device);
  const Tensor k = random_tensor(shape, 32, dtype).to(device);
  const Tensor v = random_tensor(shape, 33, dtype).to(device);
  const Tensor grad = random_tensor(shape, 34, dtype).to(device);
  const ops::NaGeometry geometry{{shape[1], shape[2]},
                                 {kernel, kernel},
                                 {1, 1},
                                 {0, 0},
                                 1.0 / std::sqrt(static_cast<double>(shape.back()))};
  const ops::NaPieces whole{{0, 0}, {0, 0}};
  const Stream stream = compute_stream_for(device);
  auto timed = [&](const std::function<void()>& body) {
    return bench::time_rank(device, 1, iterations, body);
  };
  const ops::kernels::NaKernel chosen = ops::na_cuda_kernel_for(q);
  KernelFigures figures;
  ops::NaForward plain, fast;
  auto run = [&](ops::kernels::NaKernel which, ops::NaForward& out, bool backward) {
    out = ops::NaForward{};
    out = ops::na_cuda_forward(q, k, v, nullptr, geometry, whole, stream, which);
    if (backward)
      ops::na_cuda_backward(q, k, v, nullptr, &out.output, out.lse, grad, nullptr, geometry, whole,
                            stream, which);
  };
  figures.reference_forward = timed([&] { run(ops::kernels::NaKernel::plain, plain, false); });
  figures.fast_forward = timed([&] { run(chosen, fast, false); });
  figures.reference_forward_backward =
      timed([&] { run(ops::kernels::NaKernel::plain, plain, true); });
  figures.fast_forward_backward = timed([&] { run(chosen, fast, true); });
  figures.wrong = count_wrong(fast.output.to(Device::cpu()), plain.output.to(Device::cpu()),
                              tolerance_of(dtype));
  return figures;
}

void run_na_bench(const NaBenchOptions& options) {
  parse_rank_counts(options.ranks, "--ranks");  // a bad list fails before any measurement
  const bool on_cuda = Device::parse(options.device).is_cuda();
  if (on_cuda) rank_device(options.device, 0);  // no visible device: fails before measuring
  const DType dtype = dtype_from_name(options.dtype);
  check_arg(is_floating(dtype), "bench", "--dtype {} is not a floating dtype", options.dtype);
  const Backend backend = backend_from_env();
  const bool reporter = bench::is_reporter(backend);
  const Shape shape{options.batch, options.size, options.size, options.heads, options.dim};
  bench::BenchReport report("na", options.json, reporter);
  report.set("dtype", dtype_name(dtype));
  report.set("backend", backend_name(backend));
  report.set("cpu_isa", ops::cpu_isa_name());      // TESSERA_CPU_ISA may ask for a lower one
  report.set("kernels", nlohmann::json::array());  // the kernels table's rows, when it runs
  // The kernel the dispatch runs on cuda for this dtype and head dim (TESSERA_NA_CUDA_KERNEL).
  const char* cuda_kernel =
      on_cuda ? ops::kernels::na_kernel_name(ops::na_cuda_kernel_for(Tensor::zeros(
                    {1, 8, options.heads, options.dim}, dtype, rank_device(options.device, 0))))
              : "";
  if (on_cuda) {
    report.set("cuda_forward_kernel", cuda_kernel);
    // The mma forward's blocks per SM (TESSERA_NA_MMA_FORWARD_BLOCKS: 4, the default, or auto).
    const int blocks = ops::na_cuda_mma_forward_blocks();
    report.set("mma_forward_blocks", blocks == 0 ? std::string("auto") : std::to_string(blocks));
  }
  // On the cpu, the forward's GFLOP/s as a share of the FMA peak of the cores a row uses (one
  // core's peak measured here, at the instruction set the kernels run with).
  const double peak_per_core = on_cuda ? 0.0 : ops::cpu_fma_peak_gflops();
  if (peak_per_core > 0) report.set("fma_peak_gflops_per_core", peak_per_core);
  std::vector<bench::Column> columns{{"shape", "shape", "", 18},
                                     {"kernel", "k", "", 3},
                                     {"ranks", "ranks", "", 6},
                                     {"threads_per_rank", "threads", "", 7},
                                     {"forward_ms", "forward", "ms", 12, 2},
                                     {"forward_gflops", "forward", "GFLOP/s", 9, 1}};
  if (peak_per_core > 0) columns.push_back({"forward_peak_percent", "forward", "% peak", 7, 1});
  columns.insert(columns.end(), {{"forward_backward_ms", "fwd+bwd", "ms", 14, 2},
                                 {"forward_backward_gflops", "fwd+bwd", "GFLOP/s", 9, 1},
                                 {"wrong", "#wrong", "", 7}});
  bench::BenchTable& table = report.table(
      "rows",
      fmt::format(
          "tessera bench na: {} on {}, 2-d [B, X, Y, heads, D], non-causal, dilation 1, "
          "sharded over X and Y{}",
          dtype_name(dtype), options.device,
          options.device == "cpu"
              ? fmt::format(", cpu kernels with {}{}", ops::cpu_isa_name(),
                            peak_per_core > 0
                                ? fmt::format(" (FMA peak {:.1f} GFLOP/s per core)", peak_per_core)
                                : std::string())
              : std::string()),
      columns);
  for (int64_t kernel : parse_list(options.kernels)) {
    check_arg(kernel >= 1 && kernel <= options.size, "bench", "kernel {} does not fit size {}",
              kernel, options.size);
    const double flops = na_flops(shape, kernel);
    const double backward_flops = 3.5 * flops;  // forward + backward (2.5x the forward)
    Tensor reference;
    for (int64_t ranks : parse_rank_counts(options.ranks, "--ranks")) {
      NaFigures figures;
      const int threads = options.threads;
      launch(backend, static_cast<int>(ranks), [&](std::shared_ptr<Comm> world) {
        if (threads > 0) choose_compute_threads(threads);
        NaFigures mine = measure(world, shape, kernel, dtype, options.iterations,
                                 rank_device(options.device, world->rank()));
        if (world->rank() == 0) figures = std::move(mine);
      });
      // The first configuration (normally 1 rank) is the reference output.
      int64_t wrong = 0;
      if (reference.numel() == 0)
        reference = figures.output;
      else
        wrong = count_wrong(figures.output, reference, tolerance_of(dtype));
      const int used_threads =
          threads > 0 ? threads
                      : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) /
                                        static_cast<int>(ranks));
      const double forward_gflops = flops / figures.forward / 1e9;
      nlohmann::json row{
          {"shape", shape},
          {"kernel", kernel},
          {"dtype", dtype_name(dtype)},
          {"ranks", ranks},
          {"threads_per_rank", used_threads},
          {"backend", backend_name(backend)},
          {"forward_ms", figures.forward * 1e3},
          {"forward_gflops", forward_gflops},
          {"forward_backward_ms", figures.forward_backward * 1e3},
          {"step_seconds", figures.forward_backward},
          {"forward_backward_gflops", backward_flops / figures.forward_backward / 1e9},
          {"wrong", wrong}};
      if (figures.host_waits_per_step >= 0)
        row["host_waits_per_step"] = figures.host_waits_per_step;
      if (peak_per_core > 0) {
        // The cores the row's ranks and threads occupy, at most the machine's.
        const int64_t hardware = std::max(1u, std::thread::hardware_concurrency());
        const int64_t cores = std::min<int64_t>(hardware, ranks * used_threads);
        row["forward_peak_percent"] =
            100.0 * forward_gflops / (peak_per_core * static_cast<double>(cores));
      }
      table.add(row);
    }
  }
  // Kernels alone, fast vs reference, on a size the reference finishes in seconds.
  if (options.reference_size > 0 && reporter) {
    const Shape small{options.batch, options.reference_size, options.reference_size, options.heads,
                      options.dim};
    // One rank alone: all the cores, as for the 1-rank rows (not this thread's share from the
    // last launch).
    const int threads = options.threads > 0
                            ? options.threads
                            : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    auto speedup = [](const char* reference, const char* fast) {
      return [=](const nlohmann::json& row) {
        return fmt::format("{:.0f}x", row[reference].get<double>() / row[fast].get<double>());
      };
    };
    std::vector<bench::Column> columns{
        {"shape", "shape", "", 18},
        {"kernel", "k", "", 3},
        {"reference_forward_ms", "ref fwd", "ms", 13, 1},
        {"fast_forward_ms", "fast fwd", "ms", 9, 2},
        {"", "speedup", "", 8, -1, speedup("reference_forward_ms", "fast_forward_ms")},
        {"reference_forward_backward_ms", "ref f+b", "ms", 13, 1},
        {"fast_forward_backward_ms", "fast f+b", "ms", 9, 2},
        {"", "speedup", "", 8, -1,
         speedup("reference_forward_backward_ms", "fast_forward_backward_ms")},
        {"wrong", "#wrong", "", 7}};
    if (!on_cuda) {
      // The forward the fast path picks and the query tiles' forward beside it.
      columns.insert(columns.begin() + 5, {"fast_forward_kernel", "fast kernel", "", 12});
      columns.insert(columns.begin() + 6, {"tiles_forward_ms", "tiles fwd", "ms", 10, 2});
    }
    bench::BenchTable& kernels = report.table(
        "kernels",
        on_cuda ? fmt::format("cuda kernels alone (1 rank on {}): ref = the plain kernel, fast = "
                              "the dispatched one ({})",
                              rank_device(options.device, 0).str(), cuda_kernel)
                : fmt::format("kernels alone (1 rank, fast on {} thread(s), reference "
                              "single-threaded in f64; tiles fwd = the query tiles' forward)",
                              threads),
        std::move(columns));
    for (int64_t kernel : parse_list(options.kernels)) {
      if (kernel > options.reference_size) continue;
      const KernelFigures f =
          on_cuda ? measure_cuda_kernels(small, kernel, dtype, options.iterations,
                                         rank_device(options.device, 0))
                  : measure_kernels(small, kernel, dtype, threads, options.iterations);
      const double flops = na_flops(small, kernel);
      nlohmann::json row{
          {"shape", small},
          {"kernel", kernel},
          {"dtype", dtype_name(dtype)},
          {"threads", threads},
          {"reference_forward_ms", f.reference_forward * 1e3},
          {"fast_forward_ms", f.fast_forward * 1e3},
          {"fast_forward_gflops", flops / f.fast_forward / 1e9},
          {"reference_forward_backward_ms", f.reference_forward_backward * 1e3},
          {"fast_forward_backward_ms", f.fast_forward_backward * 1e3},
          {"fast_forward_backward_gflops", 3.5 * flops / f.fast_forward_backward / 1e9},
          {"wrong", f.wrong}};
      if (!on_cuda) {
        row["fast_forward_kernel"] = f.fast_kernel;
        row["tiles_forward_ms"] = f.tiles_forward * 1e3;
      }
      kernels.add(std::move(row));
    }
  }
  report.finish();
}

}  // namespace

void register_na_bench(CLI::App& bench) {
  auto options = std::make_shared<NaBenchOptions>();
  auto* na = bench.add_subcommand(
      "na", "Neighborhood attention forward and forward+backward: 1 rank, P ranks, reference");
  na->add_option("--device", options->device, "cpu, cuda (rank r on cuda:(r % devices)) or cuda:N")
      ->capture_default_str();
  na->add_option("--dtype", options->dtype, "f32, f64, f16 or bf16")->capture_default_str();
  na->add_option("--batch", options->batch, "Batch size B")
      ->check(integer_at_least(1))
      ->capture_default_str();
  na->add_option("--size", options->size, "Tokens per spatial axis (X = Y)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  na->add_option("--heads", options->heads, "Heads")
      ->check(integer_at_least(1))
      ->capture_default_str();
  na->add_option("--dim", options->dim, "Head dim D")
      ->check(integer_at_least(1))
      ->capture_default_str();
  na->add_option("--kernel", options->kernels, "Kernel sizes to run, e.g. 7,13")
      ->capture_default_str();
  na->add_option("--ranks", options->ranks, "Rank counts to run, e.g. 1,2,4")
      ->capture_default_str();
  na->add_option("--threads", options->threads, "Compute threads per rank (0: cores / ranks)")
      ->check(CLI::Range(0, 4096));
  na->add_option("--iterations", options->iterations, "Timed iterations (at least 1)")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  na->add_option("--reference-size", options->reference_size,
                 "Tokens per axis of the fast-vs-reference kernel table (0: skip)")
      ->check(integer_at_least(0))
      ->capture_default_str();
  na->add_flag("--json", options->json, "Print JSON instead of the tables");
  add_trace_option(*na);
  na->callback([options] { run_na_bench(*options); });
}

}  // namespace tessera::cli
