// The Gray-Scott simulation (gray_scott.hpp): initial state, the cpu step kernel, the sharded
// state with its overlapped halo exchange, and the run that writes RUN.h5 snapshot by snapshot.
// Compiled without floating-point contraction (apps/sim/CMakeLists.txt) so that the vectorized
// and the scalar parts of a row round alike.
#include "apps/sim/gray_scott.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include "apps/sim/gray_scott_cell.hpp"
#include "apps/sim/gray_scott_cuda.hpp"
#include "core/compute_threads.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/parallel_for.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/shard_tensor_detail.hpp"
#include "core/trace.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"
#include "io/output_path.hpp"
#include "ops/cpu_loops.hpp"

namespace tessera::sim {

namespace {

constexpr const char* kOp = "simulate";
constexpr const char* kDataset = "snapshots";

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// One row segment of `n` cells along z: u, v, un, vn point at its first cell in haloed arrays
/// with strides sx (x) and sy (y); z neighbours are adjacent. Always inlined into the loop body
/// of step_cells_cpu, so that it is compiled (and vectorised) for each instruction set level
/// (ops/cpu_loops.hpp); the coefficients are copied to locals, which the vectoriser needs to
/// keep them out of the stores' possible targets.
template <class T>
TESSERA_LOOP_BODY inline void step_row(const T* __restrict u, const T* __restrict v,
                                       T* __restrict un, T* __restrict vn, int64_t n, int64_t sx,
                                       int64_t sy, const CellCoefficients<T>& coefficients) {
  const CellCoefficients<T> c = coefficients;
  // Inlined, the pointers lose their __restrict: the outputs never overlap the inputs.
#pragma GCC ivdep
  for (int64_t k = 0; k < n; ++k) gray_scott_cell(u, v, un, vn, k, sx, sy, c);
}

template <class T>
void step_cells_cpu(const Tensor& u, const Tensor& v, const Tensor& u_next, const Tensor& v_next,
                    const Box& cells, const GrayScottParams& params) {
  const CellCoefficients<T> c(params.du, params.dv, params.feed, params.kill, params.dt);
  const int64_t sy = u.shape(2), sx = u.shape(1) * sy;
  const int64_t rows_y = cells.extent(1), n = cells.extent(2);
  const int64_t rows = cells.extent(0) * rows_y;
  if (rows == 0 || n == 0) return;
  const T* pu = u.data<T>();
  const T* pv = v.data<T>();
  T* pun = u_next.data<T>();
  T* pvn = v_next.data<T>();
  // Thin shell slabs run on the calling thread: a parallel region costs more than they do.
  const int threads = cells.volume() >= (int64_t{1} << 16) ? compute_threads() : 1;
  parallel_for(rows, threads, [&](int64_t begin, int64_t end, int) {
    ops::run_with_isa(
        [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
          // Row (i, j) of the box starts at `at`; one division for the range, not one a row.
          int64_t i = lo / rows_y, j = lo % rows_y;
          for (int64_t row = lo; row < hi; ++row) {
            const int64_t at =
                (cells.lo[0] + i + 1) * sx + (cells.lo[1] + j + 1) * sy + cells.lo[2] + 1;
            step_row(pu + at, pv + at, pun + at, pvn + at, n, sx, sy, c);
            if (++j == rows_y) j = 0, ++i;
          }
        },
        begin, end);
  });
}

/// The cells of an owned piece of `shape` that need no halo from another rank: one cell in from
/// both faces along the dims that ranks split, every cell along the others (their periodic halo
/// is a copy halo_begin has made).
Box inner_cells(const Shape& shape, const std::array<bool, 3>& split) {
  Box box;
  for (size_t d = 0; d < shape.size(); ++d) {
    box.lo.push_back(split[d] ? 1 : 0);
    box.hi.push_back(split[d] ? std::max<int64_t>(1, shape[d] - 1) : shape[d]);
  }
  return box;
}

/// The rest of the owned piece: disjoint slabs, for each split dim in turn its two faces, within
/// the inner range of the split dims before it and the whole range of every other dim. Rows
/// along z stay whole unless ranks split z.
std::vector<Box> shell_cells(const Shape& shape, const std::array<bool, 3>& split) {
  std::vector<Box> shell;
  const Box inner = inner_cells(shape, split);
  for (size_t d = 0; d < shape.size(); ++d) {
    if (!split[d]) continue;
    Box low = Box::of_shape(shape), high = Box::of_shape(shape);
    for (size_t e = 0; e < d; ++e) {
      low.lo[e] = high.lo[e] = inner.lo[e];
      low.hi[e] = high.hi[e] = inner.hi[e];
    }
    low.hi[d] = std::min<int64_t>(1, shape[d]);
    high.lo[d] = std::max<int64_t>(1, shape[d] - 1);
    for (const Box& box : {low, high})
      if (!box.empty()) shell.push_back(box);
  }
  return shell;
}

std::string format_double(double value) {
  return fmt::format("{}", value);
}

}  // namespace

void check_config(const GrayScottConfig& config) {
  check_arg(config.size.size() == 3, kOp, "--size {} has {} dims; the grid has 3 (X,Y,Z)",
            config.size, config.size.size());
  for (size_t d = 0; d < 3; ++d)
    check_arg(config.size[d] >= 3, kOp, "--size {}: every extent must be at least 3, dim {} is {}",
              config.size, d, config.size[d]);
  check_arg(config.steps >= 0, kOp, "--steps {} is negative", config.steps);
  check_arg(config.every >= 1, kOp, "--every {}: expected at least 1", config.every);
  check_arg(config.dtype == DType::f32 || config.dtype == DType::f64, kOp,
            "--dtype {}: the simulation runs in f32 or f64", dtype_name(config.dtype));
  const GrayScottParams& p = config.params;
  for (auto [name, value] : {std::pair{"--du", p.du},
                             {"--dv", p.dv},
                             {"--feed", p.feed},
                             {"--kill", p.kill},
                             {"--dt", p.dt}})
    check_arg(std::isfinite(value), kOp, "{} {} is not a finite number", name, value);
}

InitialCubes initial_cubes(const Shape& size, uint64_t seed) {
  InitialCubes cubes;
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto draw = [&state](int64_t range) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<int64_t>(state % static_cast<uint64_t>(range));
  };
  for (int cube = 0; cube < 6; ++cube) {
    const int64_t cx = draw(size[0]), cy = draw(size[1]), cz = draw(size[2]);
    cubes.centres.push_back({cx, cy, cz});
  }
  cubes.half = std::max<int64_t>(1, std::min({size[0], size[1], size[2]}) / 10);
  return cubes;
}

