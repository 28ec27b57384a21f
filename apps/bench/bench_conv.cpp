// `tessera bench conv`: sharded convolution forward and forward+backward (conv backward data,
// weight and bias through the tape), unsharded on 1 rank vs sharded over P ranks along the
// first spatial dim, with GFLOP/s, the halo exchange's own time, and a correctness check of
// the sharded output against the 1-rank output (#wrong, and the largest error). PyTorch's figures
// for the same shapes come from apps/bench/torch_conv_bench.py.
//
// --device cuda runs cuDNN (f32 without TF32, or --dtype bf16/f16), timed with CUDA events on
// each rank's compute stream (all local ranks share the visible GPUs round-robin), and adds the
// achieved memory bandwidth: the bytes of x, w and y one pass reads and writes (forward: x + w +
// y; forward+backward: that, plus backward data dy + w + dx, backward filter x + dy + dw and
// backward bias dy) over its time. --no-comm times each rank's local conv on its haloed piece
// alone (no halo exchange, no tape): the compute the sharded run cannot avoid.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>

#include "apps/bench/bench_harness.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/compute_threads.hpp"
#include "core/gpu_runtime.hpp"
#include "core/halo/halo_exchange.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/tessera.hpp"
#include "core/trace.hpp"
#include "ops/conv/conv_cudnn.hpp"
#include "ops/conv/conv_kernels.hpp"
#include "ops/ops.hpp"

