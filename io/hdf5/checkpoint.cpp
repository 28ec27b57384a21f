// Sharded checkpoints (io/hdf5/checkpoint.hpp) on top of the streaming of sharded_io.cpp and the
// serial calls of h5_file.hpp. Compiled only when Tessera is built with HDF5.
#include "io/hdf5/checkpoint.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <set>

#include "core/agree.hpp"
#include "core/trace.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"
#include "io/hdf5/sharded_io_detail.hpp"

namespace tessera::io {
namespace {

constexpr const char* kVersionAttribute = "tessera_format_version";
constexpr const char* kFormatVersion = "1";

using detail::reason_of;

/// `text` split at every `separator` ("" -> {""}, "a;" -> {"a", ""}).
std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts(1);
  for (char c : text) {
    if (c == separator)
      parts.emplace_back();
    else
      parts.back() += c;
  }
  return parts;
}

/// Comma-separated integers ("" -> {}); throws InvalidArgument on anything else.
std::vector<int64_t> parse_integers(const std::string& text, const std::string& what) {
  std::vector<int64_t> values;
  if (text.empty()) return values;
  for (const std::string& part : split(text, ',')) {
    size_t used = 0;
    int64_t value = 0;
    try {
      value = std::stoll(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (part.empty() || used != part.size())
      throw InvalidArgument(
          "load_checkpoint",
          fmt::format("expected comma-separated integers in {}, found '{}'", what, text));
    values.push_back(value);
  }
  return values;
}

/// "3,4;;1,2" for extents {{3, 4}, {}, {1, 2}}.
std::string extents_text(const std::vector<std::vector<int64_t>>& extents, int mesh_ndim) {
  std::vector<std::string> dims;
  for (int m = 0; m < mesh_ndim; ++m)
    dims.push_back(static_cast<size_t>(m) < extents.size()
                       ? fmt::format("{}", fmt::join(extents[m], ","))
                       : "");
  return fmt::format("{}", fmt::join(dims, ";"));
}

/// The attributes describing a saved tensor (no Partial placements).
std::map<std::string, std::string> attributes_of(const ShardTensor& saved) {
  const DeviceMesh& mesh = saved.mesh();
  std::vector<std::string> placements;
  for (const Placement& placement : saved.placements()) placements.push_back(placement.str());
  std::map<std::string, std::string> attributes;
  attributes.emplace(kVersionAttribute, kFormatVersion);
  attributes["global_shape"] = fmt::format("{}", fmt::join(saved.global_shape(), ","));
  attributes["dtype"] = std::string(dtype_name(saved.dtype()));
  attributes["placements"] = fmt::format("{}", fmt::join(placements, ","));
  attributes["mesh_shape"] = fmt::format("{}", fmt::join(mesh.shape(), ","));
  attributes["mesh_dims"] = fmt::format("{}", fmt::join(mesh.names(), ","));
  attributes["extents"] = extents_text(saved.spec().extents, mesh.ndim());
  return attributes;
}

/// Collective: `text` of `root` on every rank.
std::string broadcast_string(Comm& comm, std::string text, int root) {
  int64_t length = static_cast<int64_t>(text.size());
  comm.broadcast(&length, 1, DType::i64, root);
  text.resize(static_cast<size_t>(length));
  if (length > 0) comm.broadcast(text.data(), text.size(), DType::u8, root);
  return text;
}

/// One tensor of a checkpoint as its attributes describe it.
struct SavedTensor {
  std::string path;  // dataset path, e.g. "/fields/u"
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
  std::vector<int> mesh_shape;
};

/// Parses the attributes of a checkpoint dataset; throws InvalidArgument naming the problem.
SavedTensor parse_saved(const std::string& path, const std::map<std::string, std::string>& attrs) {
  auto get = [&](const std::string& name) -> const std::string& {
    const auto found = attrs.find(name);
    if (found == attrs.end())
      throw InvalidArgument("load_checkpoint",
                            fmt::format("dataset '{}' lacks the attribute '{}'", path, name));
    return found->second;
  };
  SavedTensor saved;
  saved.path = path;
  for (const int64_t extent : parse_integers(get("mesh_shape"), "mesh_shape of " + path))
    saved.mesh_shape.push_back(static_cast<int>(extent));
  const std::string& placements = get("placements");
  if (!placements.empty())
    for (const std::string& text : split(placements, ','))
      saved.placements.push_back(parse_placement(text));
  const std::vector<std::string> dims = split(get("extents"), ';');
  if (dims.size() != saved.placements.size() || dims.size() != saved.mesh_shape.size())
    throw InvalidArgument(
        "load_checkpoint",
        fmt::format("dataset '{}': placements '{}', extents '{}' and mesh_shape '{}' disagree on "
                    "the number of mesh dims",
                    path, placements, get("extents"), get("mesh_shape")));
  for (const std::string& dim : dims)
    saved.extents.push_back(parse_integers(dim, "extents of " + path));
  return saved;
}

}  // namespace

void save_checkpoint(const std::string& file,
                     const std::vector<std::pair<std::string, ShardTensor>>& tensors, int root,
                     size_t staging_bytes) {
  const std::string op = "save_checkpoint";
  trace::Span span("io", op);
  span.arg("file", file);
  if (tensors.empty()) throw InvalidArgument(op, fmt::format("no tensors to save into '{}'", file));
  CommOpScope scope(op);
  Comm& comm = tensors.front().second.mesh().comm();
  std::optional<std::string> problem;
  if (root < 0 || root >= comm.size())
    problem = fmt::format("root {} outside a mesh of {} ranks", root, comm.size());
  std::set<std::string> names;
  for (const auto& [name, tensor] : tensors) {
    if (problem) break;
    if (name.find_first_not_of('/') == std::string::npos)
      problem = fmt::format("tensor name '{}' is empty", name);
    else if (!names.insert(name.substr(name.find_first_not_of('/'))).second)
      problem = fmt::format("tensor name '{}' appears twice", name);
    else if (&tensor.mesh().comm() != &comm)
      problem = fmt::format("tensor '{}' lives on another communicator than '{}'", name,
                            tensors.front().first);
  }
  agree_on_error(comm, op, problem);
  int64_t budget = static_cast<int64_t>(staging_bytes);
  comm.broadcast(&budget, 1, DType::i64, root);
  staging_bytes = static_cast<size_t>(budget);

  const std::string temporary = fmt::format("{}.tmp-{}", file, static_cast<long>(::getpid()));
  for (size_t index = 0; index < tensors.size(); ++index) {
    const auto& [name, tensor] = tensors[index];
    const ShardTensor saved = detail::without_partial(tensor);
    // The root creates the dataset (the first one in a fresh temporary file) and describes it.
    if (comm.rank() == root) {
      try {
        if (index == 0) std::filesystem::remove(temporary);
        WriteOptions options;
        options.truncate_file = index == 0;
        create_dataset(temporary, name, saved.global_shape(), saved.dtype(), options);
        write_attributes(temporary, name, attributes_of(saved));
      } catch (const std::exception& error) {
        problem = reason_of(error);
      }
    }
    detail::agree_or_discard(op, comm, temporary, root, problem);
    problem = detail::stream_to_root(saved, temporary, name, root, staging_bytes);
    detail::agree_or_discard(op, comm, temporary, root, problem);
  }
  detail::finish_temporary(op, comm, temporary, file, root, std::nullopt);
}

std::vector<std::pair<std::string, ShardTensor>> load_checkpoint(
    const std::string& file, const DeviceMesh& mesh,
    const std::map<std::string, CheckpointLayout>& layouts) {
  const std::string op = "load_checkpoint";
  trace::Span span("io", op);
  span.arg("file", file);
  CommOpScope scope(op);
  Comm& comm = mesh.comm();
  // Rank 0 lists the checkpoint's tensors and checks their attributes; every rank gets them as
  // lines of "path\tplacements\textents\tmesh_shape".
  std::optional<std::string> problem;
  std::string listing;
  if (comm.rank() == 0) {
    try {
      for (const DatasetInfo& info : list_datasets(file)) {
        const auto version = info.attributes.find(kVersionAttribute);
        if (version == info.attributes.end()) continue;
        if (version->second != kFormatVersion)
          throw InvalidArgument(
              op, fmt::format("file '{}', dataset '{}': expected {} \"{}\", "
                              "found \"{}\"",
                              file, info.path, kVersionAttribute, kFormatVersion, version->second));
        parse_saved(info.path, info.attributes);
        listing += fmt::format("{}\t{}\t{}\t{}\n", info.path, info.attributes.at("placements"),
                               info.attributes.at("extents"), info.attributes.at("mesh_shape"));
      }
      if (listing.empty())
        throw InvalidArgument(op, fmt::format("file '{}' is not a Tessera checkpoint (no dataset "
                                              "has a {} attribute)",
                                              file, kVersionAttribute));
    } catch (const std::exception& error) {
      problem = reason_of(error);
    }
  }
  agree_on_error(comm, op, problem);
  listing = broadcast_string(comm, listing, 0);

  std::vector<std::pair<std::string, ShardTensor>> loaded;
  for (const std::string& line : split(listing, '\n')) {
    if (line.empty()) continue;
    const std::vector<std::string> fields = split(line, '\t');
    SavedTensor saved = parse_saved(
        fields[0], {{"placements", fields[1]}, {"extents", fields[2]}, {"mesh_shape", fields[3]}});
    const std::string name = saved.path.substr(saved.path.find_first_not_of('/'));
    std::vector<Placement> placements;
    std::vector<std::vector<int64_t>> extents;
    const auto layout = layouts.find(name);
    if (layout != layouts.end()) {
      placements = layout->second.first;
      extents = layout->second.second;
    } else if (saved.mesh_shape == mesh.shape()) {
      placements = std::move(saved.placements);
      extents = std::move(saved.extents);
    } else {
      placements.assign(static_cast<size_t>(mesh.ndim()), Placement::replicate());
    }
    loaded.emplace_back(
        name, read_sharded(file, saved.path, mesh, std::move(placements), std::move(extents)));
  }
  return loaded;
}

}  // namespace tessera::io