Tensor initial_field(const GrayScottConfig& config, int species, const Box& box) {
  // Estimate mode: the field's shape, no values (core/estimate/estimate_mode.hpp).
  if (estimate::active()) return Tensor::empty(box.shape(), config.dtype);
  const InitialCubes cubes = initial_cubes(config.size, config.seed);
  const size_t count = cubes.centres.size();
  // near[d][c][i]: index box.lo[d] + i of dim d lies within half of cube c's centre.
  std::array<std::vector<std::vector<char>>, 3> near;
  for (int d = 0; d < 3; ++d) {
    const int64_t extent = config.size[d];
    near[d].assign(count, std::vector<char>(static_cast<size_t>(box.extent(d)), 0));
    for (size_t c = 0; c < count; ++c)
      for (int64_t i = 0; i < box.extent(d); ++i) {
        const int64_t distance = ((box.lo[d] + i - cubes.centres[c][d]) % extent + extent) % extent;
        near[d][c][i] = std::min(distance, extent - distance) <= cubes.half;
      }
  }
  const double outside = species == 0 ? 1.0 : 0.0, inside = species == 0 ? 0.5 : 0.25;
  std::vector<double> values(static_cast<size_t>(box.volume()), outside);
  const int64_t ny = box.extent(1), nz = box.extent(2);
  for (int64_t x = 0; x < box.extent(0); ++x)
    for (int64_t y = 0; y < ny; ++y)
      for (size_t c = 0; c < count; ++c) {
        if (!near[0][c][x] || !near[1][c][y]) continue;
        double* row = values.data() + (x * ny + y) * nz;
        for (int64_t z = 0; z < nz; ++z)
          if (near[2][c][z]) row[z] = inside;
      }
  return Tensor::from_values<double>(box.shape(), values).to_dtype(config.dtype);
}

