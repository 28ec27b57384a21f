// DType names and the float <-> 16-bit float conversions (round to nearest even).
#include "core/dtype.hpp"

namespace tessera {

namespace {

uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace

Half::Half(float value) {
  const uint32_t f = float_bits(value);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t abs = f & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN; keep NaN quiet and non-zero
    bits = static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u : 0u));
    return;
  }
  if (abs >= 0x477ff000u) {  // rounds to a value beyond the largest half (65504)
    bits = static_cast<uint16_t>(sign | 0x7c00u);
    return;
  }
  if (abs < 0x38800000u) {  // below the smallest normal half: produce a subnormal or zero
    // Add 0.5 so the float unit does the round-to-nearest-even at the subnormal grid (2^-24).
    const float magnitude = bits_float(abs) + 0.5f;
    bits = static_cast<uint16_t>(sign | (float_bits(magnitude) - 0x3f000000u));
    return;
  }
  const uint32_t mantissa_odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xc8000fffu + mantissa_odd;  // rebias exponent, round
  bits = static_cast<uint16_t>(sign | (rounded >> 13));
}

Half::operator float() const {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: value = mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return bits_float(sign | float_bits(magnitude));
  }
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

BFloat16::BFloat16(float value) {
  const uint32_t f = float_bits(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) {  // NaN: truncate but keep it a quiet NaN
    bits = static_cast<uint16_t>((f >> 16) | 0x0040u);
    return;
  }
  const uint32_t rounding = 0x7fffu + ((f >> 16) & 1u);
  bits = static_cast<uint16_t>((f + rounding) >> 16);
}

BFloat16::operator float() const {
  return bits_float(static_cast<uint32_t>(bits) << 16);
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "unknown";
}

DType dtype_from_name(std::string_view name) {
  for (DType dtype :
       {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8})
    if (dtype_name(dtype) == name) return dtype;
  throw InvalidArgument("dtype", fmt::format("unknown dtype '{}' (expected one of f32, f64, f16, "
                                             "bf16, i32, i64, u8)",
                                             name));
}

}  // namespace tessera
