// Unit tests of the host-side preparation of device kernel arguments: dim merging, the copy
// word width and the fixed block count of the deterministic sum.
#include "core/backend/strided_plan.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "core/errors.hpp"

namespace tessera {
namespace {

std::vector<int64_t> shape_of(const StridedPlan& plan) {
  return {plan.shape.begin(), plan.shape.begin() + plan.ndim};
}
std::vector<int64_t> dst_strides_of(const StridedPlan& plan) {
  return {plan.dst_strides.begin(), plan.dst_strides.begin() + plan.ndim};
}
std::vector<int64_t> src_strides_of(const StridedPlan& plan) {
  return {plan.src_strides.begin(), plan.src_strides.begin() + plan.ndim};
}

TEST(MergeDims, ContiguousArraysBecomeOneDim) {
  const int64_t shape[] = {2, 3, 4};
  const int64_t strides[] = {12, 4, 1};
  const StridedPlan plan = merge_dims(shape, 3, strides, strides, "test");
  EXPECT_EQ(shape_of(plan), std::vector<int64_t>{24});
  EXPECT_EQ(plan.count, 24);
  EXPECT_TRUE(is_dense(plan));
}

TEST(MergeDims, KeepsDimsThatAreNotContiguousInEveryOperand) {
  // dst is a box [2,3,4] inside a [2,5,4] array; src is dense.
  const int64_t shape[] = {2, 3, 4};
  const int64_t dst_strides[] = {20, 4, 1};
  const int64_t src_strides[] = {12, 4, 1};
  const StridedPlan plan = merge_dims(shape, 3, dst_strides, src_strides, "test");
  EXPECT_EQ(shape_of(plan), (std::vector<int64_t>{2, 12}));
  EXPECT_EQ(dst_strides_of(plan), (std::vector<int64_t>{20, 1}));
  EXPECT_EQ(src_strides_of(plan), (std::vector<int64_t>{12, 1}));
  EXPECT_FALSE(is_dense(plan));
}

TEST(MergeDims, DropsUnitDimsWhateverTheirStride) {
  const int64_t shape[] = {1, 5, 1, 3};
  const int64_t dst_strides[] = {999, 3, 7, 1};
  const int64_t src_strides[] = {0, 3, 0, 1};
  const StridedPlan plan = merge_dims(shape, 4, dst_strides, src_strides, "test");
  EXPECT_EQ(shape_of(plan), std::vector<int64_t>{15});
  EXPECT_TRUE(is_dense(plan));
}

TEST(MergeDims, TransposeStaysTwoDims) {
  const int64_t shape[] = {3, 4};
  const int64_t dst_strides[] = {4, 1};
  const int64_t src_strides[] = {1, 3};
  const StridedPlan plan = merge_dims(shape, 2, dst_strides, src_strides, "test");
  EXPECT_EQ(plan.ndim, 2);
  EXPECT_EQ(src_strides_of(plan), (std::vector<int64_t>{1, 3}));
}

TEST(MergeDims, EmptyAndScalarArrays) {
  const int64_t empty_shape[] = {3, 0};
  const int64_t strides[] = {1, 1};
  EXPECT_EQ(merge_dims(empty_shape, 2, strides, strides, "test").count, 0);
  const StridedPlan scalar = merge_dims(nullptr, 0, nullptr, nullptr, "test");
  EXPECT_EQ(scalar.count, 1);
  EXPECT_EQ(scalar.ndim, 0);
  EXPECT_TRUE(is_dense(scalar));
}

TEST(StridedCopyRuns, OneMemcpyPerRunAsCopyStridedHostMakesThem) {
  // A [4, 6, 8] box of a [4, 10, 8] array to a dense buffer: rows of 6 * 8 elements, 4 runs.
  const int64_t shape[] = {4, 6, 8};
  const int64_t array[] = {80, 8, 1};
  EXPECT_EQ(strided_copy_runs(shape, 3, nullptr, array), 4);
  EXPECT_EQ(strided_copy_runs(shape, 3, array, nullptr), 4);  // unpacking: the same runs
  // A [4, 10, 3] face of a [4, 10, 8] array: 40 runs of 3 elements.
  const int64_t face[] = {4, 10, 3};
  EXPECT_EQ(strided_copy_runs(face, 3, nullptr, array), 40);
  // The last dim strided (a face across the innermost dim of a transpose): one run per element.
  const int64_t column[] = {1, 5};
  const int64_t transposed[] = {1, 7};
  EXPECT_EQ(strided_copy_runs(column, 2, nullptr, transposed), 5);
  // Dense on both sides: one run; no elements: none; a scalar: one.
  const int64_t dense[] = {4, 6, 8};
  EXPECT_EQ(strided_copy_runs(dense, 3, nullptr, nullptr), 1);
  const int64_t empty[] = {4, 0, 8};
  EXPECT_EQ(strided_copy_runs(empty, 3, nullptr, array), 0);
  EXPECT_EQ(strided_copy_runs(nullptr, 0, nullptr, nullptr), 1);
  // Both sides strided differently: runs where neither side breaks the row.
  const int64_t other[] = {120, 12, 1};
  EXPECT_EQ(strided_copy_runs(shape, 3, other, array), 24);
}

TEST(MergeDims, SingleOperandMergesOnDstOnly) {
  const int64_t shape[] = {4, 6};
  const int64_t strides[] = {6, 1};
  const StridedPlan plan = merge_dims(shape, 2, strides, nullptr, "test");
  EXPECT_EQ(shape_of(plan), std::vector<int64_t>{24});
}

TEST(MergeDims, TooManyUnmergeableDimsIsAnError) {
  std::vector<int64_t> shape(9, 2), dst_strides(9), src_strides(9);
  for (int d = 0; d < 9; ++d) {
    dst_strides[d] = int64_t{1} << (2 * (8 - d));  // gaps between every pair of dims
    src_strides[d] = int64_t{1} << (8 - d);
  }
  EXPECT_THROW(merge_dims(shape.data(), 9, dst_strides.data(), src_strides.data(), "pack"),
               InvalidArgument);
}

TEST(MergeStridedDims, HostLoopsSeeTheSameMergedDimsWithoutALimit) {
  // A [2, 3, 8, 5] box of a [4, 6, 8, 10] tensor copied into a dense tensor: dims 1 and 2 merge
  // (contiguous in both), dim 0 and the inner dim stay.
  const int64_t shape[] = {2, 3, 8, 5};
  const int64_t src[] = {480, 80, 10, 1}, dst[] = {120, 40, 5, 1};
  const MergedDims merged = merge_strided_dims(shape, 4, dst, src);
  EXPECT_EQ(merged.count, 240);
  EXPECT_EQ(merged.extent, (std::vector<int64_t>{2, 24, 5}));
  EXPECT_EQ(merged.dst_strides, (std::vector<int64_t>{120, 5, 1}));
  EXPECT_EQ(merged.src_strides, (std::vector<int64_t>{480, 10, 1}));
  // More unmergeable dims than a device kernel takes: fine on the host.
  std::vector<int64_t> many(12, 2), strides(12);
  for (int d = 0; d < 12; ++d) strides[d] = int64_t{1} << (2 * (11 - d));
  EXPECT_EQ(merge_strided_dims(many.data(), 12, strides.data(), nullptr).extent.size(), 12u);
  // No source: its strides are 0 (the dense dst is one run). An empty array keeps no dims.
  const MergedDims single = merge_strided_dims(shape, 4, dst, nullptr);
  EXPECT_EQ(single.extent, (std::vector<int64_t>{240}));
  EXPECT_EQ(single.src_strides, (std::vector<int64_t>{0}));
  const int64_t empty[] = {3, 0, 2};
  EXPECT_EQ(merge_strided_dims(empty, 3, src, src).count, 0);
  EXPECT_TRUE(merge_strided_dims(empty, 3, src, src).extent.empty());
}

TEST(CopyWordBytes, WidestWordThatDividesRowsStridesAndAddresses) {
  const int64_t shape[] = {8, 32};
  const int64_t dst_strides[] = {64, 1};
  const int64_t src_strides[] = {32, 1};
  const StridedPlan plan = merge_dims(shape, 2, dst_strides, src_strides, "test");
  EXPECT_EQ(copy_word_bytes(plan, 4, 0x1000, 0x2000), 16u);
  EXPECT_EQ(copy_word_bytes(plan, 4, 0x1008, 0x2000), 8u);  // dst aligned to 8 only
  EXPECT_EQ(copy_word_bytes(plan, 4, 0x1004, 0x2000), 4u);
  EXPECT_EQ(copy_word_bytes(plan, 2, 0x1000, 0x2002), 2u);
  EXPECT_EQ(copy_word_bytes(plan, 8, 0x1000, 0x2000), 16u);
}

TEST(CopyWordBytes, RowLengthAndOuterStridesLimitTheWord) {
  const int64_t shape[] = {8, 6};  // rows of 24 bytes in f32: 8-byte words
  const int64_t strides[] = {10, 1};
  const StridedPlan plan = merge_dims(shape, 2, strides, strides, "test");
  EXPECT_EQ(copy_word_bytes(plan, 4, 0, 0), 8u);
  const int64_t odd_strides[] = {7, 1};  // rows start 28 bytes apart: 4-byte words
  const StridedPlan odd = merge_dims(shape, 2, odd_strides, strides, "test");
  EXPECT_EQ(copy_word_bytes(odd, 4, 0, 0), 4u);
}

TEST(CopyWordBytes, NoWideWordsWhenTheInnerDimIsStrided) {
  const int64_t shape[] = {8, 8};
  const int64_t dst_strides[] = {8, 1};
  const int64_t src_strides[] = {1, 8};
  const StridedPlan plan = merge_dims(shape, 2, dst_strides, src_strides, "test");
  EXPECT_EQ(copy_word_bytes(plan, 4, 0, 0), 4u);
}

TEST(InWords, ScalesTheInnerExtentAndOuterStrides) {
  const int64_t shape[] = {8, 32};
  const int64_t dst_strides[] = {64, 1};
  const int64_t src_strides[] = {32, 1};
  const StridedPlan plan = merge_dims(shape, 2, dst_strides, src_strides, "test");
  const StridedPlan words = in_words(plan, 4, 16);
  EXPECT_EQ(shape_of(words), (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(dst_strides_of(words), (std::vector<int64_t>{16, 1}));
  EXPECT_EQ(src_strides_of(words), (std::vector<int64_t>{8, 1}));
  EXPECT_EQ(words.count, 64);
}

TEST(SumPartialCount, DependsOnlyOnTheCountAndIsBounded) {
  EXPECT_EQ(sum_partial_count(0), 1);
  EXPECT_EQ(sum_partial_count(1), 1);
  EXPECT_EQ(sum_partial_count(2048), 1);
  EXPECT_EQ(sum_partial_count(2049), 2);
  EXPECT_EQ(sum_partial_count(int64_t{1} << 40), 1024);
}

}  // namespace
}  // namespace tessera
