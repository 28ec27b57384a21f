// `tessera simulate gray-scott`: the domain-decomposed Gray-Scott simulation (apps/sim/) on any
// mesh of the grid's dims, writing RUN.h5:/snapshots as it goes; --restart continues a run,
// --json reports step time, cells/s, bytes written/s and the memory-bandwidth bound. Bad options
// give one line and exit code 2 on every rank.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "apps/plot/plot.hpp"
#include "apps/sim/gray_scott.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "apps/tessera/progress_bar.hpp"
#include "apps/tessera/run_op_common.hpp"
#include "core/estimate/estimate_mode.hpp"

namespace tessera::cli {

namespace {

constexpr const char* kOp = "simulate";

struct SimulateCliOptions {
  std::string size = "64", out, dtype = "f32", device = "cpu", plot;
  int64_t steps = 100, every = 10;
  uint64_t seed = 7;
  sim::GrayScottParams params;
  MeshOptions layout;
  bool restart = false, json = false;
};

/// --size "X,Y,Z", or "N" for a cube.
Shape parse_size(const std::string& text) {
  Shape size = parse_list(text);
  if (size.size() == 1) size = {size[0], size[0], size[0]};
  return size;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 ? values[middle] : 0.5 * (values[middle - 1] + values[middle]);
}

void run_simulate(std::shared_ptr<Comm> world, const SimulateCliOptions& options) {
  const bool root = world->rank() == 0;
  sim::GrayScottConfig config;
  std::vector<int> mesh_shape;
  try {  // every rank parses the same options: the same error everywhere
    mesh_shape = parse_mesh(options.layout.mesh);
    config.size = parse_size(options.size);
    config.steps = options.steps;
    config.every = options.every;
    config.seed = options.seed;
    config.dtype = dtype_from_name(options.dtype);
    config.params = options.params;
    sim::check_config(config);
    if (!options.plot.empty()) plot::check_available();
    check_arg(mesh_size(mesh_shape) == world->size(), kOp,
              "--mesh {} has {} ranks but {} ranks run (give --ranks {} or mpiexec -n {})",
              options.layout.mesh, mesh_size(mesh_shape), world->size(), mesh_size(mesh_shape),
              mesh_size(mesh_shape));
  } catch (const Error& error) {
    throw AgreedError(kOp, untagged(error));
  }
  const DeviceMesh mesh(world, mesh_shape);
  auto [placements, extents] =
      run_op_layout(mesh, options.layout.shard_dims, options.layout.extents, 3, mesh.ndim(), kOp);
  if (root && config.steps_run() < config.steps)
    std::fprintf(stderr,
                 "tessera: note: --steps %lld is not a multiple of --every %lld: the last %lld "
                 "steps would reach no snapshot and are not run\n",
                 static_cast<long long>(config.steps), static_cast<long long>(config.every),
                 static_cast<long long>(config.steps - config.steps_run()));
  sim::SimulateOptions run;
  run.out = options.out;
  if (!options.plot.empty()) {
    // Rank 0 draws the slices of each snapshot once it is in the file (reading it back); a plot
    // that fails is reported and the simulation goes on.
    std::optional<std::string> problem;
    try {
      if (root) plot::prepare_plot_directory(options.plot);
    } catch (const Error& error) {
      problem = untagged(error);
    }
    agree_on_error(*world, kOp, problem);
    run.snapshot_written = [&options](int64_t snapshot) {
      try {
        plot::write_snapshot_plots(options.plot, options.out, "/snapshots", snapshot);
      } catch (const std::exception& error) {
        std::fprintf(stderr, "tessera: warning: snapshot %lld not plotted: %s\n",
                     static_cast<long long>(snapshot), error.what());
      }
    };
  }
  run.restart = options.restart;
  ProgressBar bar;
  if (root && ::isatty(STDERR_FILENO))
    run.progress = [&bar](int64_t done, int64_t total) { bar(done, total); };
  const sim::SimulateReport report =
      sim::simulate(mesh, std::move(placements), std::move(extents), config, run);
  if (!root) return;

  const double cells = static_cast<double>(shape_numel(config.size));
  const double step_seconds = median(report.step_seconds);
  const double cells_per_second = step_seconds > 0 ? cells / step_seconds : 0;
  const double bytes_per_second =
      report.write_seconds > 0 ? static_cast<double>(report.bytes_written) / report.write_seconds
                               : 0;
  const std::string grid = fmt::format("{}x{}x{}", config.size[0], config.size[1], config.size[2]);
  if (options.json) {
    // Each cell of a step reads u, v and writes u, v: 4 values of the dtype from and to memory
    // (neighbours are served by the caches).
    const int bytes_per_cell = 4 * static_cast<int>(dtype_size(config.dtype));
    const double bandwidth = sim::copy_bandwidth();
    nlohmann::json json = {
        {"command", "simulate gray-scott"},
        {"size", config.size},
        {"dtype", options.dtype},
        {"mesh", mesh_shape},
        {"ranks", world->size()},
        {"backend", world->backend()},
        {"device", options.device},
        {"steps", config.steps},
        {"every", config.every},
        {"first_step", report.first_step},
        {"steps_run", report.steps_run},
        {"snapshots_written", report.snapshots_written},
        {"out", options.out},
        {"step_seconds", step_seconds},
        {"cells_per_second", cells_per_second},
        {"bytes_written", report.bytes_written},
        {"bytes_written_per_second", bytes_per_second},
        {"total_seconds", report.total_seconds},
        {"bytes_per_cell_per_step", bytes_per_cell},
        {"copy_bandwidth_bytes_per_second", bandwidth},
        {"bandwidth_bound_cells_per_second", bandwidth / bytes_per_cell},
    };
    fmt::print("{}\n", json.dump());
    return;
  }
  if (estimate::active()) {  // estimate-record: nothing was computed or written
    fmt::print(
        "gray-scott {} {}: steps {}..{} on mesh {} recorded without data ({} snapshot(s) "
        "would be written to {})\n",
        grid, options.dtype, report.first_step, report.first_step + report.steps_run,
        options.layout.mesh, report.snapshots_written, options.out);
    return;
  }
  fmt::print(
      "gray-scott {} {}: steps {}..{} on mesh {} ({} backend), {} snapshot(s) written to {}"
      "; median step {:.3f} ms, {:.3g} cells/s, {:.3g} bytes written/s\n",
      grid, options.dtype, report.first_step, report.first_step + report.steps_run,
      options.layout.mesh, world->backend(), report.snapshots_written, options.out,
      step_seconds * 1e3, cells_per_second, bytes_per_second);
}

}  // namespace

void register_simulate(CLI::App& app) {
  auto* simulate = app.add_subcommand("simulate", "Run a sharded simulation, writing HDF5");
  simulate->require_subcommand(1);
  auto options = std::make_shared<SimulateCliOptions>();
  auto* gray_scott = simulate->add_subcommand(
      "gray-scott", "3-d Gray-Scott reaction-diffusion on a periodic grid (docs/simulation.md)");
  gray_scott->add_option("--size", options->size, "Grid X,Y,Z (or N for N,N,N), each >= 3")
      ->capture_default_str();
  gray_scott->add_option("--steps", options->steps, "Time steps N")
      ->check(integer_at_least(0))
      ->capture_default_str();
  gray_scott->add_option("--every", options->every, "A snapshot after every K steps (T = 1 + N/K)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  gray_scott->add_option("--out", options->out, "The run's HDF5 file (dataset /snapshots)")
      ->required();
  gray_scott->add_option("--seed", options->seed, "Seed of the initial cubes")
      ->check(integer_at_least(0))
      ->capture_default_str();
  gray_scott->add_option("--dtype", options->dtype, "f32 or f64")->capture_default_str();
  gray_scott->add_option("--du", options->params.du, "Diffusion of u")->capture_default_str();
  gray_scott->add_option("--dv", options->params.dv, "Diffusion of v")->capture_default_str();
  gray_scott->add_option("--feed", options->params.feed, "Feed rate F")->capture_default_str();
  gray_scott->add_option("--kill", options->params.kill, "Kill rate k")->capture_default_str();
  gray_scott->add_option("--dt", options->params.dt, "Time step")->capture_default_str();
  add_mesh_options(*gray_scott, options->layout, "0,1 (grid dims: 0 = x, 1 = y, 2 = z)");
  gray_scott
      ->add_option("--device", options->device,
                   "cpu, cuda (local ranks round-robin over the GPUs) or cuda:N")
      ->capture_default_str();
  gray_scott->add_flag("--restart", options->restart,
                       "Continue the run in --out from its last snapshot (same options)");
  gray_scott->add_option("--plot", options->plot,
                         "Write a z = 0.5 slice PNG of u and v per snapshot to this directory");
  gray_scott->add_flag("--json", options->json,
                       "Print one JSON object with the figures at the end");
  add_trace_option(*gray_scott);
  gray_scott->callback([options] {
    select_device(options->device);
    launch(backend_from_env(), options->layout.local_ranks(),
           [&](std::shared_ptr<Comm> world) { run_simulate(world, *options); });
  });
}

}  // namespace tessera::cli