void step_cells(const Tensor& u, const Tensor& v, const Tensor& u_next, const Tensor& v_next,
                const Box& cells, const GrayScottParams& params) {
  if (cells.empty() || u.is_shape_only()) return;  // estimate mode computes nothing
  for (const Tensor* t : {&v, &u_next, &v_next})
    check_arg(t->shape() == u.shape() && t->dtype() == u.dtype() && t->device() == u.device() &&
                  t->is_contiguous() && u.is_contiguous(),
              kOp, "step on fields {} and {} of different shapes, dtypes or devices", u.str(),
              t->str());
  if (u.device().is_cuda()) {
    step_cells_cuda(u, v, u_next, v_next, cells, params);
    return;
  }
  if (u.dtype() == DType::f32)
    step_cells_cpu<float>(u, v, u_next, v_next, cells, params);
  else
    step_cells_cpu<double>(u, v, u_next, v_next, cells, params);
}

GrayScott::GrayScott(const DeviceMesh& mesh, std::vector<Placement> placements,
                     std::vector<std::vector<int64_t>> extents, GrayScottConfig config)
    : mesh_(mesh), config_(std::move(config)) {
  spec_ = tessera::detail::make_agreed_spec(mesh_, kOp, config_.size, std::move(placements),
                                            std::move(extents), config_.dtype);
  for (const Placement& placement : spec_.placements)
    if (placement.is_partial())
      throw AgreedError(kOp, "a Partial placement cannot hold the simulation's state");
  plan_ = cached_halo_plan(spec_, {1, 1, 1}, {1, 1, 1}, std::vector(3, BoundaryMode::periodic),
                           mesh_.rank());
  for (int m = 0; m < mesh_.ndim(); ++m)
    if (spec_.placements[m].is_shard() && mesh_.size(m) > 1)
      split_[static_cast<size_t>(spec_.placements[m].dim)] = true;
  const Device device = current_rank_context().device();
  const Box box = spec_.local_box_of_rank(mesh_.rank());
  for (int s = 0; s < 2; ++s) {
    fields_[s] = Tensor::empty(plan_->haloed_shape(), config_.dtype, device);
    next_[s] = Tensor::empty(plan_->haloed_shape(), config_.dtype, device);
    fields_[s].view_box(plan_->interior_box()).copy_from(initial_field(config_, s, box).to(device));
  }
}

namespace {

/// Records the cost of updating `cells` cells on an op event: 29 flops per cell (two 7-point
/// Laplacians and the reaction terms of gray_scott_cell) and 4 values moved (u, v read, written).
void note_cells(trace::Span& span, double cells, DType dtype) {
  if (!span.recording()) return;
  span.real_arg("flops", 29 * cells);
  span.real_arg("bytes", 4 * cells * static_cast<double>(dtype_size(dtype)));
}

}  // namespace

void GrayScott::step() {
  trace::Span step_span("step", "gray-scott step");
  const Shape owned = plan_->interior_box().shape();
  std::array<std::optional<HaloExchange>, 2> exchanges;
  for (int s = 0; s < 2; ++s)
    exchanges[s] = halo_begin_in_place(*plan_, fields_[s], mesh_.comm(), /*tag=*/s);
  {
    trace::Span span("op", "gray_scott interior");
    const Box inner = inner_cells(owned, split_);
    note_cells(span, static_cast<double>(inner.volume()), config_.dtype);
    step_cells(fields_[0], fields_[1], next_[0], next_[1], inner, config_.params);
  }
  for (int s = 0; s < 2; ++s) halo_end(*exchanges[s]);
  {
    trace::Span span("op", "gray_scott boundary");
    const std::vector<Box> shell = shell_cells(owned, split_);
    double cells = 0;
    for (const Box& box : shell) cells += static_cast<double>(box.volume());
    note_cells(span, cells, config_.dtype);
    for (const Box& cells_box : shell)
      step_cells(fields_[0], fields_[1], next_[0], next_[1], cells_box, config_.params);
  }
  std::swap(fields_, next_);
  ++steps_done_;
}

ShardTensor GrayScott::field(int species) const {
  return ShardTensor(fields_.at(species).view_box(plan_->interior_box()).contiguous(), mesh_,
                     spec_);
}

