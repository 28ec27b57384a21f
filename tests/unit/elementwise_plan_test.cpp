// The argument preparation of the pointwise and reduction cuda kernels, on the cpu: elementwise
// layouts (merged dims, broadcast strides, the vector-access decision), broadcast operand views
// against expand_to_box, and reduction plans (merged dims, the split, and sums computed in the
// plan's documented order equal plain sums on random shapes, dims and strides).
#include "ops/pointwise/elementwise_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "ops/pointwise/broadcast.hpp"
#include "ops/reduce/reduce_plan.hpp"
#include "tests/common/layout_cases.hpp"

namespace tessera::ops {
namespace {

using testing::CaseRng;

/// Offset of operand k at flat index i of `layout`, as the strided kernel computes it.
int64_t layout_offset(const ElementwiseLayout& layout, int k, int64_t i) {
  int64_t offset = 0;
  for (int d = layout.ndim - 1; d >= 0; --d) {
    offset += (i % layout.extent[d]) * layout.stride[k][d];
    i /= layout.extent[d];
  }
  return offset;
}

/// Offset of the row-major flat index i of `shape` through `strides`, computed directly.
int64_t direct_offset(const Shape& shape, const std::vector<int64_t>& strides, int64_t i) {
  int64_t offset = 0;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    offset += (i % shape[d]) * strides[d];
    i /= shape[d];
  }
  return offset;
}

TEST(ElementwisePlan, ContiguousOperandsMergeIntoOneUnitStrideDim) {
  const Shape shape{2, 3, 4};
  const ElementwiseLayout layout =
      elementwise_layout(shape, {contiguous_strides(shape), contiguous_strides(shape)});
  EXPECT_EQ(layout.ndim, 1);
  EXPECT_EQ(layout.extent[0], 24);
  EXPECT_EQ(layout.count, 24);
  EXPECT_TRUE(layout.contiguous);
}

TEST(ElementwisePlan, BroadcastOperandKeepsStrideZeroAndSplitsDims) {
  // a (5, 4, 3) contiguous; b (4, 1) broadcast against it: strides (0, 1, 0).
  const ElementwiseLayout layout = elementwise_layout({5, 4, 3}, {{12, 3, 1}, {0, 1, 0}});
  ASSERT_EQ(layout.ndim, 3);
  EXPECT_FALSE(layout.contiguous);
  EXPECT_EQ(std::vector<int64_t>(layout.extent, layout.extent + 3),
            (std::vector<int64_t>{5, 4, 3}));
  EXPECT_EQ(std::vector<int64_t>(layout.stride[1], layout.stride[1] + 3),
            (std::vector<int64_t>{0, 1, 0}));
}

TEST(ElementwisePlan, ExtentOneDimsAreDroppedAndBroadcastRunsMerge) {
  // (1, 6, 1, 5): b broadcast along the last dim only; the extent-1 dims vanish.
  const ElementwiseLayout layout = elementwise_layout({1, 6, 1, 5}, {{30, 5, 5, 1}, {6, 1, 1, 0}});
  ASSERT_EQ(layout.ndim, 2);
  EXPECT_EQ(layout.extent[0], 6);
  EXPECT_EQ(layout.extent[1], 5);
  // A scalar (every dim of extent 1) is one element with no dims, read at offset 0.
  const ElementwiseLayout scalar = elementwise_layout({1, 1}, {{1, 1}});
  EXPECT_EQ(scalar.ndim, 0);
  EXPECT_EQ(scalar.count, 1);
  EXPECT_TRUE(scalar.contiguous);
}

TEST(ElementwisePlan, LayoutOffsetsEqualDirectOffsetsOnRandomStrides) {
  CaseRng rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int ndim = static_cast<int>(rng.uniform(0, 5));
    Shape shape;
    for (int d = 0; d < ndim; ++d) shape.push_back(rng.uniform(1, 4));
    std::vector<std::vector<int64_t>> strides;
    const int operands = static_cast<int>(rng.uniform(1, kMaxOperands));
    for (int k = 0; k < operands; ++k) {
      // contiguous, a permuted dense layout, or broadcast dims
      std::vector<int64_t> s = contiguous_strides(shape);
      if (rng.chance(0.3) && ndim > 1) std::reverse(s.begin(), s.end());
      for (int d = 0; d < ndim; ++d)
        if (rng.chance(0.25)) s[d] = 0;
      strides.push_back(s);
    }
    const ElementwiseLayout layout = elementwise_layout(shape, strides);
    ASSERT_EQ(layout.count, shape_numel(shape));
    for (int64_t i = 0; i < layout.count; ++i)
      for (int k = 0; k < operands; ++k)
        ASSERT_EQ(layout_offset(layout, k, i), direct_offset(shape, strides[k], i))
            << "trial " << trial << " operand " << k << " index " << i;
    if (layout.contiguous) {
      for (int64_t i = 0; i < layout.count; ++i)
        for (int k = 0; k < operands; ++k) ASSERT_EQ(direct_offset(shape, strides[k], i), i);
    }
  }
}

