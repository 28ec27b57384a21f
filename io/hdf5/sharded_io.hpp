// Sharded HDF5 IO: read a dataset straight into a ShardTensor (every rank reads its own box, or
// one root reads and sends each rank its box) and write a ShardTensor back as one dataset through
// one root. Files are opened with serial HDF5 (io/hdf5/h5_file.hpp), so every rank that reads must
// see the file on a shared file system. Every call is collective over the mesh; a problem any rank
// meets (missing file or dataset, unsupported element type, bad layout, Partial placements on
// read) is raised as the same AgreedError on every rank.
//
// Streaming: the root never stages more than `staging_bytes` of packed data at once (half in
// flight, half being read or written). A box larger than half the budget moves as several slabs
// along its first dim, of max(1, (staging_bytes / 2) / row_bytes) rows each (row_bytes: the bytes
// of one index of the first dim), with tags 0, 1, 2, ... (modulo 32768); both sides compute the
// same slabs from the root's budget, which the root broadcasts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::io {

/// Collective: every rank reads its own box of `dataset` (Shard/Replicate placements only).
ShardTensor read_sharded(const std::string& file, const std::string& dataset,
                         const DeviceMesh& mesh, std::vector<Placement> placements,
                         std::vector<std::vector<int64_t>> extents = {},
                         std::optional<DType> as = std::nullopt);

/// Collective: only `root` opens the file; it reads every rank's box and sends it, streaming.
ShardTensor scatter(const std::string& file, const std::string& dataset, const DeviceMesh& mesh,
                    std::vector<Placement> placements,
                    std::vector<std::vector<int64_t>> extents = {}, int root = 0,
                    size_t staging_bytes = 256 << 20, std::optional<DType> as = std::nullopt);

/// Collective: `root` writes the global tensor as `dataset` of `file` from streamed boxes,
/// replacing the file atomically (written to a temporary file, then renamed).
void gather_write(const ShardTensor& tensor, const std::string& file, const std::string& dataset,
                  int root = 0, size_t staging_bytes = 256 << 20);

}  // namespace tessera::io