void GrayScott::set_state(const Tensor& u, const Tensor& v, int64_t steps_done) {
  const Device device = fields_[0].device();
  fields_[0].view_box(plan_->interior_box()).copy_from(u.to(device));
  fields_[1].view_box(plan_->interior_box()).copy_from(v.to(device));
  steps_done_ = steps_done;
}

std::map<std::string, std::string> snapshot_attributes(const GrayScottConfig& config) {
  return {{"model", "gray-scott 3-d, periodic, explicit Euler, 7-point Laplacian"},
          {"layout", "[snapshot, species (u, v), x, y, z]"},
          {"size", fmt::format("{},{},{}", config.size[0], config.size[1], config.size[2])},
          {"dtype", std::string(dtype_name(config.dtype))},
          {"Du", format_double(config.params.du)},
          {"Dv", format_double(config.params.dv)},
          {"F", format_double(config.params.feed)},
          {"k", format_double(config.params.kill)},
          {"dt", format_double(config.params.dt)},
          {"seed", fmt::format("{}", config.seed)},
          {"steps", fmt::format("{}", config.steps)},
          {"every", fmt::format("{}", config.every)},
          {"steps_between_snapshots", fmt::format("{}", config.every)},
          {"generator", "tessera simulate gray-scott"}};
}

namespace {

/// Rank 0's check of a file to restart from: its /snapshots matches `config`; returns the
/// snapshots written.
int64_t check_restart_file(const std::string& file, const GrayScottConfig& config) {
  check_arg(std::filesystem::exists(file), kOp, "--restart: {} does not exist", file);
  check_arg(io::has_dataset(file, kDataset), kOp, "--restart: {} has no dataset /{}", file,
            kDataset);
  const io::DatasetInfo info = io::dataset_info(file, kDataset);
  for (const auto& [name, value] : snapshot_attributes(config)) {
    if (name == "generator") continue;
    const auto found = info.attributes.find(name);
    check_arg(found != info.attributes.end(), kOp,
              "--restart: /{} of {} has no attribute '{}' (not a simulate run?)", kDataset, file,
              name);
    std::string stored = found->second;
    check_arg(stored == value, kOp,
              "--restart: {} was run with {} = {}, the options say {} (give the same options)",
              file, name, stored, value);
  }
  const Shape expected{config.snapshots(), 2, config.size[0], config.size[1], config.size[2]};
  check_arg(info.shape == expected && info.dtype == config.dtype, kOp,
            "--restart: /{} of {} is {} {}, expected {} {}", kDataset, file, info.shape,
            info.file_type, expected, dtype_name(config.dtype));
  const auto written = info.attributes.find("written");
  int64_t count = -1;
  if (written != info.attributes.end()) {
    try {
      count = std::stoll(written->second);
    } catch (const std::exception&) {
    }
  }
  check_arg(count >= 1 && count <= config.snapshots(), kOp,
            "--restart: {} holds no complete snapshot to continue from (written = {})", file,
            written == info.attributes.end() ? "missing" : written->second);
  return count;
}

/// Rank 0 creates the run's file afresh with an empty /snapshots.
void create_run_file(const std::string& file, const GrayScottConfig& config, int gzip_level) {
  io::check_output_path(kOp, file);
  const Shape shape{config.snapshots(), 2, config.size[0], config.size[1], config.size[2]};
  io::WriteOptions storage;
  storage.truncate_file = true;
  storage.chunks =
      Shape{1, 1, std::min<int64_t>(config.size[0], 64), std::min<int64_t>(config.size[1], 64),
            std::min<int64_t>(config.size[2], 64)};
  storage.gzip_level = gzip_level;
  io::create_dataset(file, kDataset, shape, config.dtype, storage);
  auto attributes = snapshot_attributes(config);
  attributes.insert_or_assign("written", std::string("0"));
  io::write_attributes(file, kDataset, attributes);
}

/// Collective: rank 0 runs `work`; its error becomes the same AgreedError on every rank.
void on_root(Comm& comm, const std::function<void()>& work) {
  std::optional<std::string> problem;
  if (comm.rank() == 0) {
    try {
      work();
    } catch (const Error& error) {
      const std::string text = error.what();
      const size_t end = text.find("] ");
      problem = end == std::string::npos ? text : text.substr(end + 2);
    } catch (const std::exception& error) {
      problem = error.what();
    }
  }
  agree_on_error(comm, kOp, problem);
}

}  // namespace

