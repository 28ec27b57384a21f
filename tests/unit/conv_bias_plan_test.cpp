// The plan of the cuda conv bias gradient (ops/conv/conv_bias_plan.hpp), checked on the cpu by
// walking it exactly as the kernel does (blocks, lanes, walkers, chunks, the host-and-device
// index functions): every element of each channel is read once per occurrence in dy, for
// channels-first, channels-last, boxes of haloed buffers, 1-d to 3-d, broadcast (stride-0)
// dims and every element size; groups of 16 bytes only where rows are contiguous; the split of
// the work depends only on the shape; the kernel's sum order on the cpu equals the plain sum
// (up to rounding); and bad shapes or strides are rejected naming conv.
#include "ops/conv/conv_bias_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <vector>

#include "core/errors.hpp"

namespace tessera {
namespace {

using ops::BiasGradPlan;

/// Element offsets (from the channel's first element) the kernel reads for each channel,
/// following its loops; the values are passed to `visit(channel, chunk, walker, offset)`.
template <typename Visit>
void walk(const BiasGradPlan& plan, Visit&& visit) {
  for (int64_t chunk = 0; chunk < plan.chunks; ++chunk)
    for (int64_t channel_group = 0; channel_group < plan.channel_groups; ++channel_group)
      for (int thread = 0; thread < ops::kBiasGradThreads; ++thread) {
        const int lane = thread % plan.lanes, walker = thread / plan.lanes;
        const int64_t channel = channel_group * plan.lanes + lane;
        if (channel >= plan.channels) continue;
        const int64_t begin = chunk * plan.chunk_groups;
        const int64_t end = std::min(begin + plan.chunk_groups, plan.groups);
        if (begin + walker >= end) continue;
        int64_t index[ops::kBiasGradMaxDims] = {};
        ops::bias_grad_index(plan, begin + walker, index);
        for (int64_t g = begin + walker; g < end; g += plan.walkers) {
          const int64_t offset = ops::bias_grad_offset(plan, index);
          for (int i = 0; i < plan.vector; ++i) visit(channel, chunk, walker, offset + i);
          ops::bias_grad_advance(plan, index);
        }
      }
}

/// Each channel's offsets (from its first element) in dy, one entry per occurrence.
std::vector<std::map<int64_t, int>> expected_reads(const std::vector<int64_t>& shape,
                                                   const std::vector<int64_t>& strides) {
  std::vector<std::map<int64_t, int>> reads(static_cast<size_t>(shape[1]));
  const int64_t total =
      std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
  for (int64_t flat = 0; flat < total; ++flat) {
    int64_t rest = flat, offset = 0, channel = 0;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      const int64_t i = rest % shape[d];
      rest /= shape[d];
      if (d == 1)
        channel = i;
      else
        offset += i * strides[d];
    }
    ++reads[static_cast<size_t>(channel)][offset];
  }
  return reads;
}

std::vector<std::map<int64_t, int>> planned_reads(const BiasGradPlan& plan) {
  std::vector<std::map<int64_t, int>> reads(static_cast<size_t>(plan.channels));
  walk(plan, [&](int64_t channel, int64_t, int, int64_t offset) {
    ++reads[static_cast<size_t>(channel)][offset];
  });
  return reads;
}

std::vector<int64_t> contiguous(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * shape[d + 1];
  return strides;
}

/// Strides of [N, C, S..] stored [N, S.., C].
std::vector<int64_t> channels_last(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t step = 1;
  strides[1] = step;
  step *= shape[1];
  for (int d = static_cast<int>(shape.size()) - 1; d >= 2; --d) {
    strides[d] = step;
    step *= shape[d];
  }
  strides[0] = step;
  return strides;
}

struct Layout {
  const char* name;
  std::vector<int64_t> shape, strides;
};

std::vector<Layout> layouts() {
  return {
      {"contiguous 2-d (the f16/bf16 failure)", {2, 2, 12, 10}, {240, 120, 10, 1}},
      {"contiguous 1-d, odd length", {2, 4, 11}, {44, 11, 1}},
      {"contiguous 1-d, long rows", {3, 2, 1000}, contiguous({3, 2, 1000})},
      {"contiguous 3-d", {2, 3, 4, 5, 8}, contiguous({2, 3, 4, 5, 8})},
      {"channels-last 2-d", {2, 3, 5, 7}, channels_last({2, 3, 5, 7})},
      {"channels-last 2-d, 40 channels", {2, 40, 3, 4}, channels_last({2, 40, 3, 4})},
      {"channels-last 3-d", {2, 5, 3, 4, 2}, channels_last({2, 5, 3, 4, 2})},
      // A [2, 4, 6, 16] box of a [2, 4, 10, 20] haloed buffer: rows of 16 with a gap.
      {"box of a haloed buffer", {2, 4, 6, 16}, {800, 200, 20, 1}},
      {"box of a channels-last buffer", {2, 6, 3, 4}, {6 * 5 * 6, 1, 5 * 6, 6}},
      {"no spatial extent", {5, 7, 1, 1}, {7, 1, 1, 1}},
      {"one sample, one position", {1, 3, 1}, {3, 1, 1}},
      {"batch broadcast (stride 0)", {3, 2, 8}, {0, 8, 1}},
      {"one channel", {4, 1, 9, 3}, {27, 27, 3, 1}},
      {"many rows over few channels", {64, 2, 40, 33}, contiguous({64, 2, 40, 33})},
  };
}

TEST(ConvBiasPlan, ReadsEveryElementOfEachChannelOnceForEveryLayoutAndElementSize) {
  for (const Layout& layout : layouts())
    for (size_t element_size : {2, 4, 8}) {
      const BiasGradPlan plan = ops::bias_grad_plan(layout.shape, layout.strides, 1, element_size);
      EXPECT_EQ(plan.lanes * plan.walkers, ops::kBiasGradThreads) << layout.name;
      EXPECT_EQ(planned_reads(plan), expected_reads(layout.shape, layout.strides))
          << layout.name << ", " << element_size << "-byte elements";
    }
}

TEST(ConvBiasPlan, ContiguousRowsAreReadInSixteenByteGroups) {
  // The failing shape of the f16/bf16 run: spatial dims merge into rows of 120.
  BiasGradPlan plan = ops::bias_grad_plan({2, 2, 12, 10}, {240, 120, 10, 1}, 1, 2);
  EXPECT_EQ(plan.vector, 8);
  EXPECT_EQ(plan.lanes, 1);
  ASSERT_EQ(plan.ndim, 2);
  EXPECT_EQ(plan.extent[0], 2);
  EXPECT_EQ(plan.stride[0], 240);
  EXPECT_EQ(plan.extent[1], 15);
  EXPECT_EQ(plan.stride[1], 8);
  EXPECT_EQ(plan.groups, 30);
  for (size_t element_size : {4, 8})
    EXPECT_EQ(ops::bias_grad_plan({2, 2, 12, 10}, {240, 120, 10, 1}, 1, element_size).vector,
              16 / static_cast<int>(element_size));
  // Rows of 11: no whole number of groups, so element by element.
  EXPECT_EQ(ops::bias_grad_plan({2, 4, 11}, {44, 11, 1}, 1, 2).vector, 1);
  // A box: rows of 16 contiguous elements, a stride of 20 between them.
  plan = ops::bias_grad_plan({2, 4, 6, 16}, {800, 200, 20, 1}, 1, 4);
  EXPECT_EQ(plan.vector, 4);
  ASSERT_EQ(plan.ndim, 3);
  EXPECT_EQ(plan.extent[2], 4);
}

TEST(ConvBiasPlan, ChannelsLastPutsAdjacentChannelsOnTheLanesOfABlock) {
  BiasGradPlan plan = ops::bias_grad_plan({4, 64, 8, 8}, channels_last({4, 64, 8, 8}), 1, 2);
  EXPECT_EQ(plan.lanes, 32);
  EXPECT_EQ(plan.walkers, 8);
  EXPECT_EQ(plan.vector, 1);
  ASSERT_EQ(plan.ndim, 1);  // N and the spatial dims merge into one of stride C
  EXPECT_EQ(plan.extent[0], 4 * 64);
  EXPECT_EQ(plan.stride[0], 64);
  EXPECT_EQ(plan.channel_groups, 2);
  plan = ops::bias_grad_plan({4, 3, 8, 8}, channels_last({4, 3, 8, 8}), 1, 4);
  EXPECT_EQ(plan.lanes, 4);
  EXPECT_EQ(plan.walkers, 64);
  // Channels-first keeps one channel per block.
  EXPECT_EQ(ops::bias_grad_plan({4, 64, 8, 8}, contiguous({4, 64, 8, 8}), 1, 2).lanes, 1);
}

TEST(ConvBiasPlan, LargeInputsSplitIntoChunksThatFillTheDeviceWithinTheBlockCap) {
  // The bf16 benchmark's dy: 64 channels of 8 x 2^20.
  const std::vector<int64_t> shape{8, 64, 1048576};
  BiasGradPlan plan = ops::bias_grad_plan(shape, contiguous(shape), 1, 2);
  EXPECT_EQ(plan.vector, 8);
  EXPECT_EQ(plan.channel_groups * plan.chunks, ops::kBiasGradMaxBlocks);
  EXPECT_EQ(plan.chunks * plan.chunk_groups, plan.groups);
  EXPECT_EQ(ops::bias_grad_workspace_elements(plan), 64 * plan.chunks);
  // Few channels with 10^6 elements each still get many blocks per channel.
  const std::vector<int64_t> few{4, 2, 500, 500};
  plan = ops::bias_grad_plan(few, contiguous(few), 1, 4);
  EXPECT_GE(plan.channel_groups * plan.chunks, 256);
  EXPECT_LE(plan.channel_groups * plan.chunks, ops::kBiasGradMaxBlocks);
  // A small dy has one chunk: no second pass, no workspace.
  plan = ops::bias_grad_plan({2, 2, 12, 10}, {240, 120, 10, 1}, 1, 2);
  EXPECT_EQ(plan.chunks, 1);
  EXPECT_EQ(ops::bias_grad_workspace_elements(plan), 0);
}

TEST(ConvBiasPlan, SplitDependsOnlyOnShapeStridesAndElementSize) {
  for (const Layout& layout : layouts()) {
    const BiasGradPlan a = ops::bias_grad_plan(layout.shape, layout.strides, 1, 4);
    const BiasGradPlan b = ops::bias_grad_plan(layout.shape, layout.strides, 1, 4);
    EXPECT_EQ(std::vector<int64_t>(a.extent, a.extent + ops::kBiasGradMaxDims),
              std::vector<int64_t>(b.extent, b.extent + ops::kBiasGradMaxDims));
    EXPECT_EQ(a.chunks, b.chunks);
    EXPECT_EQ(a.chunk_groups, b.chunk_groups);
  }
}

TEST(ConvBiasPlan, KernelOrderSumsEqualThePlainSum) {
  // The kernel's order (walker sums, a tree over walkers, chunk sums in order) emulated in
  // float, against a double sum of the same values.
  const std::vector<int64_t> shape{16, 3, 40, 33};
  const std::vector<int64_t> strides = contiguous(shape);
  const BiasGradPlan plan = ops::bias_grad_plan(shape, strides, 1, 4);
  ASSERT_GT(plan.chunks, 1);
  const int64_t total = 16 * 3 * 40 * 33;
  std::vector<float> dy(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) dy[i] = static_cast<float>(std::sin(0.37 * i));
  std::vector<float> walker_sums(static_cast<size_t>(plan.channels * plan.chunks * plan.walkers),
                                 0.0f);
  walk(plan, [&](int64_t channel, int64_t chunk, int walker, int64_t offset) {
    walker_sums[(channel * plan.chunks + chunk) * plan.walkers + walker] +=
        dy[channel * plan.channel_stride + offset];
  });
  for (int64_t channel = 0; channel < plan.channels; ++channel) {
    float sum = 0;
    for (int64_t chunk = 0; chunk < plan.chunks; ++chunk) {
      float* partial = &walker_sums[(channel * plan.chunks + chunk) * plan.walkers];
      for (int half = plan.walkers / 2; half > 0; half /= 2)
        for (int w = 0; w < half; ++w) partial[w] += partial[w + half];
      sum += partial[0];
    }
    double exact = 0, magnitude = 0;
    for (int64_t n = 0; n < 16; ++n)
      for (int64_t s = 0; s < 40 * 33; ++s) {
        const float value = dy[n * strides[0] + channel * strides[1] + s];
        exact += value;
        magnitude += std::abs(value);
      }
    EXPECT_NEAR(sum, exact, 1e-5 * magnitude) << "channel " << channel;
  }
}

TEST(ConvBiasPlan, EmptyDyReadsNothingAndWritesEveryChannel) {
  const BiasGradPlan plan = ops::bias_grad_plan({0, 5, 7}, {35, 7, 1}, 1, 2);
  EXPECT_EQ(plan.groups, 0);
  EXPECT_EQ(plan.chunks, 1);
  EXPECT_EQ(plan.channel_groups * plan.lanes, 5);  // every channel's block writes its 0
  EXPECT_EQ(ops::bias_grad_workspace_elements(plan), 0);
  EXPECT_EQ(planned_reads(plan), (std::vector<std::map<int64_t, int>>(5)));
}

TEST(ConvBiasPlan, BadShapesAndStridesAreRejectedNamingConv) {
  EXPECT_THROW(ops::bias_grad_plan({4}, {1}, 1, 4), InvalidArgument);
  EXPECT_THROW(ops::bias_grad_plan({2, 3, 4}, {12, 4}, 1, 4), InvalidArgument);
  EXPECT_THROW(ops::bias_grad_plan({2, 3, 4}, {12, -4, 1}, 1, 4), InvalidArgument);
  try {
    ops::bias_grad_plan({2, 3, 4, 5, 6, 7}, contiguous({2, 3, 4, 5, 6, 7}), 1, 4);
    FAIL() << "a 6-d dy was accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("conv"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace tessera