TEST(ElementwisePlan, VectorAccessesOnlyWhenContiguousAndEveryPointerAligned) {
  const ElementwiseLayout dense = elementwise_layout({10, 7}, {{7, 1}, {7, 1}});
  const ElementwiseLayout strided = elementwise_layout({10, 7}, {{7, 1}, {1, 10}});
  alignas(16) static float buffer[256];
  const void* aligned = buffer;
  const void* other = buffer + 4;
  const void* misaligned = buffer + 1;
  EXPECT_EQ(vector_width(dense, {aligned, other}, 4), 4);
  EXPECT_EQ(vector_width(dense, {aligned, other}, 8), 2);
  EXPECT_EQ(vector_width(dense, {aligned, other}, 2), 8);
  EXPECT_EQ(vector_width(dense, {aligned, misaligned}, 4), 1);
  EXPECT_EQ(vector_width(strided, {aligned, other}, 4), 1);
}

TEST(ElementwisePlan, BroadcastOperandViewReadsWhatExpandToBoxCopies) {
  // b (4, 1, 3) aligned at dim 1 of a (2, 4, 5, 3); a's local box starts at (1, 2, 0, 1).
  const Shape b_shape{4, 1, 3};
  Tensor b = Tensor::empty(b_shape, DType::f64);
  for (int64_t i = 0; i < b.numel(); ++i) b.data<double>()[i] = static_cast<double>(i);
  const Box box{{1, 2, 0, 1}, {2, 4, 5, 3}};
  const Tensor expanded = expand_to_box(b, box, 1);
  const OperandView view = broadcast_operand_view(b_shape, b.strides(), box.lo, 1);
  EXPECT_EQ(view.strides, (std::vector<int64_t>{0, 3, 0, 1}));
  const Shape shape = box.shape();
  for (int64_t i = 0; i < expanded.numel(); ++i)
    EXPECT_EQ(expanded.data<double>()[i],
              b.data<double>()[view.start + direct_offset(shape, view.strides, i)]);
}

/// The sums of `plan` over `a` (and b), computed on the cpu in the order the kernels use.
std::vector<double> plan_sums(const ReducePlan& plan, const std::vector<double>& a,
                              const std::vector<double>& b, int64_t out_size) {
  std::vector<double> out(out_size, -1.0);
  auto element = [&](const int64_t* base, int64_t r) {
    int64_t offset[2] = {base[0], base[1]};
    for (int d = plan.reduced_ndim - 1; d >= 0; --d) {
      const int64_t index = r % plan.reduced_extent[d];
      r /= plan.reduced_extent[d];
      for (int k = 0; k < plan.operands; ++k) offset[k] += index * plan.reduced_stride[k][d];
    }
    if (plan.operands == 1) return a[offset[0]];
    const double difference = a[offset[0]] - b[offset[1]];
    return difference * difference;
  };
  for (int64_t o = 0; o < plan.outputs; ++o) {
    int64_t base[2] = {0, 0}, out_offset = 0, rest = o;
    for (int d = plan.kept_ndim - 1; d >= 0; --d) {
      const int64_t index = rest % plan.kept_extent[d];
      rest /= plan.kept_extent[d];
      for (int k = 0; k < plan.operands; ++k) base[k] += index * plan.kept_stride[k][d];
      out_offset += index * plan.out_stride[d];
    }
    double total = 0;
    if (plan.strategy == ReduceStrategy::thread_per_output) {
      for (int64_t r = 0; r < plan.reduce_count; ++r) total += element(base, r);
    } else {
      for (int64_t chunk = 0; chunk < plan.chunks; ++chunk) {
        const int64_t begin = chunk * plan.chunk_length;
        const int64_t end = std::min(begin + plan.chunk_length, plan.reduce_count);
        std::vector<double> partial(plan.threads, 0.0);
        for (int t = 0; t < plan.threads; ++t)
          for (int64_t r = begin + t; r < end; r += plan.threads) partial[t] += element(base, r);
        for (int half = plan.threads / 2; half > 0; half /= 2)
          for (int t = 0; t < half; ++t) partial[t] += partial[t + half];
        total += partial[0];
      }
    }
    out[out_offset] = total;
  }
  return out;
}

TEST(ReducePlan, SumOverOuterAndInnerDimsKeepsTheMiddleOne) {
  const Shape shape{5, 4, 3};
  const ReducePlan plan =
      reduce_plan(shape, {contiguous_strides(shape)}, {true, false, true}, {0, 1, 0});
  EXPECT_EQ(plan.outputs, 4);
  EXPECT_EQ(plan.reduce_count, 15);
  ASSERT_EQ(plan.kept_ndim, 1);
  EXPECT_EQ(plan.kept_stride[0][0], 3);
  EXPECT_EQ(plan.out_stride[0], 1);
  EXPECT_EQ(plan.reduced_ndim, 2);  // dims 0 and 2 are not neighbours
  EXPECT_EQ(plan.strategy, ReduceStrategy::thread_per_output);
}

