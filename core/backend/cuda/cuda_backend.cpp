// The cuda DeviceBackend: device memory from one CachingAllocator per device (cudaMalloc and
// cudaFree underneath, cudaEvent hooks ordering reuse between streams) and elementwise work as
// kernels queued on the caller's stream. Nothing here synchronizes the device; only sum waits,
// for its own stream, to read the result back. Like the runtime wrappers, every call makes the
// device of its stream current first (gpu::set_device).
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/backend/caching_allocator.hpp"
#include "core/backend/cuda/backend_kernels.cuh"
#include "core/backend/strided_plan.hpp"
#include "core/cuda/check.hpp"
#include "core/cuda/strided_copy.cuh"
#include "core/dtype.hpp"

namespace tessera {

namespace {

static_assert(kMaxKernelDims == gpu::kernels::kMaxBackendDims);
static_assert(kMaxKernelDims <= gpu::kernels::kMaxStridedDims);
static_assert(static_cast<int>(DType::u8) == static_cast<int>(gpu::kernels::ElementKind::u8) &&
              static_cast<int>(DType::bf16) == static_cast<int>(gpu::kernels::ElementKind::bf16));

/// Reusable events of one device (recording an event is cheap, creating one is not).
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  gpu::EventHandle take() {
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        gpu::EventHandle event = free_.back();
        free_.pop_back();
        return event;
      }
    }
    return gpu::create_event(device_);
  }
  void give_back(gpu::EventHandle event) {
    std::lock_guard lock(mutex_);
    free_.push_back(event);
  }

 private:
  int device_;
  std::mutex mutex_;
  std::vector<gpu::EventHandle> free_;
};

/// The raw source of device `device`'s allocator: cudaMalloc/cudaFree (through the runtime
/// wrappers, which make `device` current first) and pooled events.
RawDeviceSource cuda_source(int device) {
  auto events = std::make_shared<EventPool>(device);
  RawDeviceSource source;
  source.allocate = [device](size_t bytes) { return gpu::allocate(bytes, device); };
  source.release = [device](void* pointer) { gpu::release(pointer, device); };  // waits for users
  source.record = [device, events](void* stream) -> void* {
    gpu::EventHandle event = events->take();
    try {
      gpu::set_device(device);
      gpu::record_event(event, stream, device);
    } catch (...) {
      events->give_back(event);
      throw;
    }
    return event;
  };
  source.done = [device](void* event) { return gpu::event_done(event, device); };
  source.forget = [events](void* event) { events->give_back(event); };
  return source;
}

gpu::kernels::ElementKind element_kind(DType dtype) {
  return static_cast<gpu::kernels::ElementKind>(static_cast<int>(dtype));
}

gpu::kernels::StridedLayout layout_of(const StridedPlan& plan) {
  gpu::kernels::StridedLayout layout;
  layout.ndim = plan.ndim;
  layout.count = plan.count;
  for (int d = 0; d < plan.ndim; ++d) {
    layout.shape[d] = plan.shape[d];
    layout.dst_strides[d] = plan.dst_strides[d];
    layout.src_strides[d] = plan.src_strides[d];
  }
  return layout;
}

/// The bit pattern of `value` as one element of `dtype`, converted as the cpu backend does.
uint64_t element_bits(DType dtype, double value) {
  uint64_t bits = 0;
  dispatch_dtype(dtype, [&]<typename T>() {
    T element;
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
      element = T(static_cast<float>(value));
    else
      element = static_cast<T>(value);
    std::memcpy(&bits, &element, sizeof element);
  });
  return bits;
}

class CudaBackend final : public DeviceBackend {
 public:
  std::string name() const override { return "cuda"; }

  void* allocate(size_t bytes, Device device, const Stream& stream,
                 const std::string& op) override {
    check_cuda(device, op);
    // The release event is recorded on the stream, which must belong to the same device.
    TESSERA_CHECK_ARG(stream.handle == nullptr || stream.device == device, op,
                      "allocation on {} ordered on a stream of {}", device.str(),
                      stream.device.str());
    return allocator(device.index).allocate(bytes, stream.handle, op);
  }

  void release(void* pointer, size_t, Device device, const Stream& stream) noexcept override {
    if (!pointer || !device.is_cuda() || device.index < 0 || device.index >= kMaxDevices) return;
    CachingAllocator* existing = allocators_[device.index].load(std::memory_order_acquire);
    if (existing) existing->release(pointer, stream.handle);
  }

  AllocatorStats allocator_stats(Device device) const override {
    check_cuda(device, "allocator");
    const CachingAllocator* existing = allocators_[device.index].load(std::memory_order_acquire);
    if (existing) return existing->stats();
    return {};
  }

