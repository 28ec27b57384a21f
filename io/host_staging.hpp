// Host staging of tensor bytes for IO: HDF5 reads and writes and the root's point-to-point
// streams move host memory, so a cuda tensor crosses to the host in slabs through two reusable
// pinned buffers (pinned_staging_pool), never as one whole host copy. While the caller consumes
// (writes, sends) slab k on the host, the device-to-host copy of slab k+1 is already under way
// on the rank's compute stream; on the way in, the host-to-device copy of slab k runs while the
// caller produces (reads, receives) slab k+1. A cpu tensor is handed over in place: the caller
// sees pointers into the tensor itself and nothing is copied.
//
// Slabs are byte ranges of a contiguous tensor. contiguous_slabs() cuts a row-major tensor into
// boxes whose elements are contiguous in memory, of at most a given size, for HDF5 hyperslab
// selections; the sharded streams cut their own (first-dim ranges, see sharded_io.cpp).
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <vector>

#include "core/box.hpp"
#include "core/tensor.hpp"

namespace tessera::io {

/// A byte range [offset, offset + bytes) of a contiguous tensor's storage.
struct ByteRange {
  size_t offset = 0;
  size_t bytes = 0;
};

/// The most bytes one HDF5 call moves through the host for a tensor on `device`: for a cuda
/// tensor TESSERA_IO_SLAB_BYTES when set, else 64 MiB; for a cpu tensor TESSERA_IO_SLAB_BYTES
/// when set (tests exercise the slab loop with it), else no limit (one call, no copy).
size_t io_slab_bytes(Device device);

/// Boxes (coordinates of the tensor) that cut a contiguous row-major tensor of `shape` into
/// pieces each contiguous in memory and of at most max(`slab_bytes`, `element`) bytes, in memory
/// order: whole trailing dims, a range of one dim, single indices of the dims before it. None for
/// a tensor without elements; one empty-ranked box for a 0-d tensor.
std::vector<Box> contiguous_slabs(const Shape& shape, size_t element, size_t slab_bytes);

/// The byte range of `box` (coordinates of the tensor) in a contiguous tensor of `shape`; the box
/// must be one of contiguous_slabs(shape, ...) or otherwise contiguous in memory.
ByteRange byte_range_of(const Box& box, const Shape& shape, size_t element);

/// Calls `consume(k, host)` for each range k of `source` (any device) in order, `host` pointing
/// at ranges[k].bytes bytes holding that range's values and valid only during the call. cpu
/// source: pointers into its contiguous storage. cuda source: double-buffered pinned staging
/// (see the file comment); counted in transfer_stats(). `op` tags errors.
void stream_to_host(const Tensor& source, std::span<const ByteRange> ranges,
                    const std::function<void(size_t k, const void* host)>& consume,
                    const std::string& op);

/// Calls `produce(k, host)` for each range k of the contiguous `destination` (any device) in
/// order; the values it writes into `host` (ranges[k].bytes bytes) land in that range. On return
/// every range is in place as seen from the rank's compute stream. cpu destination: pointers into
/// its storage. cuda destination: double-buffered pinned staging; counted in transfer_stats().
void stream_from_host(const Tensor& destination, std::span<const ByteRange> ranges,
                      const std::function<void(size_t k, void* host)>& produce,
                      const std::string& op);

}  // namespace tessera::io
