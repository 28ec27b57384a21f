// What the `tessera run-op` commands share: reading the inputs on rank 0 with agreed errors, the
// layout from --shard-dims/--extents, replicating rank 0's tensors, and writing the gathered
// results atomically.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/tessera.hpp"

namespace tessera::cli {

/// The message of `error` without its "[op] " tag.
std::string untagged(const Error& error);

/// Collective: runs `body` on every rank; an Error any rank raises becomes an AgreedError on every
/// rank, with the lowest such rank's message, tagged as that error was (`tag` where this rank
/// raised none), so an error every rank meets alike prints one line, not one per rank.
void agreed_everywhere(Comm& world, const std::string& tag, const std::function<void()>& body);

/// Collective: runs `read` on rank 0 only; an Error it throws becomes the same AgreedError
/// (tagged "run-op") on every rank.
void read_on_root(Comm& world, const std::function<void()>& read);

/// The inputs' layout on `mesh` from --shard-dims (the tensor dim each mesh dim shards; default:
/// the mesh.ndim() dims ending just before `default_end`) and --extents (default: balanced).
/// A mesh dim of size 1 is Replicate unless extents are given. Bad values are AgreedErrors
/// tagged `op`.
struct RunOpLayout {
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
};
RunOpLayout run_op_layout(const DeviceMesh& mesh, const std::string& shard_dims,
                          const std::string& extents, int64_t ndim, int64_t default_end,
                          const std::string& op = "run-op");

/// Collective: an AgreedError on every rank when --out names the --in file (by path or inode),
/// which writing the output would destroy, or a path rank 0 cannot write (io::check_output_path).
void check_run_op_files(Comm& world, const std::string& in, const std::string& out);

/// Collective: a tensor only rank 0 holds, as a replicated ShardTensor.
ShardTensor replicate_from_root(const Tensor& full, const DeviceMesh& mesh);

/// Writes `datasets` as the only contents of `file`, atomically: into a temporary file that is
/// renamed over `file` once complete (removed on failure, so no partial output is left). A path
/// that cannot be written (a directory, a missing or read-only directory) is refused first.
/// In estimate mode (docs/scaling.md) nothing is written: the tensors are shape-only.
void write_outputs(const std::string& file,
                   const std::vector<std::pair<std::string, Tensor>>& datasets);

/// How a run-op command's summary line ends: "<backend> backend, T ms; wrote FILE", or in
/// estimate mode "recorded without data" (no time measured, no file written).
std::string run_summary_tail(const Comm& world, double seconds, const std::string& file);

}  // namespace tessera::cli