  void clear_cache(Device device) override {
    check_cuda(device, "allocator");
    if (CachingAllocator* existing = allocators_[device.index].load(std::memory_order_acquire))
      existing->clear_cache();
  }

  void copy(const StridedRef& dst, const StridedRef& src, size_t element_size,
            const Stream& stream) override {
    const int device = stream_device(stream, "copy");
    check_arg(dst.ndim == src.ndim, "copy", "{}-d destination, {}-d source", dst.ndim, src.ndim);
    for (int d = 0; d < dst.ndim; ++d)
      check_arg(dst.shape[d] == src.shape[d], "copy", "extent {} of dim {} copied into {}",
                src.shape[d], d, dst.shape[d]);
    const StridedPlan plan = merge_dims(dst.shape, dst.ndim, dst.strides, src.strides, "copy");
    if (plan.count == 0) return;
    gpu::set_device(device);
    const auto cuda_stream = static_cast<cudaStream_t>(stream.handle);
    if (is_dense(plan)) {
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, plan.count * element_size,
                                         cudaMemcpyDefault, cuda_stream),
                         device);
      return;
    }
    const size_t word = copy_word_bytes(plan, element_size, reinterpret_cast<uintptr_t>(dst.data),
                                        reinterpret_cast<uintptr_t>(src.data));
    const StridedPlan words = in_words(plan, element_size, word);
    TESSERA_CUDA_CHECK(gpu::kernels::launch_strided_copy(
                           dst.data, words.dst_strides.data(), src.data, words.src_strides.data(),
                           words.shape.data(), words.ndim, word, cuda_stream),
                       device);
  }

  void fill(const StridedRef& dst, DType dtype, double value, const Stream& stream) override {
    const int device = stream_device(stream, "fill");
    const StridedPlan plan = merge_dims(dst.shape, dst.ndim, dst.strides, dst.strides, "fill");
    if (plan.count == 0) return;
    const size_t element_size = dtype_size(dtype);
    const uint64_t bits = element_bits(dtype, value);
    gpu::set_device(device);
    const auto cuda_stream = static_cast<cudaStream_t>(stream.handle);
    if (bits == 0 && is_dense(plan)) {
      TESSERA_CUDA_CHECK(cudaMemsetAsync(dst.data, 0, plan.count * element_size, cuda_stream),
                         device);
      return;
    }
    // Rows contiguous in dst are written in the widest word that fits, the element's bytes
    // repeated across it.
    const auto address = reinterpret_cast<uintptr_t>(dst.data);
    const size_t word = copy_word_bytes(plan, element_size, address, address);
    std::array<unsigned char, 16> repeated{};
    for (size_t offset = 0; offset < word; offset += element_size)
      std::memcpy(repeated.data() + offset, &bits, element_size);
    uint64_t pattern[2];
    std::memcpy(pattern, repeated.data(), sizeof pattern);
    const StridedPlan words = in_words(plan, element_size, word);
    TESSERA_CUDA_CHECK(
        gpu::kernels::launch_fill(dst.data, layout_of(words), word, pattern, cuda_stream), device);
  }

  void accumulate(const StridedRef& dst, const StridedRef& src, DType dtype, ReduceOp op,
                  const Stream& stream) override {
    const int device = stream_device(stream, "accumulate");
    check_arg(dst.ndim == src.ndim, "accumulate", "{}-d destination, {}-d source", dst.ndim,
              src.ndim);
    for (int d = 0; d < dst.ndim; ++d)
      check_arg(dst.shape[d] == src.shape[d], "accumulate", "extent {} of dim {} added into {}",
                src.shape[d], d, dst.shape[d]);
    const StridedPlan plan =
        merge_dims(dst.shape, dst.ndim, dst.strides, src.strides, "accumulate");
    if (plan.count == 0) return;
    gpu::kernels::CombineKind combine = gpu::kernels::CombineKind::sum;
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: combine = gpu::kernels::CombineKind::sum; break;
      case ReduceOp::max: combine = gpu::kernels::CombineKind::max; break;
      case ReduceOp::min: combine = gpu::kernels::CombineKind::min; break;
      case ReduceOp::prod: combine = gpu::kernels::CombineKind::prod; break;
    }
    gpu::set_device(device);
    TESSERA_CUDA_CHECK(
        gpu::kernels::launch_accumulate(dst.data, src.data, layout_of(plan), element_kind(dtype),
                                        combine, static_cast<cudaStream_t>(stream.handle)),
        device);
  }

  void scale(const StridedRef& dst, DType dtype, double factor, const Stream& stream) override {
    const int device = stream_device(stream, "scale");
    const StridedPlan plan = merge_dims(dst.shape, dst.ndim, dst.strides, nullptr, "scale");
    if (plan.count == 0) return;
    gpu::set_device(device);
    TESSERA_CUDA_CHECK(gpu::kernels::launch_scale(dst.data, layout_of(plan), element_kind(dtype),
                                                  factor, static_cast<cudaStream_t>(stream.handle)),
                       device);
  }

  void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
               const Stream& stream) override {
    const int device = stream_device(stream, "convert");
    if (count == 0) return;
    gpu::set_device(device);
    const auto cuda_stream = static_cast<cudaStream_t>(stream.handle);
    if (dst_dtype == src_dtype) {
      TESSERA_CUDA_CHECK(
          cudaMemcpyAsync(dst, src, count * dtype_size(dst_dtype), cudaMemcpyDefault, cuda_stream),
          device);
      return;
    }
    TESSERA_CUDA_CHECK(
        gpu::kernels::launch_convert(dst, element_kind(dst_dtype), src, element_kind(src_dtype),
                                     static_cast<int64_t>(count), cuda_stream),
        device);
  }

  double sum(const void* data, size_t count, DType dtype, const Stream& stream) override {
    const int device = stream_device(stream, "sum");
    if (count == 0) return 0.0;
    const int partials = sum_partial_count(static_cast<int64_t>(count));
    const Device where = Device::cuda(device);
    auto* workspace =
        static_cast<double*>(allocate(sizeof(double) * (partials + 1), where, stream, "sum"));
    double result = 0.0;
    try {
      gpu::set_device(device);
      const auto cuda_stream = static_cast<cudaStream_t>(stream.handle);
      TESSERA_CUDA_CHECK(
          gpu::kernels::launch_sum(data, static_cast<int64_t>(count), element_kind(dtype), partials,
                                   kSumThreads, workspace, cuda_stream),
          device);
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(&result, workspace + partials, sizeof result,
                                         cudaMemcpyDeviceToHost, cuda_stream),
                         device);
      gpu::synchronize_stream(stream.handle, device);
    } catch (...) {
      release(workspace, sizeof(double) * (partials + 1), where, stream);
      throw;
    }
    release(workspace, sizeof(double) * (partials + 1), where, stream);
    return result;
  }

 private:
  static constexpr int kMaxDevices = 64;

  static void check_cuda(Device device, const std::string& op) {
    TESSERA_CHECK_ARG(device.is_cuda(), op, "the cuda backend was given a {} device", device.str());
    check_arg(device.index >= 0 && device.index < kMaxDevices, op, "device index {} (at most {})",
              device.index, kMaxDevices - 1);
  }

  /// The device `stream` belongs to (the device every pointer of the call lives on).
  static int stream_device(const Stream& stream, const std::string& op) {
    TESSERA_CHECK_ARG(stream.device.is_cuda(), op, "the cuda backend was given a {} stream",
                      stream.device.str());
    return stream.device.index;
  }

  /// The allocator of `device`, created on first use (limit from TESSERA_DEVICE_CACHE_MB).
  CachingAllocator& allocator(int device) {
    if (CachingAllocator* existing = allocators_[device].load(std::memory_order_acquire))
      return *existing;
    std::lock_guard lock(create_mutex_);
    if (CachingAllocator* existing = allocators_[device].load(std::memory_order_acquire))
      return *existing;
    size_t free_bytes = 0, total_bytes = 0;
    gpu::memory_info(device, &free_bytes, &total_bytes);
    const char* setting = std::getenv("TESSERA_DEVICE_CACHE_MB");
    const size_t limit = device_cache_limit(setting, total_bytes);
    const std::string described = (setting && *setting)
                                      ? fmt::format("TESSERA_DEVICE_CACHE_MB={}", setting)
                                      : std::string("TESSERA_DEVICE_CACHE_MB unset");
    // Never destroyed: blocks may be released while static objects are torn down at exit.
    auto* created =
        new CachingAllocator(cuda_source(device), Device::cuda(device).str(), limit, described);
    allocators_[device].store(created, std::memory_order_release);
    return *created;
  }

  std::mutex create_mutex_;
  std::array<std::atomic<CachingAllocator*>, kMaxDevices> allocators_{};
};

}  // namespace

DeviceBackend& cuda_backend() {
  static CudaBackend* backend = new CudaBackend;  // never destroyed (see allocator())
  return *backend;
}

}  // namespace tessera
