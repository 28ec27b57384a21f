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

/// Collective: `tensor` with every Partial placement reduced (made Replicate); itself otherwise.
ShardTensor without_partial(const ShardTensor& tensor);

/// Collective: streams one copy of every box of `source` (no Partial placements) to `root`,
/// which writes them into the existing `dataset` of `file` (of source's global shape), staging at
/// most `staging_bytes` (the same value on every rank). Returns the root's first problem (never
/// agreed: the caller agrees on it); after a failure the root still receives every box.
std::optional<std::string> stream_to_root(const ShardTensor& source, const std::string& file,
                                          const std::string& dataset, int root,
                                          size_t staging_bytes);

}  // namespace tessera::io::detail
