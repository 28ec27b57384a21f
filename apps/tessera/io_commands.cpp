// `tessera inspect` (what an HDF5 file holds), `tessera scatter` (a dataset onto a mesh, each
// rank's box and checksum, optionally verified bit for bit against the file) and `tessera
// convert` (a dataset re-stored with another element type or storage layout, through a mesh).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/tessera.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"
#include "io/output_path.hpp"

namespace tessera::cli {

namespace {

struct ScatterOptions {
  std::string target;  // FILE.h5:/dataset
  MeshOptions layout;
  std::string mode = "root";
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

/// FILE.h5:/dataset split at the last colon; `default_dataset` (if any) when there is no colon.
std::pair<std::string, std::string> split_target(const std::string& op, const std::string& target,
                                                 const std::string& default_dataset = "") {
  const size_t colon = target.rfind(':');
  if ((colon == std::string::npos && !default_dataset.empty() && !target.empty()))
    return {target, default_dataset};
  if (colon == std::string::npos || colon == 0 || colon + 1 == target.size())
    throw AgreedError(op, fmt::format("expected FILE.h5:/dataset, got '{}'", target));
  return {target.substr(0, colon), target.substr(colon + 1)};
}

/// A dataset named on the command line, FILE.h5:/dataset, optionally with a range of its first
/// dim in Python's slice notation, FILE.h5:/dataset[a:b] (negative ends count from the end;
/// either end may be left out), e.g. run.h5:/snapshots[1:] for every snapshot but the first.
struct DatasetRef {
  std::string file, dataset;
  std::optional<std::pair<int64_t, int64_t>> rows;  // [a, b) as written (not yet resolved)
  bool open_start = true, open_stop = true;
};

DatasetRef parse_dataset_ref(const std::string& op, const std::string& text,
                             const std::string& default_dataset = "") {
  DatasetRef ref;
  std::string path = text;
  if (!path.empty() && path.back() == ']') {
    const size_t open = path.rfind('[');
    const std::string inside =
        open == std::string::npos ? "" : path.substr(open + 1, path.size() - open - 2);
    const size_t colon = inside.find(':');
    if (open == std::string::npos || colon == std::string::npos ||
        inside.find(':', colon + 1) != std::string::npos)
      throw AgreedError(op, fmt::format("expected FILE.h5:/dataset[a:b], got '{}'", text));
    auto bound = [&](const std::string& part, bool& open_end) -> int64_t {
      if (part.empty()) return 0;
      open_end = false;
      size_t used = 0;
      int64_t value = 0;
      try {
        value = std::stoll(part, &used);
      } catch (const std::exception&) {
        used = std::string::npos;
      }
      if (used != part.size())
        throw AgreedError(op, fmt::format("'{}' in '{}' is not an integer", part, text));
      return value;
    };
    ref.rows = std::pair{bound(inside.substr(0, colon), ref.open_start),
                         bound(inside.substr(colon + 1), ref.open_stop)};
    path = path.substr(0, open);
  }
  std::tie(ref.file, ref.dataset) = split_target(op, path, default_dataset);
  return ref;
}

/// The rows [first, last) of dataset `ref` whose first extent is `extent` (Python's clamping).
std::pair<int64_t, int64_t> resolve_rows(const std::string& op, const DatasetRef& ref,
                                         int64_t extent) {
  if (!ref.rows) return {0, extent};
  auto resolve = [&](int64_t value, bool open_end, int64_t fallback) {
    if (open_end) return fallback;
    if (value < 0) value += extent;
    return std::clamp<int64_t>(value, 0, extent);
  };
  const int64_t first = resolve(ref.rows->first, ref.open_start, 0);
  const int64_t last = resolve(ref.rows->second, ref.open_stop, extent);
  if (last <= first)
    throw AgreedError(op,
                      fmt::format("{}:{}[{}:{}] selects no rows of {}", ref.file, ref.dataset,
                                  ref.open_start ? "" : std::to_string(ref.rows->first),
                                  ref.open_stop ? "" : std::to_string(ref.rows->second), extent));
  return {first, last};
}

/// The layout of --mesh/--shard-dims/--extents (Replicate over mesh dims without a shard dim).
struct MeshLayout {
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
};

MeshLayout parse_layout(const std::string& op, const DeviceMesh& mesh,
                        const std::string& shard_dims, const std::string& extents) {
  MeshLayout layout{std::vector<Placement>(mesh.ndim(), Placement::replicate()), {}};
  if (!shard_dims.empty()) {
    const std::vector<int64_t> dims = parse_list(shard_dims);
    if (static_cast<int>(dims.size()) != mesh.ndim())
      throw AgreedError(op, fmt::format("--shard-dims {} for a {}-d mesh", dims, mesh.ndim()));
    for (int m = 0; m < mesh.ndim(); ++m)
      layout.placements[m] = Placement::shard(static_cast<int>(dims[m]));
  }
  if (!extents.empty()) layout.extents = parse_extents(extents);
  return layout;
}

/// Collective: every rank reads its own box of the rows `ref` selects (the whole dataset without
/// a range) in the layout given, with per-rank hyperslab reads.
ShardTensor read_rows_sharded(const std::string& op, const DatasetRef& ref, const DeviceMesh& mesh,
                              const MeshLayout& layout, std::optional<DType> as = std::nullopt) {
  const io::DatasetInfo info = io::dataset_info(ref.file, ref.dataset);
  if (info.shape.empty())
    throw AgreedError(op, fmt::format("{}:{} is a scalar; a row range needs a leading dim",
                                      ref.file, ref.dataset));
  const auto [first, last] = resolve_rows(op, ref, info.shape[0]);
  Shape global = info.shape;
  global[0] = last - first;
  const ShardSpec spec =
      ShardSpec::make(global, mesh.shape(), layout.placements, layout.extents, op);
  const Box box = spec.local_box(mesh.coord());
  Box in_file = box;
  in_file.lo[0] += first;
  in_file.hi[0] += first;
  const DType dtype = as ? *as : info.dtype.value_or(DType::f32);
  const Tensor local = box.empty() ? Tensor::empty(box.shape(), dtype)
                                   : io::read_hyperslab(ref.file, ref.dataset, in_file, as);
  return ShardTensor(local, mesh, spec);
}

void check_mode(const std::string& op, const std::string& mode) {
  if (mode != "root" && mode != "sharded")
    throw AgreedError(op, fmt::format("--mode {} (expected root or sharded)", mode));
}

void run_scatter(std::shared_ptr<Comm> world, const ScatterOptions& options) {
  const auto [file, dataset] = split_target("scatter", options.target);
  check_mode("scatter", options.mode);
  DeviceMesh mesh(world, parse_mesh(options.layout.mesh));
  const auto [placements, extents] =
      parse_layout("scatter", mesh, options.layout.shard_dims, options.layout.extents);
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

struct ConvertOptions {
  std::string source, target;  // FILE.h5:/dataset, OUT.h5[:/dataset]
  std::string dtype;           // "" keeps the file's
  std::string chunks;          // "" contiguous, "auto" or a,b,c
  int gzip = -1;
  bool checksum = false;
  MeshOptions layout;
  std::string mode = "root";
  bool verify = false;
};

/// How many values of the f64 tensor `values` the integer dtype `dtype` holds exactly up to
/// truncation of the fraction (finite and within its range).
int64_t representable_count(const Tensor& values, DType dtype) {
  double low = 0, high = 0;  // representable values lie in [low, high)
  switch (dtype) {
    case DType::i32: low = -0x1p31, high = 0x1p31; break;
    case DType::i64: low = -0x1p63, high = 0x1p63; break;
    case DType::u8: low = 0, high = 256; break;
    default: return values.numel();
  }
  const double* data = values.data<double>();
  int64_t count = 0;
  for (int64_t i = 0; i < values.numel(); ++i)
    count += data[i] >= low && data[i] < high;  // false for NaN and the infinities
  return count;
}

void run_convert(std::shared_ptr<Comm> world, const ConvertOptions& options) {
  const std::string op = "convert";
  const DatasetRef source = parse_dataset_ref(op, options.source);
  const std::string& in_file = source.file;
  const std::string& in_dataset = source.dataset;
  const auto [out_file, out_dataset] = split_target(op, options.target, in_dataset);
  std::error_code error;
  if (std::filesystem::weakly_canonical(in_file, error) ==
          std::filesystem::weakly_canonical(out_file, error) &&
      in_dataset == out_dataset)
    throw AgreedError(op,
                      fmt::format("{}:{} is both the input and the output", in_file, in_dataset));
  check_mode(op, options.mode);
  // Rank 0 checks that the output can be written before anything is read.
  std::optional<std::string> unwritable;
  if (world->rank() == 0) {
    try {
      io::check_output_path(op, out_file);
    } catch (const Error& error) {
      unwritable = std::string(error.what()).substr(op.size() + 3);  // without "[convert] "
    }
  }
  agree_on_error(*world, op, unwritable);
  std::optional<DType> as;
  if (!options.dtype.empty()) as = dtype_from_name(options.dtype);
  io::WriteOptions storage;
  if (!options.chunks.empty() && options.chunks != "auto")
    storage.chunks = parse_list(options.chunks);
  if (options.chunks == "auto" && options.gzip < 0 && !options.checksum)
    throw AgreedError(op, "--chunks auto picks chunks for --gzip or --checksum; give extents");
  storage.gzip_level = options.gzip;
  storage.checksum = options.checksum;
  DeviceMesh mesh(world, parse_mesh(options.layout.mesh));
  const auto [placements, extents] =
      parse_layout(op, mesh, options.layout.shard_dims, options.layout.extents);
  // Floats into an integer dtype: read as f64 and refuse values the integer type cannot hold
  // (NaN, infinities, out of range), which a plain conversion would silently saturate.
  const std::optional<DType> file_dtype = io::dataset_info(in_file, in_dataset).dtype;
  const bool float_to_integer = as && !is_floating(*as) && file_dtype && is_floating(*file_dtype);
  const std::optional<DType> read_as = float_to_integer ? std::optional(DType::f64) : as;
  world->barrier();
  const double start = now_seconds();
  ShardTensor tensor =
      source.rows ? read_rows_sharded(op, source, mesh, {placements, extents}, read_as)
      : options.mode == "root"
          ? io::scatter(in_file, in_dataset, mesh, placements, extents, 0, size_t{256} << 20,
                        read_as)
          : io::read_sharded(in_file, in_dataset, mesh, placements, extents, read_as);
  if (float_to_integer) {
    const Tensor local = tensor.to_local().contiguous();
    int32_t unrepresentable = representable_count(local, *as) != local.numel() ? 1 : 0;
    world->all_reduce(&unrepresentable, &unrepresentable, 1, DType::i32, ReduceOp::max);
    if (unrepresentable)
      throw AgreedError(op, fmt::format("{}:{} holds NaN, infinite or out-of-range values that "
                                        "--dtype {} cannot represent; convert to a float dtype "
                                        "(f32, f64, f16, bf16) instead",
                                        in_file, in_dataset, options.dtype));
    tensor = ShardTensor(local.to_dtype(*as), tensor.mesh(), tensor.spec());
  }
  if (options.mode == "root")
    io::gather_write(tensor, out_file, out_dataset, 0, size_t{256} << 20, storage);
  else
    io::write_sharded(tensor, out_file, out_dataset, true, storage);
  double seconds = now_seconds() - start;
  world->all_reduce(&seconds, &seconds, 1, DType::f64, ReduceOp::max);
  bool same = true;
  if (options.verify) {
    // Every rank compares its box of the output with its box of the input read as the dtype.
    const ShardTensor written =
        io::read_sharded(out_file, out_dataset, mesh, placements, tensor.spec().extents);
    int32_t equal = bitwise_equal(written.to_local(), tensor.to_local()) ? 1 : 0;
    world->all_reduce(&equal, &equal, 1, DType::i32, ReduceOp::min);
    same = equal != 0;
  }
  if (world->rank() == 0) {
    const io::DatasetInfo info = io::dataset_info(out_file, out_dataset);
    fmt::print("{} -> {}:{}: {} ({}), chunks {}, {}, mode {}, {} rank(s), {:.3f} ms\n",
               options.source, out_file, info.path, fmt::join(info.shape, "x"), info.file_type,
               info.chunks ? fmt::format("{}", fmt::join(*info.chunks, "x")) : "-",
               info.compression.empty() ? "uncompressed" : info.compression, options.mode,
               world->size(), seconds * 1e3);
    if (options.verify)
      fmt::print("verified against the input (as {}) bit for bit: {}\n", dtype_name(tensor.dtype()),
                 same ? "yes" : "NO");
  }
  if (!same) throw Error(op, "the written dataset differs from the input");
}

struct CompareOptions {
  std::string reference, test;  // FILE.h5:/dataset[a:b]
  MeshOptions layout;
  bool json = false;
};

/// The differences of two datasets of one shape, every rank reading and comparing its own box.
void run_compare(std::shared_ptr<Comm> world, const CompareOptions& options) {
  const std::string op = "compare";
  const DatasetRef reference = parse_dataset_ref(op, options.reference);
  const DatasetRef test = parse_dataset_ref(op, options.test);
  DeviceMesh mesh(world, parse_mesh(options.layout.mesh));
  const MeshLayout layout =
      parse_layout(op, mesh, options.layout.shard_dims, options.layout.extents);
  const ShardTensor ref = read_rows_sharded(op, reference, mesh, layout, DType::f64);
  // The test dataset must have the reference's (selected) shape: checked before reading it.
  const io::DatasetInfo test_info = io::dataset_info(test.file, test.dataset);
  Shape test_shape = test_info.shape;
  if (!test_shape.empty()) {
    const auto [first, last] = resolve_rows(op, test, test_shape[0]);
    test_shape[0] = last - first;
  }
  if (test_shape != ref.global_shape())
    throw AgreedError(op, fmt::format("{} has shape {} but {} has shape {}", options.test,
                                      test_shape, options.reference, ref.global_shape()));
  const ShardTensor values = read_rows_sharded(op, test, mesh, layout, DType::f64);
  // Sums over this rank's box; replicated copies of a box count once (mesh coordinate 0 of the
  // dims that do not shard).
  bool counts = true;
  for (int m = 0; m < mesh.ndim(); ++m)
    counts = counts && (ref.spec().placements[m].is_shard() || mesh.coord()[m] == 0);
  const Tensor a = ref.to_local().contiguous();
  const Tensor b = values.to_local().contiguous();
  double sums[4] = {0, 0, 0, 0};  // squared difference, squared reference, elements, NaN pairs
  double max_abs = 0;
  if (counts) {
    const double* x = a.data<double>();
    const double* y = b.data<double>();
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double d = y[i] - x[i];
      if (std::isnan(d)) {
        sums[3] += 1;
        continue;
      }
      sums[0] += d * d;
      sums[1] += x[i] * x[i];
      max_abs = std::max(max_abs, std::abs(d));
    }
    sums[2] = static_cast<double>(a.numel());
  }
  world->all_reduce(sums, sums, 4, DType::f64, ReduceOp::sum);
  world->all_reduce(&max_abs, &max_abs, 1, DType::f64, ReduceOp::max);
  if (world->rank() != 0) return;
  const double compared = sums[2] - sums[3];
  const double rms = compared > 0 ? std::sqrt(sums[0] / compared) : 0;
  const double relative = sums[1] > 0 ? std::sqrt(sums[0] / sums[1]) : std::sqrt(sums[0]);
  if (options.json) {
    std::cout << nlohmann::json{{"reference", options.reference},
                                {"test", options.test},
                                {"shape", ref.global_shape()},
                                {"elements", static_cast<int64_t>(sums[2])},
                                {"nan_pairs", static_cast<int64_t>(sums[3])},
                                {"max_abs_error", max_abs},
                                {"rms_error", rms},
                                {"relative_l2_error", relative}}
                     .dump()
              << "\n";
    return;
  }
  fmt::print(
      "{} vs {}: shape {}, max abs error {:.6g}, rms error {:.6g}, relative L2 error "
      "{:.6g}{}\n",
      options.test, options.reference, fmt::join(ref.global_shape(), "x"), max_abs, rms, relative,
      sums[3] > 0 ? fmt::format(" ({} elements NaN, not counted)", sums[3]) : "");
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
  add_mesh_options(*scatter, options->layout, "1,2");
  scatter
      ->add_option("--mode", options->mode,
                   "root (rank 0 reads and sends) or sharded (every rank reads)")
      ->capture_default_str();
  scatter->add_flag("--verify", options->verify,
                    "Gather back and compare with the file bit for bit");
  auto convert_options = std::make_shared<ConvertOptions>();
  auto* convert = app.add_subcommand(
      "convert",
      "Re-store a dataset with another dtype, chunking or compression, read and written through "
      "a mesh");
  convert
      ->add_option("source", convert_options->source,
                   "IN.h5:/dataset, optionally with a range of rows (every rank then reads its "
                   "own box), e.g. run.h5:/snapshots[:-1]")
      ->required();
  convert->add_option("target", convert_options->target, "OUT.h5[:/dataset] (same dataset path)")
      ->required();
  convert->add_option("--dtype", convert_options->dtype,
                      "Element type written: f32, f64, f16, bf16, i32, i64, u8 (default: kept)");
  convert->add_option("--chunks", convert_options->chunks,
                      "Chunk extents, e.g. 1,64,64 (auto: chosen for --gzip/--checksum)");
  convert->add_option("--gzip", convert_options->gzip, "gzip level 0..9 (chunked)")
      ->check(CLI::Range(0, 9));
  convert->add_flag("--checksum", convert_options->checksum, "Fletcher-32 checksum per chunk");
  add_mesh_options(*convert, convert_options->layout, "0,1");
  convert
      ->add_option("--mode", convert_options->mode,
                   "root (rank 0 reads, scatters, gathers and writes, staging-bounded) or sharded "
                   "(every rank reads and writes its own box)")
      ->capture_default_str();
  convert->add_flag("--verify", convert_options->verify,
                    "Read the output back and compare with the input bit for bit");
  convert->callback([convert_options] {
    launch(backend_from_env(), convert_options->layout.local_ranks(),
           [&](std::shared_ptr<Comm> world) { run_convert(world, *convert_options); });
  });

  auto compare_options = std::make_shared<CompareOptions>();
  auto* compare = app.add_subcommand(
      "compare",
      "Differences of two datasets of one shape (max abs, rms and relative L2 error), read "
      "through a mesh");
  compare
      ->add_option("reference", compare_options->reference,
                   "REF.h5:/dataset, optionally with a range of rows, e.g. run.h5:/snapshots[1:]")
      ->required();
  compare->add_option("test", compare_options->test, "TEST.h5:/dataset[a:b]")->required();
  add_mesh_options(*compare, compare_options->layout, "0,2");
  compare->add_flag("--json", compare_options->json, "Print one JSON object");
  compare->callback([compare_options] {
    launch(backend_from_env(), compare_options->layout.local_ranks(),
           [&](std::shared_ptr<Comm> world) { run_compare(world, *compare_options); });
  });

  scatter->callback([options] {
    launch(backend_from_env(), options->layout.local_ranks(),
           [&](std::shared_ptr<Comm> world) { run_scatter(world, *options); });
  });
}

}  // namespace tessera::cli