TEST(ReducePlan, ReducedDimsMergeAcrossExtentOneDims) {
  const Shape shape{2, 1, 3};
  const ReducePlan plan =
      reduce_plan(shape, {contiguous_strides(shape)}, {true, false, true}, {0, 0, 0});
  EXPECT_EQ(plan.reduced_ndim, 1);
  EXPECT_EQ(plan.reduced_extent[0], 6);
  EXPECT_EQ(plan.kept_ndim, 0);
  EXPECT_EQ(plan.outputs, 1);
}

TEST(ReducePlan, SplitDependsOnlyOnTheCounts) {
  const ReducePlan long_sum = reduce_plan({1 << 20}, {{1}}, {true}, {0});
  EXPECT_EQ(long_sum.strategy, ReduceStrategy::block_per_chunk);
  EXPECT_EQ(long_sum.chunks, 128);
  EXPECT_EQ(long_sum.chunk_length, kElementsPerChunk);
  EXPECT_EQ(reduce_workspace_elements(long_sum), 128);
  const ReducePlan many_outputs = reduce_plan({100000, 1000}, {{1000, 1}}, {false, true}, {1, 0});
  EXPECT_EQ(many_outputs.strategy, ReduceStrategy::thread_per_output);
  EXPECT_EQ(reduce_workspace_elements(many_outputs), 0);
  const ReducePlan short_sum = reduce_plan({300, 200}, {{200, 1}}, {false, true}, {1, 0});
  EXPECT_EQ(short_sum.strategy, ReduceStrategy::thread_per_output);
  // Odd lengths: no chunk is empty and the chunks cover every element.
  const ReducePlan odd = reduce_plan({3, 100003}, {{100003, 1}}, {false, true}, {1, 0});
  EXPECT_EQ(odd.strategy, ReduceStrategy::block_per_chunk);
  EXPECT_GE(odd.chunks * odd.chunk_length, odd.reduce_count);
  EXPECT_LT((odd.chunks - 1) * odd.chunk_length, odd.reduce_count);
}

TEST(ReducePlan, EmptyReductionGivesZeroSums) {
  const ReducePlan plan = reduce_plan({3, 0}, {{0, 1}}, {false, true}, {1, 0});
  EXPECT_EQ(plan.outputs, 3);
  EXPECT_EQ(plan.reduce_count, 0);
  EXPECT_EQ(plan_sums(plan, {}, {}, 3), (std::vector<double>{0, 0, 0}));
  // No outputs at all (a kept dim of extent 0) next to a long reduction: nothing to split.
  const ReducePlan none = reduce_plan({0, 100000}, {{100000, 1}}, {false, true}, {1, 0});
  EXPECT_EQ(none.outputs, 0);
  EXPECT_EQ(reduce_workspace_elements(none), 0);
}

TEST(ReducePlan, SumsInPlanOrderEqualPlainSumsOnRandomShapesDimsAndStrides) {
  CaseRng rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int ndim = static_cast<int>(rng.uniform(1, 4));
    Shape shape;
    for (int d = 0; d < ndim; ++d) shape.push_back(rng.uniform(0, 5));
    if (rng.chance(0.2)) shape.back() = rng.uniform(300, 3000);  // long rows: block_per_chunk
    std::vector<bool> reduced(ndim);
    for (int d = 0; d < ndim; ++d) reduced[d] = rng.chance(0.5);
    const int operands = static_cast<int>(rng.uniform(1, 2));
    std::vector<std::vector<int64_t>> strides;
    for (int k = 0; k < operands; ++k) {
      std::vector<int64_t> s = contiguous_strides(shape);
      if (rng.chance(0.4) && ndim > 1) {  // a transposed dense layout
        Shape reversed(shape.rbegin(), shape.rend());
        const std::vector<int64_t> r = contiguous_strides(reversed);
        s.assign(r.rbegin(), r.rend());
      }
      strides.push_back(s);
    }
    Shape kept = shape;
    for (int d = 0; d < ndim; ++d)
      if (reduced[d]) kept[d] = 1;
    const std::vector<int64_t> out_strides = contiguous_strides(kept);
    const ReducePlan plan = reduce_plan(shape, strides, reduced, out_strides);
    const int64_t count = shape_numel(shape);
    std::vector<double> a(count), b(count);
    for (int64_t i = 0; i < count; ++i) {  // small integers: every sum is exact
      a[i] = static_cast<double>(rng.uniform(-4, 4));
      b[i] = static_cast<double>(rng.uniform(-4, 4));
    }
    // Plain sums: walk the row-major index, add into the kept index.
    std::vector<double> expected(shape_numel(kept), 0.0);
    for (int64_t i = 0; i < count; ++i) {
      int64_t rest = i, target = 0, offset_a = 0, offset_b = 0;
      for (int d = ndim - 1; d >= 0; --d) {
        const int64_t index = rest % shape[d];
        rest /= shape[d];
        offset_a += index * strides[0][d];
        offset_b += index * strides[operands - 1][d];
        if (!reduced[d]) target += index * out_strides[d];
      }
      const double difference = a[offset_a] - b[offset_b];
      expected[target] += operands == 1 ? a[offset_a] : difference * difference;
    }
    EXPECT_EQ(plan_sums(plan, a, b, shape_numel(kept)), expected) << "trial " << trial;
  }
}

}  // namespace
}  // namespace tessera::ops
