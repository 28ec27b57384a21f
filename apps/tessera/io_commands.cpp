// `tessera inspect` (what an HDF5 file holds) and `tessera scatter` (a dataset onto a mesh, each
// rank's box and checksum, optionally verified bit for bit against the file).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/tessera.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"

namespace tessera::cli {

namespace {

struct ScatterOptions {
  std::string target;  // FILE.h5:/dataset
  std::string mesh = "1", shard_dims, extents, mode = "root";
  int ranks = 0;
  bool verify = false;
};

/// FNV-1a over the bytes of a contiguous tensor.
uint64_t checksum(const Tensor& tensor) {
  const Tensor bytes = tensor.contiguous();
  const auto* data = static_cast<const unsigned char*>(bytes.raw_data());
  uint64_t hash = 1469598103934665603ull;
  for (size_t i = 0; i < bytes.nbytes(); ++i) hash = (hash ^ data[i]) * 1099511628211ull;
  return hash;
}

void run_scatter(std::shared_ptr<Comm> world, const ScatterOptions& options) {
  const size_t colon = options.target.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == options.target.size())
    throw AgreedError("scatter",
                      fmt::format("expected FILE.h5:/dataset, got '{}'", options.target));
  const std::string file = options.target.substr(0, colon),
                    dataset = options.target.substr(colon + 1);
  if (options.mode != "root" && options.mode != "sharded")
    throw AgreedError("scatter", fmt::format("--mode {} (expected root or sharded)", options.mode));
  DeviceMesh mesh(world, parse_mesh(options.mesh));
  std::vector<Placement> placements(mesh.ndim(), Placement::replicate());
  std::vector<std::vector<int64_t>> extents;
  if (!options.shard_dims.empty()) {
    const std::vector<int64_t> dims = parse_list(options.shard_dims);
    if (static_cast<int>(dims.size()) != mesh.ndim())
      throw AgreedError("scatter",
                        fmt::format("--shard-dims {} for a {}-d mesh", dims, mesh.ndim()));
    for (int m = 0; m < mesh.ndim(); ++m)
      placements[m] = Placement::shard(static_cast<int>(dims[m]));
  }
  if (!options.extents.empty()) extents = parse_extents(options.extents);
  world->barrier();
  const double start = now_seconds();
  const ShardTensor tensor = options.mode == "root"
                                 ? io::scatter(file, dataset, mesh, placements, extents)
                                 : io::read_sharded(file, dataset, mesh, placements, extents);
  double seconds = now_seconds() - start;
  world->all_reduce(&seconds, &seconds, 1, DType::f64, ReduceOp::max);
  // Every rank's line, printed in rank order by rank 0.
  const std::string line =
      fmt::format("  rank {:>3} coord {} box {} checksum {:016x}", world->rank(), mesh.coord(),
                  tensor.local_box().str(), checksum(tensor.to_local()));
  int64_t length = static_cast<int64_t>(line.size());
  std::vector<int64_t> lengths(world->size());
  world->all_gather_v(&length, 1, lengths.data(), std::vector<size_t>(world->size(), 1),
                      DType::i64);
  std::vector<size_t> counts(lengths.begin(), lengths.end());
  std::string lines(displacements_of(counts).back() + counts.back(), ' ');
  world->gather_v(line.data(), line.size(), lines.data(), counts, DType::u8, 0);
  bool ok = true;
  if (options.verify) {
    const Tensor gathered = tensor.gather(0);
    int32_t same =
        world->rank() == 0 ? bitwise_equal(gathered, io::read_dataset(file, dataset)) : 1;
    world->broadcast(&same, 1, DType::i32, 0);
    ok = same != 0;
  }
  if (world->rank() != 0) return;
  fmt::print("{} {} {} ({}), mode {}, {:.3f} ms\n", file, dataset, tensor.spec().str(),
             dtype_name(tensor.dtype()), options.mode, seconds * 1e3);
  const std::vector<size_t> displs = displacements_of(counts);
  for (int r = 0; r < world->size(); ++r) fmt::print("{}\n", lines.substr(displs[r], counts[r]));
  if (options.verify) fmt::print("verified against the file bit for bit: {}\n", ok ? "yes" : "NO");
  if (!ok) throw Error("scatter", "the gathered tensor differs from the file");
}

}  // namespace

void register_io_commands(CLI::App& app) {
  auto file = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  auto* inspect = app.add_subcommand(
      "inspect", "Datasets, shapes, dtypes, chunking and attributes of an HDF5 file");
  inspect->add_option("file", *file, "HDF5 file")->required();
  inspect->add_flag("--json", *as_json, "Print JSON");
  inspect->callback([file, as_json] {
    nlohmann::json datasets = nlohmann::json::array();
    for (const io::DatasetInfo& info : io::list_datasets(*file)) {
      nlohmann::json entry{{"path", info.path},
                           {"shape", info.shape},
                           {"type", info.file_type},
                           {"compression", info.compression},
                           {"attributes", info.attributes}};
      entry["chunks"] = info.chunks ? nlohmann::json(*info.chunks) : nlohmann::json(nullptr);
      datasets.push_back(entry);
    }
    if (*as_json) {
      std::cout << nlohmann::json{{"file", *file}, {"datasets", datasets}}.dump(2) << "\n";
      return;
    }
    fmt::print("{}\n", *file);
    for (const auto& entry : datasets) {
      fmt::print("  {:<24} {:<6} {:<20} chunks {:<16} {}\n", entry["path"].get<std::string>(),
                 entry["type"].get<std::string>(), fmt::format("{}", entry["shape"].get<Shape>()),
                 entry["chunks"].is_null() ? "-" : fmt::format("{}", entry["chunks"].get<Shape>()),
                 entry["compression"].get<std::string>());
      for (const auto& [name, value] : entry["attributes"].items())
        fmt::print("      @{} = {}\n", name, value.get<std::string>());
    }
  });

  auto options = std::make_shared<ScatterOptions>();
  auto* scatter = app.add_subcommand(
      "scatter", "Scatter an HDF5 dataset onto a mesh and print each rank's box");
  scatter->add_option("target", options->target, "FILE.h5:/dataset")->required();
  scatter->add_option("--mesh", options->mesh, "Mesh shape, e.g. 2x2")->capture_default_str();
  scatter->add_option("--shard-dims", options->shard_dims,
                      "Tensor dim sharded by each mesh dim, e.g. 1,2");
  scatter->add_option("--extents", options->extents,
                      "Shard extents per mesh dim, e.g. \"3,5;4,4\"");
  scatter->add_option("--ranks", options->ranks,
                      "Local ranks without mpiexec (default: the mesh size)");
  scatter
      ->add_option("--mode", options->mode,
                   "root (rank 0 reads and sends) or sharded (every rank reads)")
      ->capture_default_str();
  scatter->add_flag("--verify", options->verify,
                    "Gather back and compare with the file bit for bit");
  scatter->callback([options] {
    const int ranks = options->ranks > 0 ? options->ranks : mesh_size(parse_mesh(options->mesh));
    launch(backend_from_env(), ranks,
           [&](std::shared_ptr<Comm> world) { run_scatter(world, *options); });
  });
}

}  // namespace tessera::cli
