// `tessera bench io`: root scatter (io::scatter) and per-rank hyperslab reads (io::read_sharded)
// of one dataset onto 1, 2, 4 local ranks, beside one process reading the whole dataset with a
// plain read (io::read_dataset). The dataset is f32 [rows, 512, 512] (1 MiB per row), written
// once to --file; throughput = dataset bytes / slowest rank's time, of the second of two passes.
#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/tessera.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"

namespace tessera::cli {

namespace {

struct IoBenchOptions {
  size_t bytes = size_t{1} << 30;
  std::string ranks = "1,2,4";
  size_t staging = size_t{256} << 20;
  std::string file = "/tmp/tessera_bench_io.h5";
  bool keep = false;
  bool json = false;
};

void run_io_bench(const IoBenchOptions& options) {
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(options.bytes >> 20));
  const Shape shape{rows, 512, 512};
  const double gib = static_cast<double>(rows) / 1024.0;
  if (!std::filesystem::exists(options.file) ||
      io::dataset_info(options.file, "data").shape != shape) {
    Tensor values = Tensor::empty(shape, DType::f32);
    float* out = values.data<float>();
    for (int64_t i = 0; i < values.numel(); ++i) out[i] = static_cast<float>(i % 1000003);
    io::write_dataset(options.file, "data", values, {.truncate_file = true});
  }
  nlohmann::json rows_json = nlohmann::json::array();
  auto report = [&](const std::string& what, int ranks, double seconds) {
    if (!options.json)
      fmt::print("  {:<34} {:>5} {:>10.1f} {:>10.2f}\n", what, ranks, seconds * 1e3, gib / seconds);
    rows_json.push_back(
        {{"op", what}, {"ranks", ranks}, {"ms", seconds * 1e3}, {"GiBps", gib / seconds}});
  };
  if (!options.json)
    fmt::print(
        "# tessera bench io: {} f32 [{}, 512, 512] ({:.2f} GiB), staging {} MiB\n"
        "# {:<34} {:>5} {:>10} {:>10}\n",
        options.file, rows, gib, options.staging >> 20, "op", "ranks", "ms", "GiB/s");
  // Every measurement runs twice and the second is reported: the first also pays for touching
  // fresh memory (page faults), which on some machines costs more than the read itself.
  for (int pass = 0; pass < 2; ++pass) {
    const double start = now_seconds();
    const Tensor all = io::read_dataset(options.file, "data");
    if (pass == 1) report("plain read (one process)", 1, now_seconds() - start);
  }
  for (int64_t ranks : parse_list(options.ranks)) {
    double root_seconds = 0, sharded_seconds = 0;
    launch(Backend::local, static_cast<int>(ranks), [&](std::shared_ptr<Comm> world) {
      DeviceMesh mesh(world, {world->size()}, {"domain"});
      auto timed = [&](auto&& body) {
        body();  // warm-up pass (see above)
        world->barrier();
        const double start = now_seconds();
        body();
        double seconds = now_seconds() - start;
        world->all_reduce(&seconds, &seconds, 1, DType::f64, ReduceOp::max);
        return seconds;
      };
      const double root = timed([&] {
        io::scatter(options.file, "data", mesh, {Placement::shard(0)}, {}, 0, options.staging);
      });
      const double sharded =
          timed([&] { io::read_sharded(options.file, "data", mesh, {Placement::shard(0)}); });
      if (world->rank() == 0) {
        root_seconds = root;
        sharded_seconds = sharded;
      }
    });
    report("root scatter (io::scatter)", static_cast<int>(ranks), root_seconds);
    report("per-rank read (io::read_sharded)", static_cast<int>(ranks), sharded_seconds);
  }
  if (options.json)
    std::cout << nlohmann::json{{"benchmark", "io"}, {"rows", rows_json}}.dump(2) << "\n";
  if (!options.keep) std::filesystem::remove(options.file);
}

}  // namespace

void register_io_bench(CLI::App& bench) {
  auto options = std::make_shared<IoBenchOptions>();
  auto* io_command =
      bench.add_subcommand("io", "Root scatter and per-rank reads vs one plain read");
  io_command->add_option("--bytes", options->bytes, "Dataset size in bytes")->capture_default_str();
  io_command->add_option("--ranks", options->ranks, "Local rank counts, e.g. 1,2,4")
      ->capture_default_str();
  io_command->add_option("--staging", options->staging, "Root staging budget (bytes)")
      ->capture_default_str();
  io_command->add_option("--file", options->file, "Scratch file")->capture_default_str();
  io_command->add_flag("--keep", options->keep, "Keep the scratch file");
  io_command->add_flag("--json", options->json, "Print JSON instead of the table");
  io_command->callback([options] { run_io_bench(*options); });
}

}  // namespace tessera::cli
