// Unit tests of the element types: names and sizes, and the float <-> Half / BFloat16
// conversions (round to nearest even, overflow, subnormals, NaN, exhaustive round trips).
#include "core/dtype.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace tessera {
namespace {

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                DType::i32, DType::i64, DType::u8};

uint16_t half_bits(float value) {
  return Half(value).bits;
}
uint16_t bf16_bits(float value) {
  return BFloat16(value).bits;
}

Half half_of_bits(uint16_t bits) {
  Half half;
  half.bits = bits;
  return half;
}

BFloat16 bf16_of_bits(uint16_t bits) {
  BFloat16 value;
  value.bits = bits;
  return value;
}

bool half_is_nan(uint16_t bits) {
  return (bits & 0x7c00u) == 0x7c00u && (bits & 0x03ffu) != 0;
}
bool bf16_is_nan(uint16_t bits) {
  return (bits & 0x7f80u) == 0x7f80u && (bits & 0x007fu) != 0;
}

TEST(DType, NamesRoundTripAndSizesMatchTheCppTypes) {
  for (DType dtype : all_dtypes) {
    EXPECT_EQ(dtype_from_name(dtype_name(dtype)), dtype);
    dispatch_dtype(dtype, [&]<typename T>() {
      EXPECT_EQ(dtype_of<T>(), dtype);
      EXPECT_EQ(dtype_size(dtype), sizeof(T));
    });
  }
  EXPECT_TRUE(is_floating(DType::bf16));
  EXPECT_FALSE(is_floating(DType::u8));
  EXPECT_THROW(dtype_from_name("float32"), InvalidArgument);
}

TEST(Half, ExactValuesConvertExactly) {
  EXPECT_EQ(half_bits(1.0f), 0x3c00);
  EXPECT_EQ(half_bits(-2.0f), 0xc000);
  EXPECT_EQ(half_bits(0.0f), 0x0000);
  EXPECT_EQ(half_bits(-0.0f), 0x8000);
  EXPECT_EQ(half_bits(65504.0f), 0x7bff);               // largest finite half
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(half_bits(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_EQ(static_cast<float>(half_of_bits(0x0001)), std::ldexp(1.0f, -24));
  EXPECT_EQ(static_cast<float>(half_of_bits(0x7bff)), 65504.0f);
  EXPECT_EQ(static_cast<float>(half_of_bits(0x3555)), 0.25f * (1.0f + 0x155 / 1024.0f));
}

TEST(Half, RoundsToNearestEven) {
  const float ulp_at_one = std::ldexp(1.0f, -10);
  EXPECT_EQ(half_bits(1.0f + ulp_at_one / 2), 0x3c00);      // tie -> even (down)
  EXPECT_EQ(half_bits(1.0f + 3 * ulp_at_one / 2), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(half_bits(1.0f + ulp_at_one * 0.51f), 0x3c01);  // above the tie -> up
  EXPECT_EQ(half_bits(65519.0f), 0x7bff);                   // below 65520 stays finite
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -25)), 0x0000);      // half the smallest subnormal: tie
  EXPECT_EQ(half_bits(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 subnormal ulps: tie -> even
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -25) * 1.01f), 0x0001);
  // The largest subnormal plus a bit more than half an ulp becomes the smallest normal.
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26)), 0x0400);
}

TEST(Half, OverflowGivesInfinityAndNaNStaysNaN) {
  EXPECT_EQ(half_bits(65520.0f), 0x7c00);  // the tie above 65504 rounds to infinity
  EXPECT_EQ(half_bits(1e6f), 0x7c00);
  EXPECT_EQ(half_bits(-1e6f), 0xfc00);
  EXPECT_EQ(half_bits(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(half_bits(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(half_is_nan(half_bits(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(half_is_nan(half_bits(-std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(static_cast<float>(half_of_bits(0x7e00))));
  EXPECT_TRUE(std::isinf(static_cast<float>(half_of_bits(0xfc00))));
}

TEST(Half, EveryBitPatternRoundTripsThroughFloat) {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const float widened = half_of_bits(static_cast<uint16_t>(bits));
    const uint16_t back = half_bits(widened);
    if (half_is_nan(static_cast<uint16_t>(bits))) {
      ASSERT_TRUE(std::isnan(widened)) << std::hex << bits;
      ASSERT_TRUE(half_is_nan(back)) << std::hex << bits;
    } else {
      ASSERT_EQ(back, bits) << std::hex << bits;
    }
  }
}

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bf16_bits(-2.0f), 0xc000);
  EXPECT_EQ(bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie -> even (down)
  EXPECT_EQ(bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(bf16_bits(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
  EXPECT_EQ(static_cast<float>(bf16_of_bits(0x3f81)), 1.0f + std::ldexp(1.0f, -7));
  // The largest float is closer to 2^128 than to the largest bfloat16: infinity.
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(bf16_bits(-std::numeric_limits<float>::infinity()), 0xff80);
}

TEST(BFloat16, NaNStaysNaN) {
  EXPECT_TRUE(bf16_is_nan(bf16_bits(std::numeric_limits<float>::quiet_NaN())));
  // A NaN whose payload lies only in the low 16 bits must not truncate to infinity.
  uint32_t low_payload_nan = 0x7f800001u;
  float value;
  std::memcpy(&value, &low_payload_nan, sizeof value);
  EXPECT_TRUE(bf16_is_nan(bf16_bits(value)));
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16_of_bits(0x7fc0))));
}

TEST(BFloat16, EveryBitPatternRoundTripsThroughFloat) {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const float widened = bf16_of_bits(static_cast<uint16_t>(bits));
    const uint16_t back = bf16_bits(widened);
    if (bf16_is_nan(static_cast<uint16_t>(bits))) {
      ASSERT_TRUE(std::isnan(widened)) << std::hex << bits;
      ASSERT_TRUE(bf16_is_nan(back)) << std::hex << bits;
    } else {
      ASSERT_EQ(back, bits) << std::hex << bits;
    }
  }
}

}  // namespace
}  // namespace tessera
