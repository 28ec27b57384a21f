// Unit tests of the overflow-checked size arithmetic (core/checked_math.hpp) and of what rests on
// it: Tensor::empty refuses shapes whose element or byte count overflows, and the host
// allocator refuses requests past its limit with OutOfMemory, all before anything is allocated.
#include "core/checked_math.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "core/errors.hpp"
#include "core/host_allocator.hpp"
#include "core/layout.hpp"
#include "core/tensor.hpp"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

/// The message of the InvalidArgument `action` throws ("" when it throws none).
template <typename Action>
std::string invalid_argument_of(Action&& action) {
  try {
    action();
  } catch (const InvalidArgument& error) {
    return error.what();
  }
  return "";
}

TEST(CheckedMath, MulAndAddReturnExactResultsWithinTheLimit) {
  EXPECT_EQ(checked_mul(0, kInt64Max, "op", "size"), 0);
  EXPECT_EQ(checked_mul(int64_t{1} << 31, int64_t{1} << 31, "op", "size"), int64_t{1} << 62);
  EXPECT_EQ(checked_add(kMaxTensorSize - 1, 1, "op", "size"), kMaxTensorSize);
  EXPECT_EQ(checked_add(-5, 3, "op", "size"), -2);
}

TEST(CheckedMath, MulPastTheLimitNamesOpValuesAndLimit) {
  const std::string message = invalid_argument_of(
      [] { checked_mul(int64_t{1} << 32, int64_t{1} << 32, "conv", "padded extent"); });
  EXPECT_THAT(message, HasSubstr("[conv] padded extent 4294967296 x 4294967296"));
  EXPECT_THAT(message, HasSubstr("exceeds the limit of 4611686018427387904"));
  // Wrapping products (past int64) are caught too, not only those past the limit.
  EXPECT_THAT(invalid_argument_of([] { checked_mul(kInt64Max, 3, "op", "size"); }),
              HasSubstr("exceeds the limit"));
  EXPECT_THAT(invalid_argument_of([] { checked_mul(-1, 3, "op", "size"); }),
              HasSubstr("negative factor"));
}

TEST(CheckedMath, AddPastTheLimitInEitherDirectionThrows) {
  EXPECT_THAT(invalid_argument_of([] { checked_add(kInt64Max, 1, "halo", "box end"); }),
              HasSubstr("[halo] box end 9223372036854775807 + 1"));
  EXPECT_THAT(invalid_argument_of([] { checked_add(-kMaxTensorSize, -1, "op", "offset"); }),
              HasSubstr("exceeds the limit"));
}

TEST(CheckedMath, NumelOfHugeShapesThrowsNamingTheShape) {
  EXPECT_EQ(checked_numel(std::vector<int64_t>{}, "op"), 1);
  EXPECT_EQ(checked_numel(std::vector<int64_t>{3, 4, 5}, "op"), 60);
  // An empty shape is fine however large the other extents are.
  EXPECT_EQ(checked_numel(std::vector<int64_t>{0, kInt64Max, kInt64Max}, "op"), 0);
  // The shapes of `tessera demo --shape ...` that used to wrap around.
  const std::string message = invalid_argument_of([] {
    checked_numel(std::vector<int64_t>{16, 288230376151711745, 1}, "demo", "--shape");
  });
  EXPECT_THAT(message, HasSubstr("[demo] --shape [16, 288230376151711745, 1] holds"));
  EXPECT_THAT(message, HasSubstr("more than the limit of 4611686018427387904"));
  EXPECT_THAT(invalid_argument_of([] {
                checked_numel(std::vector<int64_t>{4294967296, 4294967296, 4}, "demo");
              }),
              HasSubstr("more than the limit"));
  EXPECT_THAT(invalid_argument_of([] {
                checked_numel(std::vector<int64_t>{3, -1}, "op");
              }),
              HasSubstr("negative extent"));
}

TEST(CheckedMath, BytesPastTheLimitThrow) {
  EXPECT_EQ(checked_bytes(10, 8, "op"), size_t{80});
  EXPECT_THAT(invalid_argument_of([] { checked_bytes(int64_t{1} << 62, 4, "op", "f32 tensor"); }),
              HasSubstr("[op] f32 tensor: 4611686018427387904 elements x 4 bytes"));
  EXPECT_THAT(
      invalid_argument_of([] {
        checked_tensor_bytes(std::vector<int64_t>{2147483648, 2147483648, 1}, 4, "f32", "tensor");
      }),
      HasSubstr("[tensor] f32 tensor [2147483648, 2147483648, 1]"));
}

TEST(CheckedMathTensor, EmptyRefusesShapesWhoseSizeOverflows) {
  // Each of these used to wrap to a small allocation that was then written past.
  const std::vector<Shape> shapes{{16, 288230376151711745, 1},
                                  {2147483648, 2147483648, 1},
                                  {4294967296, 4294967296, 4},
                                  {kInt64Max, 2}};
  for (const Shape& shape : shapes)
    EXPECT_THAT(invalid_argument_of([&] { Tensor::empty(shape, DType::f32); }),
                HasSubstr("[tensor]"))
        << fmt::format("{}", shape);
  EXPECT_THAT(invalid_argument_of([] {
                shape_numel({int64_t{1} << 40, int64_t{1} << 40});
              }),
              HasSubstr("more than the limit"));
}

TEST(CheckedMathTensor, AllocationPastTheMemoryLimitRaisesOutOfMemoryNotBadAlloc) {
  // 2^61 bytes: no overflow, but far more than any machine's memory.
  const Shape shape{int64_t{1} << 58};
  try {
    Tensor::empty(shape, DType::f64);
    FAIL() << "a 2^61-byte tensor was allocated";
  } catch (const OutOfMemory& error) {
    EXPECT_THAT(error.what(), HasSubstr("[tensor] out of memory: asked 2305843009213693952 bytes"));
    EXPECT_THAT(error.what(), HasSubstr("host memory limit"));
  } catch (const std::bad_alloc&) {
    FAIL() << "std::bad_alloc instead of OutOfMemory";
  }
  EXPECT_GT(host_memory_limit(), size_t{0});
  try {
    host_allocate(host_memory_limit() + 1, "conv");
    FAIL() << "an allocation past the limit succeeded";
  } catch (const OutOfMemory& error) {
    EXPECT_THAT(error.what(), HasSubstr("[conv] out of memory: asked"));
  }
}

TEST(CheckedMathLayout, ExtentsWhoseSumWrapsToTheGlobalExtentAreRefused) {
  // (2^63 - 1) + (2^63 - 1) + 11 wraps to 9 in int64: without checked sums these extents would
  // pass as a split of 9 elements.
  const std::vector<std::vector<int64_t>> extents{{kInt64Max, kInt64Max, 11}};
  EXPECT_THAT(invalid_argument_of([&] {
                ShardSpec::make({9}, {3}, {Placement::shard(0)}, extents, "redistribute");
              }),
              HasSubstr("[redistribute] sum of extents"));
}

}  // namespace
}  // namespace tessera
