// Sharded checkpoints: several named ShardTensors saved into one HDF5 file through one root, and
// loaded back onto any mesh (the saved layout when the mesh shape matches, a given layout, or
// replicated). docs/io.md ("Checkpoints") describes the file layout and its attributes.
//
// Each tensor is one dataset at "/<name>" (a '/' in a name makes groups), carrying scalar string
// attributes: tessera_format_version ("1"), global_shape ("7,5"), dtype ("f32"), placements
// ("S(0),R", as saved: Partial placements are reduced first), mesh_shape ("2,2"), mesh_dims
// ("d0,d1") and extents (per mesh dim the comma-separated extents, ';' between mesh dims, empty
// for non-Shard dims: "3,4;").
//
// Atomicity: the root writes the whole checkpoint into "<file>.tmp-<pid>" and renames it onto
// `file` only when every tensor is complete, so a crash mid-save leaves the previous checkpoint
// intact (and possibly a stray temporary file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::io {

/// Collective over the mesh of the tensors (all on the same communicator): `root` writes every
/// tensor (streamed as in gather_write, staging at most `staging_bytes`) into a fresh file that
/// replaces `file` atomically. Names must be distinct and non-empty.
void save_checkpoint(const std::string& file,
                     const std::vector<std::pair<std::string, ShardTensor>>& tensors, int root = 0,
                     size_t staging_bytes = 256 << 20);

/// A layout to load a tensor with: placements and extents (empty = default split).
using CheckpointLayout = std::pair<std::vector<Placement>, std::vector<std::vector<int64_t>>>;

/// Collective: every tensor of the checkpoint `file` (sorted by name), each read onto `mesh` by
/// every rank reading its own box: with layouts[name] when given, else with the saved placements
/// and extents when the saved mesh shape equals mesh.shape(), else replicated. A file that is not
/// a checkpoint (no dataset with tessera_format_version) or of another format version raises the
/// same AgreedError on every rank.
std::vector<std::pair<std::string, ShardTensor>> load_checkpoint(
    const std::string& file, const DeviceMesh& mesh,
    const std::map<std::string, CheckpointLayout>& layouts = {});

}  // namespace tessera::io
