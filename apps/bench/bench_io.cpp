// `tessera bench io`: reading one dataset onto a domain mesh and writing it back, beside one
// process reading the whole dataset with a plain read (io::read_dataset):
//   root scatter      io::scatter: rank 0 reads every box and sends it, staging-bounded
//   per-rank read     io::read_sharded: every rank reads its box (collective MPI-IO with a
//                     parallel HDF5 under mpiexec, independent reads otherwise)
//   root write        io::gather_write: rank 0 receives every box and writes it
//   per-rank write    io::write_sharded: every rank writes its box (collective MPI-IO, or turns)
// The dataset is f32 [rows, 512, 512] (1 MiB per row), written once to --file, sharded along
// rows. Throughput = dataset bytes / slowest rank's time, of the second of two passes (the first
// also pays for touching fresh memory). Memory: the growth of each process's peak resident set
// during the first pass (VmHWM after resetting it through /proc/self/clear_refs, with Tessera's
// host cache emptied first), so under mpiexec it is per rank; with local ranks (threads of one
// process) it is the whole process. Under mpiexec the world is the launcher's and --ranks is
// ignored.
// A second table reads one shuffled epoch of the rows as training samples through
// io::BatchReader (which opens the file once) beside plain H5Dread calls of the same samples in
// the same order (h5_baseline.hpp), with the file opens each made.
#include <fmt/format.h>
#include <malloc.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "apps/bench/bench_harness.hpp"
#include "apps/bench/h5_baseline.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/host_allocator.hpp"
#include "core/tessera.hpp"
#include "io/hdf5/batch_reader.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"

namespace tessera::cli {

namespace {

struct IoBenchOptions {
  size_t bytes = size_t{1} << 30;
  std::string ranks = "1,2,4";
  size_t staging = size_t{256} << 20;
  std::string file = "/tmp/tessera_bench_io.h5";
  int shard_dim = 0;
  bool keep = false;
  bool json = false;
};

/// A field of /proc/self/status in bytes (VmRSS, VmHWM), 0 when unreadable.
size_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) << 10;
  return 0;
}

/// Measures how far the resident set of this process grows above its current size.
class PeakMemory {
 public:
  PeakMemory() {
    host_cache_clear();
    malloc_trim(0);
    std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS
    base_ = status_bytes("VmRSS");
  }
  /// Bytes of growth of the peak resident set since construction.
  size_t growth() const {
    const size_t peak = status_bytes("VmHWM");
    return peak > base_ ? peak - base_ : 0;
  }

 private:
  size_t base_ = 0;
};

/// One benchmark row as measured on every rank.
struct Measured {
  double seconds = 0;     // slowest rank, second pass
  double root_mib = 0;    // peak growth of rank 0's process
  double others_mib = 0;  // largest peak growth of another rank's process (0 with one rank)
};

/// The report of one run: the table, printed by the reporter as rows come, and the JSON document.
class IoBench {
 public:
  IoBench(const IoBenchOptions& options, int64_t rows, Backend backend)
      : options_(options), rows_(rows), report_("io", options.json, bench::is_reporter(backend)) {
    report_.set("backend", backend_name(backend));
    report_.set("staging_MiB", options.staging >> 20);
  }

  /// Starts the table (prints its header).
  void header() {
    table_ = &report_.table(
        "rows",
        fmt::format("tessera bench io: {} f32 [{}, 512, 512] ({:.2f} GiB), staging {} MiB, {} "
                    "backend",
                    options_.file, rows_, gib(), options_.staging >> 20,
                    report_.document()["backend"].get<std::string>()),
        {{"op", "op", "", 36},
         {"ranks", "ranks", "", 5},
         {"ms", "time", "ms", 9, 1},
         {"GiBps", "rate", "GiB/s", 8, 2},
         {"root_peak_MiB", "root", "MiB", 10, 0},
         {"other_peak_MiB", "other", "MiB", 11, 0},
         {"root_budget_MiB", "root budget", "MiB", 12, -1, [](const nlohmann::json& row) {
            if (!row.contains("root_budget_MiB")) return std::string("-");
            return fmt::format("{:.0f} {}", row["root_budget_MiB"].get<double>(),
                               row["root_within_budget"].get<bool>() ? "ok" : "OVER");
          }}});
  }

