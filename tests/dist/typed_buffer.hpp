// Typed element buffers for the Comm tests: a byte buffer of `count` elements of a run-time
// dtype, written and read as doubles, and an encoding of (sender, receiver, index) into values
// that every dtype holds exactly, so a misplaced element is detected on any dtype.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/dtype.hpp"

namespace tessera::testing {

/// `count` elements of `dtype`, zero-initialised (size() is at least 1 byte, so data() is never
/// null and a zero count still passes a real pointer).
class TypedBuffer {
 public:
  TypedBuffer(DType dtype, size_t count)
      : dtype_(dtype), count_(count), bytes_(std::max<size_t>(count * dtype_size(dtype), 1)) {}

  DType dtype() const { return dtype_; }
  size_t count() const { return count_; }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }

  /// Element `i` as a double.
  double get(size_t i) const {
    return dispatch_dtype(dtype_, [&]<typename T>() -> double {
      const T element = reinterpret_cast<const T*>(bytes_.data())[i];
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
        return static_cast<float>(element);
      else
        return static_cast<double>(element);
    });
  }

  /// Sets element `i` to `value` (converted to the dtype).
  void set(size_t i, double value) {
    dispatch_dtype(dtype_, [&]<typename T>() {
      T* elements = reinterpret_cast<T*>(bytes_.data());
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
        elements[i] = T(static_cast<float>(value));
      else
        elements[i] = static_cast<T>(value);
    });
  }

 private:
  DType dtype_;
  size_t count_;
  std::vector<std::byte> bytes_;
};

/// Largest integer range [0, modulus) that `dtype` holds exactly (and that fits u8).
inline int64_t exact_modulus(DType dtype) {
  switch (dtype) {
    case DType::u8:
    case DType::bf16: return 256;
    case DType::f16: return 2048;
    default: return int64_t{1} << 20;
  }
}

/// A value identifying (a, b, index) that `dtype` represents exactly.
inline double encode(DType dtype, int64_t a, int64_t b, int64_t index) {
  return static_cast<double>((a * 7919 + b * 104729 + index * 31 + 1) % exact_modulus(dtype));
}

}  // namespace tessera::testing
