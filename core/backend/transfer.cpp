// Host<->device transfers and their process-wide counters (see transfer.hpp).
#include "core/backend/transfer.hpp"

#include <atomic>
#include <cstring>

#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera {

namespace {

struct Counters {
  std::atomic<uint64_t> host_to_device_bytes{0}, device_to_host_bytes{0}, device_to_device_bytes{0},
      host_to_device_copies{0}, device_to_host_copies{0};
};

Counters& counters() {
  static Counters instance;
  return instance;
}

}  // namespace

TransferStats transfer_stats() {
  const Counters& c = counters();
  return {c.host_to_device_bytes.load(), c.device_to_host_bytes.load(),
          c.device_to_device_bytes.load(), c.host_to_device_copies.load(),
          c.device_to_host_copies.load()};
}

void count_transfer(Device dst_device, Device src_device, size_t bytes) {
  Counters& c = counters();
  if (dst_device.is_cuda() && src_device.is_cpu()) {
    c.host_to_device_bytes += bytes;
    ++c.host_to_device_copies;
  } else if (dst_device.is_cpu() && src_device.is_cuda()) {
    c.device_to_host_bytes += bytes;
    ++c.device_to_host_copies;
  } else if (dst_device.is_cuda() && src_device.is_cuda() && dst_device != src_device) {
    c.device_to_device_bytes += bytes;
  }
}

void transfer_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                    size_t bytes) {
  if (bytes == 0) return;
  count_transfer(dst_device, src_device, bytes);
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Queue on the stream of the device side (the destination's when both are devices), after
  // the work that produced the source.
  const Stream stream = compute_stream_for(dst_device.is_cuda() ? dst_device : src_device);
  if (src_device.is_cuda()) order_after(stream, compute_stream_for(src_device));
  gpu::copy_bytes_async(dst, src, bytes, stream.handle, stream.device.index);
  // A host destination is read by host code next; a pageable host source may be reused at once.
  if (dst_device.is_cpu()) synchronize(stream);
}

}  // namespace tessera
