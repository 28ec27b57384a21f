// Internal pieces of sharded IO (io/hdf5/sharded_io.cpp) shared with checkpoints
// (io/hdf5/checkpoint.cpp). Not installed; compiled only with HDF5.
#pragma once

#include <cstddef>
#include <exception>
#include <optional>
#include <string>

#include "core/shard_tensor.hpp"

namespace tessera::io::detail {

/// The message of an error without its "[op] " prefix (agree_on_error adds the op back).
std::string reason_of(const std::exception& error);

/// What every rank knows after the header exchange: the dataset's shape, the dtype read, and
/// the root's staging budget.
struct Header {
  Shape shape;
  DType dtype = DType::f32;
  size_t staging_bytes = 0;
};

/// Collective: refuses Partial placements and a bad root; `root` describes the dataset (and
/// checks that it can be read as the dtype) and broadcasts its shape, dtype and staging budget.
/// Any problem becomes the same AgreedError (tagged `op`) on every rank.
Header agreed_header(const DeviceMesh& mesh, const std::string& op, const std::string& file,
                     const std::string& dataset, const std::vector<Placement>& placements,
                     std::optional<DType> as, int root, size_t staging_bytes);

/// Collective: `tensor` with every Partial placement reduced (made Replicate); itself otherwise.
ShardTensor without_partial(const ShardTensor& tensor);

/// Collective: streams one copy of every box of `source` (no Partial placements) to `root`,
/// which writes them into the existing `dataset` of `file` (of source's global shape), staging at
/// most `staging_bytes` (the same value on every rank). Returns the root's first problem (never
/// agreed: the caller agrees on it); after a failure the root still receives every box.
// ---- atomic replacement of a file through a temporary one ----

/// Collective: agrees on `problem` (AgreedError on every rank when any rank had one), and in
/// that case `root` first removes `temporary`.
void agree_or_discard(const std::string& op, Comm& comm, const std::string& temporary, int root,
                      const std::optional<std::string>& problem);

/// Collective: agree_or_discard, then `root` renames `temporary` over `file`; a failed rename
/// removes the temporary file and is raised on every rank too.
void finish_temporary(const std::string& op, Comm& comm, const std::string& temporary,
                      const std::string& file, int root, const std::optional<std::string>& problem);

// ---- collective MPI-IO (h5_mpio.cpp with a parallel HDF5, no_h5_mpio.cpp otherwise) ----

/// True when hyperslabs can move by collective MPI-IO on `comm`: Tessera was built with a
/// parallel HDF5 and `comm` is an mpi-backend communicator.
bool collective_io_available(const Comm& comm);

/// Collective over `comm` (every rank calls, in the same order): this rank's `box` of `dataset`
/// (an empty box takes part with an empty selection), read through MPI-IO with collective
/// transfers into a tensor on `device` (cuda: in pinned slabs). Every rank makes `calls` transfers
/// (the most slabs of any rank: agreed_slab_calls). Throws IoError like read_hyperslab.
Tensor collective_read(const Comm& comm, const std::string& file, const std::string& dataset,
                       const Box& box, DType dtype, Device device, size_t calls);

/// Collective over `comm`: writes `tensor` (any device) into `box` of the existing `dataset`
/// through MPI-IO with `calls` collective transfers (agreed_slab_calls); ranks with
/// `write_nothing` (replicas) take part with empty selections.
void collective_write(const Comm& comm, const std::string& file, const std::string& dataset,
                      const Box& box, const Tensor& tensor, bool write_nothing, size_t calls);

/// Collective: the most HDF5 transfers any rank of `comm` needs for its `box` of `dtype` on
/// `device` (0 for a rank that moves nothing), at least 1.
size_t agreed_slab_calls(Comm& comm, const Box& box, DType dtype, Device device, bool moves);

std::optional<std::string> stream_to_root(const ShardTensor& source, const std::string& file,
                                          const std::string& dataset, int root,
                                          size_t staging_bytes);

}  // namespace tessera::io::detail
