// Parsing of the CLI's shared argument formats: mesh "2x2", lists "3,4", extents "3,5;4,4".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace tessera::cli {

/// Adds `--trace FILE` to `command`: a Chrome/Perfetto trace of the run (core/trace.hpp; the
/// same as TESSERA_TRACE=FILE).
void add_trace_option(CLI::App& command);

/// "2x2x1" -> {2, 2, 1}.
std::vector<int> parse_mesh(const std::string& text);
/// "3,4,5" -> {3, 4, 5}.
std::vector<int64_t> parse_list(const std::string& text);
/// "3,5;4,4" -> {{3, 5}, {4, 4}} (one group per mesh dim).
std::vector<std::vector<int64_t>> parse_extents(const std::string& text);
/// Local rank counts "1,2,4" (each 1 to kMaxLocalRanks); errors name `option`.
std::vector<int> parse_rank_counts(const std::string& text, const std::string& option);
/// `text` on one line: newlines become "; " (for CLI11's multi-line messages).
std::string one_line(const std::string& text);
/// Seconds since the steady clock's epoch, as a double.
double now_seconds();

/// --device: "cpu", "cuda" (each rank on cuda:(local rank % visible GPUs)) or "cuda:N". Checks
/// that the device exists (one clear error otherwise: a build without CUDA, no GPU, an index
/// beyond the visible ones) and makes it every rank's device (TESSERA_DEVICE) for the launch
/// that follows.
void select_device(const std::string& text);

/// What every sharding command takes: --mesh, --shard-dims, --extents, --ranks.
struct MeshOptions {
  std::string mesh = "1", shard_dims, extents;
  int ranks = 0;
  /// The local ranks to run without mpiexec: --ranks, or else the mesh size (1 to
  /// kMaxLocalRanks, else InvalidArgument).
  int local_ranks() const;
};

}  // namespace tessera::cli
