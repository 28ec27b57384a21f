// Host<->device transfers and their counters. Every byte that crosses between host memory and a
// device goes through transfer_bytes, so tests can assert that a device op moved nothing
// through the host (transfer_stats before and after).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device.hpp"

namespace tessera {

/// Bytes moved between host and devices since start-up (process-wide, all threads).
struct TransferStats {
  uint64_t host_to_device_bytes = 0;
  uint64_t device_to_host_bytes = 0;
  uint64_t device_to_device_bytes = 0;  ///< between two different devices
  uint64_t host_to_device_copies = 0;
  uint64_t device_to_host_copies = 0;
};

/// The counters now (take the difference of two readings around an op).
TransferStats transfer_stats();

/// Copies `bytes` from `src` on `src_device` to `dst` on `dst_device` (contiguous) and counts
/// them. Ordered on the calling rank's compute stream; returns once the data is readable by the
/// destination (host destinations: the copy is complete).
void transfer_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

/// Adds to the counters (for transfers made outside transfer_bytes, e.g. pinned staging in the
/// MPI backend).
void count_transfer(Device dst_device, Device src_device, size_t bytes);

}  // namespace tessera
