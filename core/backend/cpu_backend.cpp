// The cpu device backend: host memory from the caching host allocator, element loops on the
// calling thread. Strided loops walk the tensors with an odometer over the outer dims and a
// tight loop over the innermost one, after merging dims that are contiguous in every operand.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/backend/strided_plan.hpp"
#include "core/host_allocator.hpp"
#include "core/tensor.hpp"

namespace tessera {

namespace {

template <typename T>
constexpr bool is_half_v = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

/// Arithmetic type of T's elements (float for the 16-bit floats).
template <typename T>
using Arith = std::conditional_t<is_half_v<T>, float, T>;

template <typename T>
T from_double(double value) {
  if constexpr (is_half_v<T>)
    return T(static_cast<float>(value));
  else
    return static_cast<T>(value);
}

/// Calls body(dst_offset, src_offset, count, dst_step, src_step) for every innermost row of
/// a pair of strided arrays of one shape (offsets and steps in elements).
template <typename Body>
void for_each_row(const StridedRef& dst, const StridedRef* src, Body&& body) {
  const MergedDims merged =
      merge_strided_dims(dst.shape, dst.ndim, dst.strides, src ? src->strides : nullptr);
  if (merged.count == 0) return;
  const std::vector<int64_t>& extent = merged.extent;
  const std::vector<int64_t>& dstride = merged.dst_strides;
  const std::vector<int64_t>& sstride = merged.src_strides;
  if (extent.empty()) return body(int64_t{0}, int64_t{0}, int64_t{1}, int64_t{1}, int64_t{1});
  const int dims = static_cast<int>(extent.size());
  std::vector<int64_t> index(dims, 0);
  int64_t rows = 1;
  for (int d = 0; d < dims - 1; ++d) rows *= extent[d];
  int64_t dst_offset = 0, src_offset = 0;
  for (int64_t r = 0; r < rows; ++r) {
    body(dst_offset, src_offset, extent[dims - 1], dstride[dims - 1], sstride[dims - 1]);
    for (int d = dims - 2; d >= 0; --d) {
      dst_offset += dstride[d];
      src_offset += sstride[d];
      if (++index[d] < extent[d]) break;
      dst_offset -= extent[d] * dstride[d];
      src_offset -= extent[d] * sstride[d];
      index[d] = 0;
    }
  }
}

template <typename T>
Arith<T> combine(ReduceOp op, Arith<T> a, Arith<T> b) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return static_cast<Arith<T>>(a + b);
    case ReduceOp::prod: return static_cast<Arith<T>>(a * b);
    case ReduceOp::max: return std::max(a, b);
    case ReduceOp::min: return std::min(a, b);
  }
  return a;
}

class CpuBackend final : public DeviceBackend {
 public:
  std::string name() const override { return "cpu"; }

  void* allocate(size_t bytes, Device, const Stream&, const std::string& op) override {
    return host_allocate(bytes, op);
  }
  void release(void* pointer, size_t bytes, Device, const Stream&) noexcept override {
    host_release(pointer, bytes);
  }
  AllocatorStats allocator_stats(Device) const override { return host_allocator_stats(); }
  void clear_cache(Device) override { host_cache_clear(); }

  void copy(const StridedRef& dst, const StridedRef& src, size_t element_size,
            const Stream&) override {
    copy_strided_host(dst.data, dst.strides, src.data, src.strides, dst.shape, dst.ndim,
                      element_size);
  }

  void fill(const StridedRef& dst, DType dtype, double value, const Stream&) override {
    dispatch_dtype(dtype, [&]<typename T>() {
      const T element = from_double<T>(value);
      T* out = static_cast<T*>(dst.data);
      for_each_row(dst, nullptr,
                   [&](int64_t offset, int64_t, int64_t count, int64_t step, int64_t) {
                     if (step == 1)
                       std::fill(out + offset, out + offset + count, element);
                     else
                       for (int64_t i = 0; i < count; ++i) out[offset + i * step] = element;
                   });
    });
  }

  void accumulate(const StridedRef& dst, const StridedRef& src, DType dtype, ReduceOp op,
                  const Stream&) override {
    dispatch_dtype(dtype, [&]<typename T>() {
      T* out = static_cast<T*>(dst.data);
      const T* in = static_cast<const T*>(src.data);
      for_each_row(dst, &src, [&](int64_t o, int64_t s, int64_t count, int64_t os, int64_t ss) {
        for (int64_t i = 0; i < count; ++i) {
          T& a = out[o + i * os];
          a = T(combine<T>(op, static_cast<Arith<T>>(a), static_cast<Arith<T>>(in[s + i * ss])));
        }
      });
    });
  }

  void scale(const StridedRef& dst, DType dtype, double factor, const Stream&) override {
    dispatch_dtype(dtype, [&]<typename T>() {
      T* out = static_cast<T*>(dst.data);
      for_each_row(dst, nullptr, [&](int64_t o, int64_t, int64_t count, int64_t os, int64_t) {
        for (int64_t i = 0; i < count; ++i) {
          T& a = out[o + i * os];
          if constexpr (is_half_v<T>)
            a = T(static_cast<float>(a) * static_cast<float>(factor));
          else if constexpr (std::is_floating_point_v<T>)
            a = static_cast<T>(a * static_cast<T>(factor));
          else
            a = static_cast<T>(static_cast<double>(a) * factor);
        }
      });
    });
  }

  void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
               const Stream&) override {
    dispatch_dtype(src_dtype, [&]<typename From>() {
      dispatch_dtype(dst_dtype, [&]<typename To>() {
        const From* in = static_cast<const From*>(src);
        To* out = static_cast<To*>(dst);
        for (size_t i = 0; i < count; ++i) {
          if constexpr (is_half_v<To>)
            out[i] = To(static_cast<float>(in[i]));
          else if constexpr (is_half_v<From>)
            out[i] = static_cast<To>(static_cast<float>(in[i]));
          else
            out[i] = static_cast<To>(in[i]);
        }
      });
    });
  }

  double sum(const void* data, size_t count, DType dtype, const Stream&) override {
    return dispatch_dtype(dtype, [&]<typename T>() -> double {
      const T* in = static_cast<const T*>(data);
      double total = 0;
      for (size_t i = 0; i < count; ++i) total += static_cast<double>(static_cast<Arith<T>>(in[i]));
      return total;
    });
  }
};

}  // namespace

DeviceBackend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

DeviceBackend& backend_for(Device device) {
  return device.is_cpu() ? cpu_backend() : cuda_backend();
}

}  // namespace tessera
