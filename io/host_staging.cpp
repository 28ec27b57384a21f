// Host staging of tensor bytes for IO (io/host_staging.hpp).
#include "io/host_staging.hpp"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <optional>

#include "core/backend/pinned_pool.hpp"
#include "core/backend/transfer.hpp"
#include "core/errors.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera::io {

namespace {

constexpr size_t kDeviceSlabBytes = size_t{64} << 20;

/// TESSERA_IO_SLAB_BYTES when set (at least 1), else nothing.
std::optional<size_t> slab_setting() {
  const char* text = std::getenv("TESSERA_IO_SLAB_BYTES");
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  const unsigned long long bytes = std::strtoull(text, &end, 10);
  check_arg(*end == '\0' && text[0] != '-' && bytes > 0, "io",
            "TESSERA_IO_SLAB_BYTES={} is not a positive number of bytes", text);
  return static_cast<size_t>(bytes);
}

/// Two pinned slabs and their events on the rank's compute stream of a cuda tensor. The
/// destructor waits for every copy still queued before the slabs go back to the pool (also
/// when the caller's callback threw).
class Staging {
 public:
  Staging(Device device, size_t buffers, size_t bytes, const std::string& op)
      : device_(device), stream_(compute_stream_for(device)) {
    for (size_t b = 0; b < buffers; ++b) {
      slabs_[b] = pinned_staging_pool().acquire(bytes, op);
      events_[b] = gpu::create_event(device.index);
    }
  }
  ~Staging() {
    try {
      gpu::synchronize_stream(stream_.handle, device_.index);
    } catch (...) {
      // The error (if any) surfaced in the caller already; the slabs must still go back.
    }
    for (gpu::EventHandle event : events_)
      if (event != nullptr) gpu::destroy_event(event, device_.index);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  void* host(size_t k) const { return slabs_[k % 2].data(); }
  /// Queues a copy of `bytes` on the compute stream and records buffer k's event after it.
  void copy(void* dst, const void* src, size_t bytes, size_t k) {
    gpu::copy_bytes_async(dst, src, bytes, stream_.handle, device_.index);
    gpu::record_event(events_[k % 2], stream_.handle, device_.index);
  }
  /// Blocks until the last copy recorded on buffer k's event is done.
  void wait(size_t k) const { gpu::synchronize_event(events_[k % 2], device_.index); }

 private:
  Device device_;
  Stream stream_;
  PinnedSlab slabs_[2];
  gpu::EventHandle events_[2] = {nullptr, nullptr};
};

size_t largest_range(std::span<const ByteRange> ranges) {
  size_t largest = 0;
  for (const ByteRange& range : ranges) largest = std::max(largest, range.bytes);
  return largest;
}

void check_ranges(const Tensor& tensor, std::span<const ByteRange> ranges, const std::string& op) {
  for (const ByteRange& range : ranges)
    check_arg(range.offset <= tensor.nbytes() && range.bytes <= tensor.nbytes() - range.offset, op,
              "staging range [{}, {}) outside a tensor of {} bytes", range.offset,
              range.offset + range.bytes, tensor.nbytes());
}

}  // namespace

size_t io_slab_bytes(Device device) {
  if (const std::optional<size_t> setting = slab_setting()) return *setting;
  return device.is_cpu() ? std::numeric_limits<size_t>::max() : kDeviceSlabBytes;
}

std::vector<Box> contiguous_slabs(const Shape& shape, size_t element, size_t slab_bytes) {
  const size_t ndim = shape.size();
  if (ndim == 0) return {Box{}};
  if (shape_numel(shape) == 0) return {};
  slab_bytes = std::max(slab_bytes, element);
  // The outermost dim `cut` whose single index holds at most slab_bytes: slabs are ranges of
  // it, with single indices of the dims before it.
  size_t cut = ndim - 1;
  size_t inner = element;  // bytes of one index of dim `cut`
  {
    size_t below = element;
    for (size_t d = ndim; d-- > 0;) {
      if (below > slab_bytes) break;
      cut = d;
      inner = below;
      below *= static_cast<size_t>(shape[d]);
    }
  }
  const int64_t rows = static_cast<int64_t>(
      std::clamp<size_t>(slab_bytes / inner, 1, static_cast<size_t>(shape[cut])));
  std::vector<Box> slabs;
  std::vector<int64_t> index(cut, 0);  // odometer over the dims before `cut`
  while (true) {
    for (int64_t lo = 0; lo < shape[cut]; lo += rows) {
      Box box;
      box.lo.assign(ndim, 0);
      box.hi.assign(shape.begin(), shape.end());
      for (size_t d = 0; d < cut; ++d) {
        box.lo[d] = index[d];
        box.hi[d] = index[d] + 1;
      }
      box.lo[cut] = lo;
      box.hi[cut] = std::min(lo + rows, shape[cut]);
      slabs.push_back(std::move(box));
    }
    size_t d = cut;
    while (d > 0 && ++index[d - 1] == shape[d - 1]) index[--d] = 0;
    if (d == 0) break;
  }
  return slabs;
}

ByteRange byte_range_of(const Box& box, const Shape& shape, size_t element) {
  const std::vector<int64_t> strides = contiguous_strides(shape);
  size_t offset = 0;
  for (size_t d = 0; d < shape.size(); ++d) offset += static_cast<size_t>(box.lo[d] * strides[d]);
  return {offset * element, static_cast<size_t>(box.volume()) * element};
}

void stream_to_host(const Tensor& source, std::span<const ByteRange> ranges,
                    const std::function<void(size_t k, const void* host)>& consume,
                    const std::string& op) {
  const Tensor data = source.contiguous();
  check_ranges(data, ranges, op);
  const char* base = static_cast<const char*>(data.raw_data());
  if (data.device().is_cpu()) {
    for (size_t k = 0; k < ranges.size(); ++k) consume(k, base + ranges[k].offset);
    return;
  }
  if (ranges.empty()) return;
  const Device device = data.device();
  Staging staging(device, std::min<size_t>(2, ranges.size()), largest_range(ranges), op);
  auto queue = [&](size_t k) {
    staging.copy(staging.host(k), base + ranges[k].offset, ranges[k].bytes, k);
    count_transfer(Device::cpu(), device, ranges[k].bytes);
  };
  queue(0);
  for (size_t k = 0; k < ranges.size(); ++k) {
    // Slab k+1 goes into the buffer slab k-1 used: consumed (synchronously) already.
    if (k + 1 < ranges.size()) queue(k + 1);
    staging.wait(k);
    consume(k, staging.host(k));
  }
}

void stream_from_host(const Tensor& destination, std::span<const ByteRange> ranges,
                      const std::function<void(size_t k, void* host)>& produce,
                      const std::string& op) {
  TESSERA_CHECK_ARG(destination.is_contiguous(), op, "staging into a non-contiguous tensor {}",
                    destination.str());
  check_ranges(destination, ranges, op);
  char* base = static_cast<char*>(destination.raw_data());
  if (destination.device().is_cpu()) {
    for (size_t k = 0; k < ranges.size(); ++k) produce(k, base + ranges[k].offset);
    return;
  }
  if (ranges.empty()) return;
  const Device device = destination.device();
  Staging staging(device, std::min<size_t>(2, ranges.size()), largest_range(ranges), op);
  for (size_t k = 0; k < ranges.size(); ++k) {
    // The buffer of slab k held slab k-2, whose copy to the device must be done first.
    if (k >= 2) staging.wait(k);
    produce(k, staging.host(k));
    staging.copy(base + ranges[k].offset, staging.host(k), ranges[k].bytes, k);
    count_transfer(device, Device::cpu(), ranges[k].bytes);
  }
  // Staging's destructor waits for the last copies before the pinned slabs are reused; the
  // values are then in place for every stream.
}

}  // namespace tessera::io