SimulateReport simulate(const DeviceMesh& mesh, std::vector<Placement> placements,
                        std::vector<std::vector<int64_t>> extents, const GrayScottConfig& config,
                        const SimulateOptions& options) {
  Comm& comm = mesh.comm();
  const double start = seconds_now();
  try {
    check_config(config);
  } catch (const Error& error) {  // the same options on every rank: the same error
    const std::string text = error.what();
    throw AgreedError(kOp, text.substr(text.find("] ") + 2));
  }
  GrayScott sim(mesh, std::move(placements), std::move(extents), config);
  SimulateReport report;
  const int64_t element = static_cast<int64_t>(dtype_size(config.dtype));
  const int64_t snapshot_bytes = 2 * shape_numel(config.size) * element;

  auto write_snapshot = [&](int64_t index) {
    const double begin = seconds_now();
    for (int s = 0; s < 2; ++s)
      io::write_sharded_at(sim.field(s), options.out, kDataset, {index, s});
    comm.barrier();  // every box is in the file before `written` says so
    on_root(comm, [&] {
      if (estimate::active()) return;  // estimate mode opens no file
      io::write_attributes(options.out, kDataset, {{"written", fmt::format("{}", index + 1)}});
    });
    report.write_seconds += seconds_now() - begin;
    report.bytes_written += snapshot_bytes;
    ++report.snapshots_written;
    if (options.snapshot_written && comm.rank() == 0) options.snapshot_written(index);
  };

  if (options.restart) {
    int64_t written = 0;
    on_root(comm, [&] { written = check_restart_file(options.out, config); });
    comm.broadcast(&written, 1, DType::i64, 0);
    const Box box = sim.spec().local_box_of_rank(mesh.rank());
    std::array<Tensor, 2> state;
    std::optional<std::string> problem;
    try {
      for (int s = 0; s < 2; ++s) {
        Box slab{{written - 1, s}, {written, s + 1}};
        slab.lo.insert(slab.lo.end(), box.lo.begin(), box.lo.end());
        slab.hi.insert(slab.hi.end(), box.hi.begin(), box.hi.end());
        state[s] =
            io::read_hyperslab(options.out, kDataset, slab, config.dtype).reshape(box.shape());
      }
    } catch (const std::exception& error) {
      problem = fmt::format("rank {}: {}", mesh.rank(), error.what());
    }
    agree_on_error(comm, kOp, problem);
    sim.set_state(state[0], state[1], (written - 1) * config.every);
  } else {
    on_root(comm, [&] {
      if (!estimate::active()) create_run_file(options.out, config, options.gzip_level);
    });
    write_snapshot(0);
  }
  report.first_step = sim.steps_done();

  const int64_t last = config.steps_run();
  std::vector<double> seconds;
  while (sim.steps_done() < last) {
    const double begin = seconds_now();
    sim.step();
    synchronize(current_rank_context().compute());
    seconds.push_back(seconds_now() - begin);
    if (sim.steps_done() % config.every == 0) write_snapshot(sim.steps_done() / config.every);
    if (options.progress && comm.rank() == 0) options.progress(sim.steps_done(), last);
  }
  report.steps_run = static_cast<int64_t>(seconds.size());
  // Per step, the slowest rank's time.
  if (!seconds.empty())
    comm.all_reduce(seconds.data(), seconds.data(), seconds.size(), DType::f64, ReduceOp::max);
  report.step_seconds = std::move(seconds);
  report.total_seconds = seconds_now() - start;
  return report;
}

double copy_bandwidth(size_t bytes) {
  std::vector<char> source(bytes, 1), target(bytes, 0);
  double best = 1e30;
  for (int trial = 0; trial < 3; ++trial) {
    const double begin = seconds_now();
    std::memcpy(target.data(), source.data(), bytes);
    best = std::min(best, seconds_now() - begin);
    source[trial] = target[bytes - 1 - trial];  // keeps the copies observable
  }
  return 2.0 * static_cast<double>(bytes) / best;
}

}  // namespace tessera::sim
