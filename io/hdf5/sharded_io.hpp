// Sharded HDF5 IO: read a dataset straight into a ShardTensor (every rank reads its own box, or
// one root reads and sends each rank its box) and write a ShardTensor back as one dataset (every
// rank writes its own box, or one root receives and writes them all). Every call is collective
// over the mesh; a problem any rank meets (missing file or dataset, unsupported element type, bad
// layout, Partial placements on read) is raised as the same AgreedError on every rank.
//
// Per-rank reads and writes (read_sharded, write_sharded) need the file on a file system every
// rank sees. With a parallel HDF5 and the mpi backend they go through MPI-IO with collective
// transfers (one H5Dread/H5Dwrite in which every rank takes part, so the MPI-IO layer can merge
// and align the ranks' requests); otherwise each rank reads independently with the serial driver,
// and writers take turns (rank order), each opening, writing and closing the file.
// collective_io_available() tells which; `collective = false` forces the independent path.
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
#include "io/hdf5/h5_file.hpp"

namespace tessera::io {

/// True when read_sharded and write_sharded on `mesh` use collective MPI-IO (Tessera built with a
/// parallel HDF5, and the mesh's communicator is an mpi-backend one).
bool collective_io_available(const DeviceMesh& mesh);

/// Collective: every rank reads its own box of `dataset` (Shard/Replicate placements only).
ShardTensor read_sharded(const std::string& file, const std::string& dataset,
                         const DeviceMesh& mesh, std::vector<Placement> placements,
                         std::vector<std::vector<int64_t>> extents = {},
                         std::optional<DType> as = std::nullopt, bool collective = true);

/// Collective: only `root` opens the file; it reads every rank's box and sends it, streaming.
ShardTensor scatter(const std::string& file, const std::string& dataset, const DeviceMesh& mesh,
                    std::vector<Placement> placements,
                    std::vector<std::vector<int64_t>> extents = {}, int root = 0,
                    size_t staging_bytes = 256 << 20, std::optional<DType> as = std::nullopt);

/// Collective: `root` writes the global tensor as `dataset` of `file` from streamed boxes,
/// replacing the file atomically (written to a temporary file, then renamed).
/// `storage` chooses contiguous, chunked or compressed storage of the new dataset (as for
/// write_dataset; truncate_file is ignored: other datasets of the file are kept).
void gather_write(const ShardTensor& tensor, const std::string& file, const std::string& dataset,
                  int root = 0, size_t staging_bytes = 256 << 20, const WriteOptions& storage = {});

/// Collective: every rank writes its own box of the global tensor as `dataset` of `file` (one
/// copy of each element: of ranks holding the same box, only the one at mesh coordinate 0 of the
/// non-Shard dims writes; Partial placements are reduced first), replacing the file atomically as
/// gather_write does. No rank holds more than its own shard.
/// `storage` as for gather_write (compressed datasets take the collective path only with a
/// parallel HDF5 that supports filtered parallel writes, 1.10.2 and later).
void write_sharded(const ShardTensor& tensor, const std::string& file, const std::string& dataset,
                   bool collective = true, const WriteOptions& storage = {});

/// Collective: every rank writes its own box of `tensor` into the existing `dataset` of the
/// existing `file` at index `leading` of the dataset's first dims: the dataset's shape is some
/// leading extents followed by the tensor's global shape (e.g. snapshot t of a [T, ...] series,
/// leading = {t}). The file is written in place, not replaced: collective MPI-IO as for
/// write_sharded, writers in rank order otherwise; one copy of each element is written.
void write_sharded_at(const ShardTensor& tensor, const std::string& file,
                      const std::string& dataset, const std::vector<int64_t>& leading,
                      bool collective = true);

}  // namespace tessera::io
