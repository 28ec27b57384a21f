// DeviceBackend: the one interface through which core moves and combines elements on a device
// kind (cpu or cuda). Layers above call backend_for(tensor.device()) and never branch on the
// device kind themselves. Pointers are the device's memory; strides and shapes are in elements.
// On cuda every call is queued on `stream` (asynchronous: the caller orders and synchronizes
// through core/runtime/rank_context.hpp); on cpu the work runs inline and `stream` is ignored.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/device.hpp"
#include "core/dtype.hpp"
#include "core/layout.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera {

/// An N-d strided array of elements at `data`: the common argument of backend calls.
struct StridedRef {
  void* data = nullptr;
  const int64_t* shape = nullptr;
  const int64_t* strides = nullptr;  ///< in elements
  int ndim = 0;
};

/// Memory statistics of one device's allocator (bytes).
struct AllocatorStats {
  size_t in_use = 0;       ///< handed out and not yet released
  size_t peak_in_use = 0;  ///< largest in_use so far
  size_t cached = 0;       ///< released, kept for reuse
  size_t limit = 0;        ///< most bytes the cache keeps (0: no cache)
  uint64_t raw_allocations =
      0;  ///< calls that reached the system allocator (cudaMalloc/aligned_alloc)
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  /// "cpu" or "cuda".
  virtual std::string name() const = 0;

  /// `bytes` of uninitialised memory on `device`, usable on `stream` at once and on other
  /// streams after they are ordered after it. `op` tags an out-of-memory error.
  virtual void* allocate(size_t bytes, Device device, const Stream& stream,
                         const std::string& op) = 0;
  /// Returns memory from allocate (same bytes, device and stream it was last used on).
  virtual void release(void* pointer, size_t bytes, Device device,
                       const Stream& stream) noexcept = 0;
  /// The allocator's statistics for `device`.
  virtual AllocatorStats allocator_stats(Device device) const = 0;
  /// Frees every cached block of `device`.
  virtual void clear_cache(Device device) = 0;

  /// dst = src elementwise (same shape; elements of `element_size` bytes).
  virtual void copy(const StridedRef& dst, const StridedRef& src, size_t element_size,
                    const Stream& stream) = 0;
  /// Every element of dst set to `value` converted to `dtype`.
  virtual void fill(const StridedRef& dst, DType dtype, double value, const Stream& stream) = 0;
  /// dst = op(dst, src) elementwise (sum, max, min, prod; avg accumulates like sum).
  virtual void accumulate(const StridedRef& dst, const StridedRef& src, DType dtype, ReduceOp op,
                          const Stream& stream) = 0;
  /// dst = factor * dst elementwise (floating dtypes; integer dtypes round toward zero).
  virtual void scale(const StridedRef& dst, DType dtype, double factor, const Stream& stream) = 0;
  /// dst[i] = dtype_to(src[i]) elementwise (contiguous, `count` elements).
  virtual void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                       const Stream& stream) = 0;
  /// Sum of every element of a contiguous array of `count` elements, accumulated in double
  /// (f64) in a fixed order that does not depend on the thread count; the result is read back
  /// to the host (synchronizes `stream`).
  virtual double sum(const void* data, size_t count, DType dtype, const Stream& stream) = 0;
};

/// The backend of `device`'s kind (the cuda backend throws NotAvailable in a build without CUDA).
DeviceBackend& backend_for(Device device);

/// The cpu backend (always present).
DeviceBackend& cpu_backend();
/// The cuda backend (core/backend/cuda/; a stub that throws NotAvailable without CUDA).
DeviceBackend& cuda_backend();

}  // namespace tessera