  /// Adds one row; `root_budget_mib` (<= 0: none) is what rank 0 may hold by design.
  void report(const std::string& what, int ranks, const Measured& measured,
              double root_budget_mib) {
    nlohmann::json row{{"op", what},
                       {"ranks", ranks},
                       {"ms", measured.seconds * 1e3},
                       {"GiBps", gib() / measured.seconds},
                       {"root_peak_MiB", measured.root_mib},
                       {"other_peak_MiB", measured.others_mib}};
    if (root_budget_mib > 0) {
      row["root_budget_MiB"] = root_budget_mib;
      row["root_within_budget"] = measured.root_mib <= root_budget_mib;
    }
    table_->add(std::move(row));
  }

  /// The report, for further tables.
  bench::BenchReport& report() { return report_; }

  /// Prints the JSON document (reporter with --json).
  void finish() const { report_.finish(); }

  double gib() const { return static_cast<double>(rows_) / 1024.0; }

 private:
  const IoBenchOptions& options_;
  int64_t rows_;
  bench::BenchReport report_;
  bench::BenchTable* table_ = nullptr;
};

/// Collective: runs `body` twice on every rank of `world`; the first pass measures memory, the
/// second time (slowest rank).
template <typename Body>
Measured measure(Comm& world, bool processes_are_ranks, const std::function<void()>& release,
                 Body&& body) {
  Measured measured;
  release();
  world.barrier();
  double grown = 0;
  {
    std::optional<PeakMemory> memory;
    if (processes_are_ranks || world.rank() == 0) memory.emplace();
    world.barrier();
    body();
    world.barrier();
    if (memory) grown = static_cast<double>(memory->growth()) / (1 << 20);
  }
  std::vector<double> all(static_cast<size_t>(world.size()));
  world.all_gather_v(&grown, 1, all.data(), std::vector<size_t>(all.size(), 1), DType::f64);
  measured.root_mib = all[0];
  if (processes_are_ranks)
    for (size_t r = 1; r < all.size(); ++r)
      measured.others_mib = std::max(measured.others_mib, all[r]);
  release();
  measured.seconds = bench::time_collective(world, Device::cpu(), 0, 1, body);
  return measured;
}

