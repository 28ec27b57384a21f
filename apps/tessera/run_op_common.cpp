// Shared pieces of the `tessera run-op` commands (run_op_common.hpp).
#include "apps/tessera/run_op_common.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <filesystem>
#include <optional>

#include "apps/tessera/cli_parse.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/output_path.hpp"

namespace tessera::cli {

std::string untagged(const Error& error) {
  const std::string text = error.what();
  const size_t end = text.find("] ");
  return end == std::string::npos ? text : text.substr(end + 2);
}

void agreed_everywhere(Comm& world, const std::string& tag, const std::function<void()>& body) {
  std::optional<std::string> problem;
  std::string raised_tag = tag;
  try {
    body();
  } catch (const Error& error) {
    problem = untagged(error);
    raised_tag = error.op();
  }
  agree_on_error(world, raised_tag, problem);
}

void read_on_root(Comm& world, const std::function<void()>& read) {
  std::optional<std::string> problem;
  if (world.rank() == 0) {
    try {
      read();
    } catch (const Error& error) {
      problem = untagged(error);
    }
  }
  agree_on_error(world, "run-op", problem);
}

RunOpLayout run_op_layout(const DeviceMesh& mesh, const std::string& shard_dims_text,
                          const std::string& extents_text, int64_t ndim, int64_t default_end,
                          const std::string& op) {
  std::vector<int64_t> shard_dims;
  if (shard_dims_text.empty()) {
    for (int m = 0; m < mesh.ndim(); ++m) shard_dims.push_back(default_end - mesh.ndim() + m);
  } else {
    shard_dims = parse_list(shard_dims_text);
  }
  if (static_cast<int>(shard_dims.size()) != mesh.ndim())
    throw AgreedError(op, fmt::format("--shard-dims {} names {} dims for a {}-d mesh", shard_dims,
                                      shard_dims.size(), mesh.ndim()));
  RunOpLayout layout;
  for (int64_t dim : shard_dims) {
    if ((dim < 0 || dim >= ndim) && shard_dims_text.empty())
      throw AgreedError(op, fmt::format("the {}-d input has too few dims for a {}-d mesh "
                                        "(the default shards its dims {}); give --shard-dims",
                                        ndim, mesh.ndim(), shard_dims));
    if (dim < 0 || dim >= ndim)
      throw AgreedError(op, fmt::format("--shard-dims {}: dim {} is not a dim of the {}-d input "
                                        "(expected 0 to {})",
                                        shard_dims_text, dim, ndim, ndim - 1));
    layout.placements.push_back(mesh.size(static_cast<int>(layout.placements.size())) == 1
                                    ? Placement::replicate()
                                    : Placement::shard(static_cast<int>(dim)));
  }
  if (!extents_text.empty()) {
    layout.extents = parse_extents(extents_text);
    for (size_t m = 0; m < layout.extents.size() && m < layout.placements.size(); ++m)
      if (layout.placements[m].is_replicate())
        layout.placements[m] = Placement::shard(static_cast<int>(shard_dims[m]));
  }
  return layout;
}

void check_run_op_files(Comm& world, const std::string& in, const std::string& out) {
  std::optional<std::string> problem;
  try {
    io::check_output_is_not_input("run-op", in, out);
    if (world.rank() == 0) io::check_output_path("run-op", out);  // rank 0 writes it
  } catch (const Error& error) {
    problem = untagged(error);
  }
  agree_on_error(world, "run-op", problem);
}

ShardTensor replicate_from_root(const Tensor& full, const DeviceMesh& mesh) {
  return ShardTensor::scatter(full, mesh,
                              std::vector<Placement>(mesh.ndim(), Placement::replicate()));
}

void write_outputs(const std::string& file,
                   const std::vector<std::pair<std::string, Tensor>>& datasets) {
  if (estimate::active()) return;
  io::check_output_path("run-op", file);
  const std::string temporary = fmt::format("{}.tmp-{}", file, static_cast<long>(::getpid()));
  try {
    bool first = true;
    for (const auto& [name, tensor] : datasets) {
      io::write_dataset(temporary, name, tensor, {.truncate_file = first});
      first = false;
    }
    std::filesystem::rename(temporary, file);
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
}

std::string run_summary_tail(const Comm& world, double seconds, const std::string& file) {
  if (estimate::active()) return "recorded without data";
  return fmt::format("{} backend, {:.3f} ms; wrote {}", world.backend(), seconds * 1e3, file);
}

}  // namespace tessera::cli