namespace tessera::cli {

namespace {

using bench::random_tensor;

struct ConvBenchOptions {
  std::vector<std::string> shapes;  // empty: the defaults of the device
  int64_t kernel = 0;               // 0: 5 for conv1d, 3 otherwise
  std::string ranks;                // empty: 1,2 on cpu, 1,4 on cuda
  int threads = 0;                  // per rank; 0 = cores / ranks
  int iterations = 3;
  bool json = false;
  std::string device = "cpu";
  std::string dtype = "f32";
  bool no_comm = false;
};

// The shapes of the GPU issue: conv1d k5, conv2d and conv3d k3, padding same, Cout = C.
const std::vector<std::string> kCpuShapes{"1,16,512,512", "1,16,128,128,128"};
const std::vector<std::string> kCudaShapes{"8,64,1048576", "1,32,2048,2048", "4,64,1024,1024",
                                           "1,16,256,256,256", "2,32,128,128,128"};

int64_t kernel_for(const ConvBenchOptions& options, const Shape& x_shape) {
  if (options.kernel > 0) return options.kernel;
  return x_shape.size() == 3 ? 5 : 3;
}

/// Where one rank's tensors live: cpu, or cuda:(rank % devices).
Device rank_device(const std::string& device, int rank) {
  if (device == "cpu") return Device::cpu();
  const int count = gpu::device_count();
  check_arg(count > 0, "bench", "--device {}: no CUDA device is visible", device);
  const Device parsed = Device::parse(device);
  return device == "cuda" ? Device::cuda(rank % count) : parsed;
}

/// A ShardTensor's local piece moved to `device` in `dtype` (same layout).
ShardTensor placed(const ShardTensor& t, Device device, DType dtype) {
  if (device.is_cpu() && dtype == t.to_local().dtype()) return t;
  return ShardTensor(t.to_local().to_dtype(dtype).to(device), t.mesh(), t.spec());
}

struct ConvFigures {
  double forward = 0, forward_backward = 0, halo = 0;
  double inputs = 0;  // host seconds making x, w, b and gy and moving them to the device
  Tensor y;           // full output (rank 0, cpu, bench dtype) for the check
};

/// --no-comm: each rank's local conv (forward; forward + backward data, filter and bias) on a
/// piece of its share of the first spatial dim plus the halo, with no exchange and no tape.
ConvFigures measure_local(std::shared_ptr<Comm> world, const Shape& x_shape, int64_t kernel,
                          int iterations, Device device, DType dtype) {
  const int64_t channels = x_shape[1];
  const int spatial = static_cast<int>(x_shape.size()) - 2;
  Shape piece = x_shape, w_shape{channels, channels};
  piece[2] = default_split(x_shape[2], world->size())[world->rank()] + kernel - 1;
  for (int i = 0; i < spatial; ++i) {
    w_shape.push_back(kernel);
    if (i > 0) piece[2 + i] += kernel - 1;
  }
  const Tensor x = random_tensor(piece, 11, dtype).to(device);
  const Tensor w = random_tensor(w_shape, 12, dtype).to(device);
  const Tensor b = random_tensor({channels}, 13, dtype).to(device);
  const ops::ConvGeometry geometry{std::vector<int64_t>(spatial, 1),
                                   std::vector<int64_t>(spatial, 1), 1};
  Tensor y = ops::conv_forward(x, w, &b, geometry);
  const Tensor gy = random_tensor(y.shape(), 14, dtype).to(device);
  // One untimed run first: algorithms, plans, allocator.
  auto timed = [&](const std::function<void()>& body) {
    return bench::time_collective(*world, device, 1, iterations, body);
  };
  ConvFigures figures;
  figures.forward = timed([&] { y = ops::conv_forward(x, w, &b, geometry); });
  figures.forward_backward = timed([&] {
    y = ops::conv_forward(x, w, &b, geometry);
    ops::conv_backward_data(gy, w, x.shape(), geometry);
    ops::conv_backward_weight(x, gy, w.shape(), geometry);
    ops::conv_backward_bias(gy);
  });
  return figures;
}

/// This rank's piece of the global benchmark tensor seeded `seed` laid out by `spec`: only its
/// box is made (bench_inputs.hpp), on the host in `dtype`, and moved to `device` once. No data
/// moves between ranks: every rank makes its own box of the same global values.
ShardTensor rank_input(const DeviceMesh& mesh, const ShardSpec& spec, uint64_t seed, Device device,
                       DType dtype) {
  return ShardTensor(
      bench::random_box(spec.global_shape, spec.local_box(mesh.coord()), seed, dtype).to(device),
      mesh, spec);
}

/// Runs the benchmark of one shape on `world` (all ranks shard the first spatial dim).
ConvFigures measure(std::shared_ptr<Comm> world, const Shape& x_shape, int64_t kernel,
                    int iterations, Device device, DType dtype) {
  DeviceMesh mesh(world, {world->size()}, {"domain"});
  const int64_t channels = x_shape[1];
  const int spatial = static_cast<int>(x_shape.size()) - 2;
  Shape w_shape{channels, channels};
  for (int i = 0; i < spatial; ++i) w_shape.push_back(kernel);
  const std::vector<Placement> sharded{Placement::shard(2)}, replicated{Placement::replicate()};
  ConvFigures figures;
  const double inputs_start = now_seconds();
  // x and gy are the large tensors: each rank makes only its own box of them.
  ShardTensor x =
      rank_input(mesh, ShardSpec::make(x_shape, mesh.shape(), sharded), 11, device, dtype);
  ShardTensor w =
      placed(ShardTensor::distribute(random_tensor(w_shape, 12), mesh, replicated), device, dtype);
  ShardTensor b = placed(ShardTensor::distribute(random_tensor({channels}, 13), mesh, replicated),
                         device, dtype);
  figures.inputs = now_seconds() - inputs_start;
  ops::ConvOptions same;
  same.padding_name = "same";
  // One untimed run first: algorithms, plans, allocator.
  auto timed = [&](const std::function<void()>& body) {
    return bench::time_collective(*world, device, 1, iterations, body);
  };
  ShardTensor y = ops::conv(x, w, b, same);
  figures.forward = timed([&] { y = ops::conv(x, w, b, same); });
  const double gy_start = now_seconds();
  const ShardTensor gy = rank_input(mesh, y.spec(), 14, device, dtype);
  figures.inputs += now_seconds() - gy_start;
  x.set_requires_grad();
  w.set_requires_grad();
  b.set_requires_grad();
  figures.forward_backward = timed([&] {
    trace::Span span("step", "conv forward+backward");
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
  // The output for the check: gathered on the device, moved to the host once, in the bench dtype
  // (the check converts element by element).
  Tensor gathered = y.gather(0);
  if (gathered.device().is_cuda()) synchronize(compute_stream_for(gathered.device()));
  figures.y = gathered.numel() > 0 ? gathered.to(Device::cpu()) : gathered;
  return figures;
}

double conv_flops(const Shape& x_shape, int64_t kernel) {
  double flops = 2.0 * x_shape[0] * x_shape[1] * x_shape[1];  // N * Cout * Cin, 2 per MAC
  for (size_t d = 2; d < x_shape.size(); ++d) flops *= static_cast<double>(x_shape[d]) * kernel;
  return flops;
}

/// Bytes of x, w and y one forward pass reads and writes, and one forward+backward pass.
std::pair<double, double> conv_bytes(const Shape& x_shape, int64_t kernel, DType dtype) {
  const double element = static_cast<double>(dtype_size(dtype));
  const double x = static_cast<double>(shape_numel(x_shape)) * element;
  const double w = static_cast<double>(x_shape[1] * x_shape[1]) *
                   std::pow(static_cast<double>(kernel), static_cast<double>(x_shape.size() - 2)) *
                   element;
  const double y = x;  // padding same, Cout = C
  return {x + w + y, 3 * (x + w + y) + y};
}

void run_conv_bench(const ConvBenchOptions& options_given) {
  ConvBenchOptions options = options_given;
  const bool cuda = options.device != "cpu";
  if (options.shapes.empty()) options.shapes = cuda ? kCudaShapes : kCpuShapes;
  if (options.ranks.empty()) options.ranks = cuda ? "1,4" : "1,2";
  parse_rank_counts(options.ranks, "--ranks");  // a bad list fails before any measurement
  const DType dtype = dtype_from_name(options.dtype);
  check_arg(dtype == DType::f32 || (cuda && (dtype == DType::bf16 || dtype == DType::f16)), "bench",
            "--dtype {} on {} (cpu: f32; cuda: f32, bf16, f16)", options.dtype, options.device);
  const Backend backend = backend_from_env();
  // Under mpiexec every process runs this function; only the reporter prints.
  const bool reporter = bench::is_reporter(backend);
  bench::BenchReport report("conv", options.json, reporter);
  report.set("device", options.device);
  report.set("dtype", options.dtype);
  report.set("comm", !options.no_comm);
  report.set("backend", backend_name(backend));
  bench::BenchTable& table = report.table(
      "rows",
      fmt::format("tessera bench conv: {} on {}, padding same, Cout = C, sharded along the first "
                  "spatial dim{}",
                  options.dtype, options.device,
                  options.no_comm ? ", local kernels only (--no-comm)" : ""),
      {{"shape", "shape", "N,C,spatial", 22},
       {"ranks", "ranks", "", 5},
       {"threads_per_rank", "threads", "", 7},
       {"forward_ms", "forward", "ms", 12, 2},
       {"forward_gflops", "forward", "GFLOP/s", 9, 1},
       {"forward_gbps", "forward", "GB/s", 7, 1},
       {"forward_backward_ms", "fwd+bwd", "ms", 12, 2},
       {"forward_backward_gflops", "fwd+bwd", "GFLOP/s", 9, 1},
       {"forward_backward_gbps", "fwd+bwd", "GB/s", 7, 1},
       {"halo_ms", "halo", "ms", 10, 3},
       {"wrong", "#wrong", "", 7},
       {"max_error", "max err", "", 9, 5}});
  for (const std::string& shape_text : options.shapes) {
    const Shape x_shape = parse_list(shape_text);
    check_arg(x_shape.size() >= 3 && x_shape.size() <= 5, "bench", "shape {} is not N,C,spatial..",
              x_shape);
    const int64_t kernel = kernel_for(options, x_shape);
    const double flops = conv_flops(x_shape, kernel);
    const auto [forward_bytes, forward_backward_bytes] = conv_bytes(x_shape, kernel, dtype);
    Tensor reference;
    for (int64_t ranks : parse_rank_counts(options.ranks, "--ranks")) {
      ConvFigures figures;
      const int threads = options.threads;
      launch(backend, static_cast<int>(ranks), [&](std::shared_ptr<Comm> world) {
        if (threads > 0) choose_compute_threads(threads);
        const Device device = rank_device(options.device, world->rank());
        ConvFigures mine =
            options.no_comm
                ? measure_local(world, x_shape, kernel, options.iterations, device, dtype)
                : measure(world, x_shape, kernel, options.iterations, device, dtype);
        if (world->rank() == 0) figures = std::move(mine);
      });
      // The first configuration (normally 1 rank) is the reference output.
      bench::Mismatch mismatch;
      // Beyond f32's 1e-4 (different algorithms per piece), bf16/f16 outputs differ by their
      // rounding of differently ordered sums, and by more where an algorithm rounds partial
      // results (Winograd transforms): 1e-2 of the magnitude, 4 units of bf16 roundoff for bf16.
      const double tolerance = dtype == DType::f32    ? 1e-4
                               : dtype == DType::bf16 ? std::ldexp(1.0, -6)
                                                      : 1e-2;
      if (options.no_comm || figures.y.numel() == 0) {
        // no output to check
      } else if (reference.numel() == 0) {
        reference = std::move(figures.y);
      } else {
        mismatch = bench::count_wrong(reference, figures.y, tolerance);
      }
      // The row so far on stderr as soon as it is known: stdout holds one JSON document, and a
      // run cut short by a time limit still shows what it finished.
      if (reporter && options.json)
        fmt::print(stderr,
                   "bench conv: shape {} on {} ranks: forward {:.3f} ms, fwd+bwd {:.3f} ms, "
                   "inputs {:.0f} ms, #wrong {}\n",
                   fmt::join(x_shape, ","), ranks, figures.forward * 1e3,
                   figures.forward_backward * 1e3, figures.inputs * 1e3, mismatch.wrong);
      const int used_threads =
          threads > 0 ? threads
                      : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) /
                                        static_cast<int>(ranks));
      const double backward_flops = 3 * flops;  // forward + backward data + backward weight
      table.add({{"shape", x_shape},
                 {"kernel", kernel},
                 {"device", options.device},
                 {"dtype", options.dtype},
                 {"comm", !options.no_comm},
                 {"ranks", ranks},
                 {"threads_per_rank", used_threads},
                 {"backend", backend_name(backend)},
                 {"forward_ms", figures.forward * 1e3},
                 {"forward_gflops", flops / figures.forward / 1e9},
                 {"forward_gbps", forward_bytes / figures.forward / 1e9},
                 {"forward_backward_ms", figures.forward_backward * 1e3},
                 {"step_seconds", figures.forward_backward},
                 {"forward_backward_gflops", backward_flops / figures.forward_backward / 1e9},
                 {"forward_backward_gbps", forward_backward_bytes / figures.forward_backward / 1e9},
                 {"halo_ms", figures.halo * 1e3},
                 {"halo_overlapped", 0.0},
                 {"inputs_seconds", figures.inputs},
                 {"wrong", mismatch.wrong},
                 {"max_error", mismatch.max_error}});
    }
  }
  // What cuDNN was measured to run for each conv of the benchmark (one line per shape, direction,
  // dtype and layout), so that a figure can be read beside the algorithm behind it.
  if (cuda) report.set("cudnn_algorithms", ops::conv_cudnn_algorithm_choices());
  report.finish();
}

}  // namespace

void register_conv_bench(CLI::App& bench) {
  auto options = std::make_shared<ConvBenchOptions>();
  auto* conv =
      bench.add_subcommand("conv", "Sharded conv forward and forward+backward vs one rank");
  conv->add_option("--shape", options->shapes,
                   "Input shapes N,C,spatial.. (repeatable; default: 1,16,512,512 and "
                   "1,16,128,128,128 on cpu, the GPU issue's five shapes on cuda)");
  conv->add_option("--kernel", options->kernel,
                   "Kernel extent per spatial dim, at least 1 (default: 5 for conv1d, 3 otherwise)")
      ->check(integer_at_least(1));
  conv->add_option("--ranks", options->ranks,
                   "Rank counts to run, e.g. 1,2,4 (default: 1,2 on "
                   "cpu, 1,4 on cuda)");
  add_trace_option(*conv);
  conv->add_option("--device", options->device,
                   "cpu, cuda (ranks round-robin over the GPUs) or "
                   "cuda:N")
      ->capture_default_str();
  conv->add_option("--dtype", options->dtype, "f32 (cpu, cuda: no TF32), bf16 or f16 (cuda)")
      ->capture_default_str();
  conv->add_flag("--no-comm", options->no_comm,
                 "Time each rank's local conv on its haloed piece alone (no halo exchange)");
  conv->add_option("--threads", options->threads, "Compute threads per rank (0: cores / ranks)")
      ->check(CLI::Range(0, 4096));
  conv->add_option("--iterations", options->iterations, "Timed iterations (at least 1)")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  conv->add_flag("--json", options->json, "Print JSON instead of the table");
  conv->callback([options] { run_conv_bench(*options); });
}

}  // namespace tessera::cli