/// Collective: every sharded row on one world.
void run_world(const IoBenchOptions& options, IoBench& bench, std::shared_ptr<Comm> world,
               bool processes_are_ranks, int64_t rows) {
  DeviceMesh mesh(world, {world->size()}, {"domain"});
  const std::vector<Placement> layout{Placement::shard(options.shard_dim)};
  const int ranks = world->size();
  // What rank 0's process may hold by design: the staging budget plus its shard (1 MiB per row);
  // with local ranks the process also holds every other rank's shard, so the whole dataset.
  const double shard_mib =
      static_cast<double>(processes_are_ranks ? (rows + ranks - 1) / ranks : rows);
  // Plus a fixed allowance for the libraries' own buffers (HDF5's 1 MiB chunk cache, MPI's
  // eager buffers), which the process's resident set also counts.
  constexpr double kLibraryMib = 8;
  const double root_budget = static_cast<double>(options.staging >> 20) + shard_mib + kLibraryMib;
  std::vector<std::pair<std::string, Measured>> results;
  std::optional<ShardTensor> field;
  // Reads drop the previous result before each pass, so its memory is not reused unseen.
  const auto release = [&] { field.reset(); };
  results.emplace_back(
      "root scatter (io::scatter)", measure(*world, processes_are_ranks, release, [&] {
        field = io::scatter(options.file, "data", mesh, layout, {}, 0, options.staging);
      }));
  const bool collective = io::collective_io_available(mesh);
  results.emplace_back(collective ? "per-rank read (collective MPI-IO)" : "per-rank read",
                       measure(*world, processes_are_ranks, release, [&] {
                         field = io::read_sharded(options.file, "data", mesh, layout);
                       }));
  if (collective)
    results.emplace_back(
        "per-rank read (independent)", measure(*world, processes_are_ranks, release, [&] {
          field = io::read_sharded(options.file, "data", mesh, layout, {}, std::nullopt, false);
        }));
  const std::string out = options.file + ".out.h5";
  results.emplace_back("root write (io::gather_write)",
                       measure(
                           *world, processes_are_ranks, [] {},
                           [&] { io::gather_write(*field, out, "data", 0, options.staging); }));
  results.emplace_back(
      collective ? "per-rank write (collective MPI-IO)" : "per-rank write (turns)",
      measure(
          *world, processes_are_ranks, [] {}, [&] { io::write_sharded(*field, out, "data"); }));
  if (world->rank() == 0) {
    std::filesystem::remove(out);
    for (const auto& [what, measured] : results)
      bench.report(what, ranks, measured, what.rfind("root", 0) == 0 ? root_budget : 0);
  }
  world->barrier();
}

/// Collective over `solo` (one rank): one shuffled epoch of the dataset's samples (rows of 1
/// MiB) through io::BatchReader (batch 4, reading ahead) beside plain H5Dread calls of the same
/// samples in the same order; the second of two passes of each is timed.
void shuffled_samples(const IoBenchOptions& options, bench::BenchReport& report,
                      std::shared_ptr<Comm> solo, int64_t rows) {
  if (!bench::raw_hdf5_available()) return;
  const DeviceMesh mesh(solo, {1}, {"dp"});
  const io::BatchReaderOptions reader_options{
      .batch_size = 4, .seed = 3, .drop_last = false, .read_ahead = 2};
  const std::vector<int64_t> order =
      io::BatchReader(options.file, "data", mesh, reader_options).epoch_order(0);
  auto& table = report.table(
      "shuffled",
      fmt::format("one shuffled epoch of {} samples of 1 MiB ([512, 512] f32), one rank", rows),
      {{"op", "op", "", 44},
       {"samples", "samples", "", 8},
       {"ms", "time", "ms", 9, 1},
       {"GiBps", "rate", "GiB/s", 8, 2},
       {"file_opens", "opens", "", 6}});
  const double gib = static_cast<double>(rows) / 1024.0;
  double plain_seconds = 0, reader_seconds = 0;
  int64_t plain_opens = 0, reader_opens = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t opens = io::file_open_count();
    double start = now_seconds();
    bench::raw_read_samples(options.file, "/data", order);
    plain_seconds = now_seconds() - start;
    plain_opens = 1 + io::file_open_count() - opens;  // its own H5Fopen, not counted by io
    start = now_seconds();
    const int64_t before = io::file_open_count();
    {
      io::BatchReader reader(options.file, "data", mesh, reader_options);
      for (int64_t step = 0; step < reader.steps_per_epoch(); ++step) reader.next();
    }
    reader_seconds = now_seconds() - start;
    reader_opens = io::file_open_count() - before;
  }
  table.add({{"op", "plain H5Dread per sample (file opened once)"},
             {"samples", rows},
             {"ms", plain_seconds * 1e3},
             {"GiBps", gib / plain_seconds},
             {"file_opens", plain_opens}});
  table.add({{"op", "io::BatchReader (batch 4, read-ahead 2)"},
             {"samples", rows},
             {"ms", reader_seconds * 1e3},
             {"GiBps", gib / reader_seconds},
             {"file_opens", reader_opens}});
  report.set("batch_reader_vs_plain_read", plain_seconds / reader_seconds);
}

