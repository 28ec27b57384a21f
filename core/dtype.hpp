// Element types of Tensor: the DType enum, the 16-bit float storage types, and a dispatcher
// that turns a run-time DType into a compile-time C++ type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/errors.hpp"

namespace tessera {

/// Element type of a tensor.
enum class DType : uint8_t { f32, f64, f16, bf16, i32, i64, u8 };

/// IEEE-754 binary16, stored as its bit pattern; arithmetic goes through float.
struct Half {
  uint16_t bits = 0;
  Half() = default;
  /// Rounds to nearest even; overflow gives infinity, NaN stays NaN.
  explicit Half(float value);
  /// Exact widening conversion.
  operator float() const;
};

/// bfloat16 (the top half of an IEEE-754 binary32), stored as its bit pattern.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  /// Rounds to nearest even; NaN stays NaN.
  explicit BFloat16(float value);
  /// Exact widening conversion.
  operator float() const;
};

/// Bytes of one element of `dtype`.
constexpr size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f64:
    case DType::i64: return 8;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f16:
    case DType::bf16: return 2;
    case DType::u8: return 1;
  }
  return 0;
}

/// Short name ("f32", "bf16", ...) used in messages, files and the CLI.
std::string_view dtype_name(DType dtype);

/// Parses a name produced by dtype_name; throws InvalidArgument otherwise.
DType dtype_from_name(std::string_view name);

/// True for f32, f64, f16, bf16.
constexpr bool is_floating(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 || dtype == DType::bf16;
}

/// The DType of a C++ element type.
template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}
template <>
constexpr DType dtype_of<Half>() {
  return DType::f16;
}
template <>
constexpr DType dtype_of<BFloat16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::u8;
}

/// Calls `fn.template operator()<T>()` with T the C++ type of `dtype`.
template <typename Fn>
decltype(auto) dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32: return fn.template operator()<float>();
    case DType::f64: return fn.template operator()<double>();
    case DType::f16: return fn.template operator()<Half>();
    case DType::bf16: return fn.template operator()<BFloat16>();
    case DType::i32: return fn.template operator()<int32_t>();
    case DType::i64: return fn.template operator()<int64_t>();
    case DType::u8: return fn.template operator()<uint8_t>();
  }
  throw InvalidArgument("dtype", fmt::format("unknown dtype code {}", static_cast<int>(dtype)));
}

}  // namespace tessera