void run_io_bench(const IoBenchOptions& options) {
  const std::vector<int> rank_counts = parse_rank_counts(options.ranks, "--ranks");  // first
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(options.bytes >> 20));
  const Shape shape{rows, 512, 512};
  const Backend backend = backend_from_env();
  auto prepare = [&] {
    if (!std::filesystem::exists(options.file) ||
        io::dataset_info(options.file, "data").shape != shape) {
      Tensor values = Tensor::empty(shape, DType::f32);
      float* out = values.data<float>();
      for (int64_t i = 0; i < values.numel(); ++i) out[i] = static_cast<float>(i % 1000003);
      io::write_dataset(options.file, "data", values, {.truncate_file = true});
    }
  };
  IoBench bench(options, rows, backend);
  auto plain_read = [&](Comm* world) {
    // One process reads everything; under mpiexec only rank 0, the others wait.
    Measured measured;
    if (world == nullptr || world->rank() == 0) {
      {
        PeakMemory memory;
        const Tensor all = io::read_dataset(options.file, "data");
        measured.root_mib = static_cast<double>(memory.growth()) / (1 << 20);
      }
      measured.seconds = bench::time_rank(
          Device::cpu(), 0, 1, [&] { const Tensor all = io::read_dataset(options.file, "data"); });
      bench.report("plain read (one process)", 1, measured, 0);
    }
    if (world != nullptr) world->barrier();
  };

  if (backend == Backend::mpi) {
    launch(Backend::mpi, 1, [&](std::shared_ptr<Comm> world) {
      if (world->rank() == 0) {
        prepare();
        bench.header();
      }
      world->barrier();
      plain_read(world.get());
      run_world(options, bench, world, /*processes_are_ranks=*/true, rows);
      std::shared_ptr<Comm> solo = world->split(world->rank() == 0 ? 0 : 1, 0);
      if (world->rank() == 0) shuffled_samples(options, bench.report(), solo, rows);
      world->barrier();
      if (world->rank() == 0) {
        bench.finish();
        if (!options.keep) std::filesystem::remove(options.file);
      }
    });
    return;
  }
  prepare();
  bench.header();
  plain_read(nullptr);
  for (int ranks : rank_counts)
    launch(Backend::local, ranks, [&](std::shared_ptr<Comm> world) {
      run_world(options, bench, world, /*processes_are_ranks=*/false, rows);
    });
  launch(Backend::local, 1, [&](std::shared_ptr<Comm> solo) {
    shuffled_samples(options, bench.report(), solo, rows);
  });
  bench.finish();
  if (!options.keep) std::filesystem::remove(options.file);
}

}  // namespace

void register_io_bench(CLI::App& bench) {
  auto options = std::make_shared<IoBenchOptions>();
  auto* io_command = bench.add_subcommand(
      "io", "Root scatter/write and per-rank reads/writes vs one plain read, with peak memory");
  io_command->add_option("--bytes", options->bytes, "Dataset size in bytes")
      ->check(integer_at_least(1))
      ->capture_default_str();
  io_command->add_option("--ranks", options->ranks, "Local rank counts, e.g. 1,2,4 (not mpiexec)")
      ->capture_default_str();
  io_command->add_option("--staging", options->staging, "Root staging budget (bytes)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  io_command->add_option("--file", options->file, "Scratch file")->capture_default_str();
  io_command
      ->add_option("--shard-dim", options->shard_dim,
                   "Dim sharded over the ranks: 0 (contiguous boxes), 1 or 2 (strided)")
      ->check(CLI::Range(0, 2))
      ->capture_default_str();
  io_command->add_flag("--keep", options->keep, "Keep the scratch file");
  io_command->add_flag("--json", options->json, "Print JSON instead of the table");
  io_command->callback([options] { run_io_bench(*options); });
}

}  // namespace tessera::cli
