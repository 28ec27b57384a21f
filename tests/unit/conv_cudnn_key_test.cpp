// The host-side half of the cuDNN conv, on the cpu: descriptor dims and strides for
// channels-first, channels-last and boxes of larger buffers (conv1d lifted to a unit height),
// filter formats, conv parameters, the math-mode rule, the choice among measured algorithms,
// and the algorithm-cache key and cache. Also the device dispatch of conv_forward_into on cpu.
#include "ops/conv/conv_cudnn_key.hpp"

#include <gtest/gtest.h>

#include <climits>
#include <limits>
#include <thread>
#include <unordered_set>
#include <vector>

#include "core/errors.hpp"
#include "core/tensor.hpp"
#include "ops/conv/conv_kernels.hpp"

namespace tessera::ops {
namespace {

std::array<int, 5> five(std::initializer_list<int> values) {
  std::array<int, 5> result{};
  std::copy(values.begin(), values.end(), result.begin());
  return result;
}

TEST(ConvCudnnKey, Conv1dChannelsFirstLiftsToPackedNchwWithUnitHeight) {
  const Shape shape{2, 3, 10};
  const CudnnTensorDims dims = cudnn_tensor_dims(shape, contiguous_strides(shape), "conv");
  EXPECT_EQ(dims.rank, 4);
  EXPECT_EQ(dims.dims, five({2, 3, 1, 10}));
  EXPECT_EQ(dims.strides, five({30, 10, 10, 1}));
}

TEST(ConvCudnnKey, Conv1dChannelsLastLiftsToPackedNhwc) {
  const Shape shape{2, 3, 10};
  const CudnnTensorDims dims = cudnn_tensor_dims(shape, channels_last_strides(shape), "conv");
  // Packed NHWC of [2, 3, 1, 10]: n 1*10*3, c 1, h 10*3, w 3.
  const std::vector<int64_t> packed = channels_last_strides({2, 3, 1, 10});
  EXPECT_EQ(dims.dims, five({2, 3, 1, 10}));
  EXPECT_EQ(dims.strides, five({30, 1, 30, 3}));
  for (int d = 0; d < 4; ++d) EXPECT_EQ(dims.strides[d], packed[d]) << d;
}

TEST(ConvCudnnKey, ChannelsLastStridesPutChannelsInnermost) {
  EXPECT_EQ(channels_last_strides({2, 3, 4, 5}), (std::vector<int64_t>{60, 1, 15, 3}));
  EXPECT_EQ(channels_last_strides({2, 3, 4, 5, 6}), (std::vector<int64_t>{360, 1, 90, 18, 3}));
}

TEST(ConvCudnnKey, Conv2dAndConv3dKeepTheirRankAndStrides) {
  const Shape shape2{2, 3, 4, 5}, shape3{1, 2, 3, 4, 5};
  const CudnnTensorDims nchw = cudnn_tensor_dims(shape2, contiguous_strides(shape2), "conv");
  EXPECT_EQ(nchw.rank, 4);
  EXPECT_EQ(nchw.strides, five({60, 20, 5, 1}));
  const CudnnTensorDims ndhwc = cudnn_tensor_dims(shape3, channels_last_strides(shape3), "conv");
  EXPECT_EQ(ndhwc.rank, 5);
  EXPECT_EQ(ndhwc.dims, five({1, 2, 3, 4, 5}));
  EXPECT_EQ(ndhwc.strides, five({120, 1, 40, 10, 2}));
}

TEST(ConvCudnnKey, BoxOfAHaloedBufferKeepsTheBufferStrides) {
  // The interior of a haloed [1, 2, 8, 9] piece: a [1, 2, 6, 7] view with the parent's strides.
  const Tensor haloed = Tensor::zeros({1, 2, 8, 9}, DType::f32);
  const Tensor interior = haloed.view_box(Box{{0, 0, 1, 1}, {1, 2, 7, 8}});
  const CudnnTensorDims dims = cudnn_tensor_dims(interior.shape(), interior.strides(), "conv");
  EXPECT_EQ(dims.dims, five({1, 2, 6, 7}));
  EXPECT_EQ(dims.strides, five({144, 72, 9, 1}));
  EXPECT_EQ(activation_layout(interior.shape(), interior.strides()),
            ActivationLayout::channels_first);
}

TEST(ConvCudnnKey, LayoutIsChannelsLastOnlyWhenChannelsAreInnermost) {
  const Shape shape{2, 3, 4, 5};
  EXPECT_EQ(activation_layout(shape, contiguous_strides(shape)), ActivationLayout::channels_first);
  EXPECT_EQ(activation_layout(shape, channels_last_strides(shape)),
            ActivationLayout::channels_last);
  // One channel: nothing to interleave, reported channels-first whatever the strides.
  const Shape single{2, 1, 4, 5};
  EXPECT_EQ(activation_layout(single, channels_last_strides(single)),
            ActivationLayout::channels_first);
  // Unit spatial dims do not decide: [2, 3, 1, 5] channels-last.
  const Shape unit{2, 3, 1, 5};
  EXPECT_EQ(activation_layout(unit, channels_last_strides(unit)), ActivationLayout::channels_last);
}

TEST(ConvCudnnKey, FilterFormatFollowsWeightStrides) {
  const Shape w{8, 4, 3, 3};
  const CudnnFilterDims oihw = cudnn_filter_dims(w, contiguous_strides(w), "conv");
  EXPECT_FALSE(oihw.channels_last);
  EXPECT_EQ(oihw.dims, five({8, 4, 3, 3}));
  const CudnnFilterDims ohwi = cudnn_filter_dims(w, channels_last_strides(w), "conv");
  EXPECT_TRUE(ohwi.channels_last);
  EXPECT_EQ(ohwi.dims, five({8, 4, 3, 3}));  // dims stay in [K, C, R, S] order
  const Shape w1{8, 4, 5};
  const CudnnFilterDims lifted = cudnn_filter_dims(w1, contiguous_strides(w1), "conv");
  EXPECT_EQ(lifted.rank, 4);
  EXPECT_EQ(lifted.dims, five({8, 4, 1, 5}));
  EXPECT_THROW(cudnn_filter_dims(w, {72, 1, 3, 1}, "conv"), InvalidArgument);
}

TEST(ConvCudnnKey, Conv1dParamsGetUnitStrideAndDilationAlongTheUnitHeight) {
  const CudnnConvParams p1 = cudnn_conv_params(1, {2}, {3}, "conv");
  EXPECT_EQ(p1.spatial, 2);
  EXPECT_EQ(p1.stride, (std::array<int, 3>{1, 2, 1}));
  EXPECT_EQ(p1.dilation, (std::array<int, 3>{1, 3, 1}));
  EXPECT_EQ(p1.padding, (std::array<int, 3>{0, 0, 0}));
  const CudnnConvParams p3 = cudnn_conv_params(3, {1, 2, 3}, {}, "conv");
  EXPECT_EQ(p3.spatial, 3);
  EXPECT_EQ(p3.stride, (std::array<int, 3>{1, 2, 3}));
  EXPECT_EQ(p3.dilation, (std::array<int, 3>{1, 1, 1}));
  EXPECT_THROW(cudnn_conv_params(2, {1}, {1, 1}, "conv"), InvalidArgument);
}

TEST(ConvCudnnKey, ExtentsBeyondCudnnIntAreRejectedWithTheShape) {
  const Shape huge{1, 1, int64_t{INT_MAX} + 1};
  try {
    cudnn_tensor_dims(huge, contiguous_strides(huge), "conv");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("2147483648"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("[conv]"), std::string::npos) << error.what();
  }
}

TEST(ConvCudnnKey, MathModeKeepsF32OffTensorCoresUnlessTf32IsAllowed) {
  EXPECT_EQ(cudnn_math_for(DType::f32, false), CudnnMath::fma);
  EXPECT_EQ(cudnn_math_for(DType::f32, true), CudnnMath::default_math);
  EXPECT_EQ(cudnn_math_for(DType::f64, true), CudnnMath::fma);
  EXPECT_EQ(cudnn_math_for(DType::f16, false), CudnnMath::tensor_op);
  EXPECT_EQ(cudnn_math_for(DType::bf16, false), CudnnMath::tensor_op);
  EXPECT_TRUE(allow_tf32_from_env("1"));
  EXPECT_FALSE(allow_tf32_from_env(nullptr));
  EXPECT_FALSE(allow_tf32_from_env("0"));
  EXPECT_FALSE(allow_tf32_from_env("yes"));
}

TEST(ConvCudnnKey, Tf32SettingIsOffByDefaultAndCanBeToggled) {
  const bool initial = conv_allow_tf32();
  set_conv_allow_tf32(true);
  EXPECT_TRUE(conv_allow_tf32());
  set_conv_allow_tf32(false);
  EXPECT_FALSE(conv_allow_tf32());
  set_conv_allow_tf32(initial);
}

TEST(ConvCudnnKey, ChosenAlgorithmIsTheFastestThatRanFitsAndIsDeterministicWhenAsked) {
  const std::vector<CudnnAlgoMeasurement> measured{
      {1, false, 0.1f, 0, true, 0},        // failed
      {2, true, 0.2f, 1 << 30, true, 1},   // too much workspace
      {3, true, 0.3f, 1 << 10, false, 1},  // non-deterministic
      {4, true, 0.4f, 1 << 10, true, 3},
      {5, true, 0.5f, 0, true, 3}};
  using enum CudnnDeterminism;
  EXPECT_EQ(choose_algorithm(measured, any, 1 << 20), (CudnnAlgoChoice{3, 1, 1 << 10}));
  EXPECT_EQ(choose_algorithm(measured, required, 1 << 20), (CudnnAlgoChoice{4, 3, 1 << 10}));
  EXPECT_EQ(choose_algorithm(measured, preferred, 1 << 20), (CudnnAlgoChoice{4, 3, 1 << 10}));
  EXPECT_EQ(choose_algorithm(measured, any, size_t{1} << 31), (CudnnAlgoChoice{2, 1, 1 << 30}));
  EXPECT_EQ(choose_algorithm(measured, required, 0), (CudnnAlgoChoice{5, 3, 0}));
  EXPECT_FALSE(choose_algorithm({{1, false, 0.1f, 0, true, 0}}, any, 1 << 20).has_value());
  // Preferred falls back to a non-deterministic algorithm when no deterministic one qualifies;
  // required has none.
  const std::vector<CudnnAlgoMeasurement> atomics_only{{3, true, 0.3f, 0, false, 1},
                                                       {4, true, 0.1f, 1 << 30, true, 1}};
  EXPECT_EQ(choose_algorithm(atomics_only, preferred, 1 << 20), (CudnnAlgoChoice{3, 1, 0}));
  EXPECT_FALSE(choose_algorithm(atomics_only, required, 1 << 20).has_value());
}

TEST(ConvCudnnKey, WorkspaceLimitIsAnEighthOfTheDeviceAtLeast2GiBAndHalfTheFreeAtMost) {
  constexpr size_t GiB = size_t{1} << 30;
  EXPECT_EQ(cudnn_workspace_limit(nullptr, 80 * GiB, 70 * GiB), 10 * GiB);
  EXPECT_EQ(cudnn_workspace_limit(nullptr, 16 * GiB, 14 * GiB), 2 * GiB) << "at least 2 GiB";
  EXPECT_EQ(cudnn_workspace_limit(nullptr, 80 * GiB, 6 * GiB), 3 * GiB) << "half the free";
  EXPECT_EQ(cudnn_workspace_limit("512", 80 * GiB, 70 * GiB), 512 * (size_t{1} << 20));
  EXPECT_EQ(cudnn_workspace_limit("0", 80 * GiB, 70 * GiB), 0u);
  EXPECT_EQ(cudnn_workspace_limit("65536", 80 * GiB, 70 * GiB), 35 * GiB) << "half the free";
  EXPECT_EQ(cudnn_workspace_limit("", 80 * GiB, 70 * GiB), 10 * GiB) << "empty is unset";
  for (const char* bad : {"abc", "-5", "1.5", "512MB", "99999999999"})
    EXPECT_THROW(cudnn_workspace_limit(bad, 80 * GiB, 70 * GiB), InvalidArgument) << bad;
}

// Half-precision convs avoid the atomics-based backward algorithms (their partial sums add up in
// the half type itself: f16 dx of a stride-2 conv fell outside one rounding of an f32 sum on an
// H100 when the measurement picked one); f32 and f64 take the fastest; the environment's
// requirement holds for every dtype.
TEST(ConvCudnnKey, HalfPrecisionPrefersDeterministicAlgorithms) {
  using enum CudnnDeterminism;
  EXPECT_EQ(cudnn_determinism_for(DType::f16, false), preferred);
  EXPECT_EQ(cudnn_determinism_for(DType::bf16, false), preferred);
  EXPECT_EQ(cudnn_determinism_for(DType::f32, false), any);
  EXPECT_EQ(cudnn_determinism_for(DType::f64, false), any);
  for (DType dtype : {DType::f16, DType::bf16, DType::f32, DType::f64})
    EXPECT_EQ(cudnn_determinism_for(dtype, true), required);
  // A measurement where the atomics-based algorithm is fastest: bf16 takes the other.
  const std::vector<CudnnAlgoMeasurement> backward_data{{0, true, 0.2f, 0, false, 1},
                                                        {1, true, 0.3f, 1 << 12, true, 1}};
  EXPECT_EQ(choose_algorithm(backward_data, cudnn_determinism_for(DType::bf16, false), 1 << 20),
            (CudnnAlgoChoice{1, 1, 1 << 12}));
  EXPECT_EQ(choose_algorithm(backward_data, cudnn_determinism_for(DType::f32, false), 1 << 20),
            (CudnnAlgoChoice{0, 1, 0}));
}

TEST(ConvCudnnKey, FilterStridesFollowTheFormat) {
  // [K 8, C 3, 2, 5] row-major, and the same stored [K, kh, kw, C] (NHWC).
  const Shape w{8, 3, 2, 5};
  const CudnnFilterDims first = cudnn_filter_dims(w, contiguous_strides(w), "conv");
  EXPECT_EQ(cudnn_filter_strides(first), (std::array<int64_t, 5>{30, 10, 5, 1, 0}));
  const CudnnFilterDims last = cudnn_filter_dims(w, channels_last_strides(w), "conv");
  ASSERT_TRUE(last.channels_last);
  EXPECT_EQ(cudnn_filter_strides(last), (std::array<int64_t, 5>{30, 1, 15, 3, 0}));
  // conv3d, and conv1d lifted to a unit kernel height.
  const Shape w3{4, 2, 3, 3, 3};
  EXPECT_EQ(cudnn_filter_strides(cudnn_filter_dims(w3, channels_last_strides(w3), "conv")),
            (std::array<int64_t, 5>{54, 1, 18, 6, 2}));
  const Shape w1{4, 2, 7};
  EXPECT_EQ(cudnn_filter_strides(cudnn_filter_dims(w1, contiguous_strides(w1), "conv")),
            (std::array<int64_t, 5>{14, 7, 7, 1, 0}));
}

TEST(ConvCudnnKey, GraphApiAndItsCandidateCountAreChosenByName) {
  EXPECT_EQ(cudnn_api_from_env(nullptr), CudnnApi::graph);
  EXPECT_EQ(cudnn_api_from_env(""), CudnnApi::graph);
  EXPECT_EQ(cudnn_api_from_env("legacy"), CudnnApi::legacy);
  EXPECT_EQ(cudnn_api_from_env("graph"), CudnnApi::graph);
  EXPECT_THROW(cudnn_api_from_env("1"), InvalidArgument);
  EXPECT_THROW(cudnn_api_from_env("Graph"), InvalidArgument);
  EXPECT_EQ(cudnn_graph_candidates_from_env(nullptr), 10u);
  EXPECT_EQ(cudnn_graph_candidates_from_env(""), 10u);
  EXPECT_EQ(cudnn_graph_candidates_from_env("3"), 3u);
  EXPECT_EQ(cudnn_graph_candidates_from_env("0"), std::numeric_limits<size_t>::max());
  EXPECT_THROW(cudnn_graph_candidates_from_env("-1"), InvalidArgument);
  EXPECT_THROW(cudnn_graph_candidates_from_env("ten"), InvalidArgument);
}

TEST(ConvCudnnKey, GraphEnginesKeepTheNumericalContractOfTheLegacyMathModes) {
  using enum CudnnDeterminism;
  const CudnnEngineNotes plain{}, tensor_core{.tensor_core = true},
      down_convert{.tensor_core = true, .down_convert_inputs = true},
      half_sums{.tensor_core = true, .reduced_precision_reduction = true},
      atomics{.nondeterministic = true};
  // f32 without TF32 (fma) and f64: no tensor cores, which would round f32 inputs to TF32.
  for (DType dtype : {DType::f32, DType::f64}) {
    EXPECT_TRUE(cudnn_engine_allowed(plain, dtype, CudnnMath::fma, any));
    EXPECT_FALSE(cudnn_engine_allowed(tensor_core, dtype, CudnnMath::fma, any));
  }
  // f32 with TF32 allowed: tensor cores yes, down-converted inputs (to f16/bf16) no.
  EXPECT_TRUE(cudnn_engine_allowed(tensor_core, DType::f32, CudnnMath::default_math, any));
  EXPECT_FALSE(cudnn_engine_allowed(down_convert, DType::f32, CudnnMath::default_math, any));
  // f16 and bf16: tensor cores with f32 sums; never sums in the half type.
  for (DType dtype : {DType::f16, DType::bf16}) {
    EXPECT_TRUE(cudnn_engine_allowed(tensor_core, dtype, CudnnMath::tensor_op, preferred));
    EXPECT_FALSE(cudnn_engine_allowed(half_sums, dtype, CudnnMath::tensor_op, preferred));
    EXPECT_FALSE(cudnn_engine_allowed(down_convert, dtype, CudnnMath::tensor_op, preferred));
  }
  // Non-deterministic engines: out only when determinism is required (preferred is settled
  // among the measured ones, as for the legacy algorithms).
  EXPECT_TRUE(cudnn_engine_allowed(atomics, DType::f32, CudnnMath::fma, any));
  EXPECT_TRUE(cudnn_engine_allowed(atomics, DType::bf16, CudnnMath::tensor_op, preferred));
  EXPECT_FALSE(cudnn_engine_allowed(atomics, DType::f32, CudnnMath::fma, required));
}

CudnnConvKey sample_key() {
  const Shape x{2, 4, 10, 12}, w{8, 2, 3, 3}, y{2, 8, 8, 10};
  CudnnConvKey key;
  key.x = cudnn_tensor_dims(x, contiguous_strides(x), "conv");
  key.y = cudnn_tensor_dims(y, contiguous_strides(y), "conv");
  key.w = cudnn_filter_dims(w, contiguous_strides(w), "conv");
  key.params = cudnn_conv_params(2, {1, 1}, {1, 1}, "conv");
  key.groups = 2;
  return key;
}

TEST(ConvCudnnKey, EveryFieldDistinguishesKeys) {
  std::vector<CudnnConvKey> keys(14, sample_key());
  keys[1].direction = CudnnDirection::backward_data;
  keys[2].direction = CudnnDirection::backward_filter;
  keys[3].dtype = DType::bf16;
  keys[4].math = CudnnMath::default_math;
  keys[5].deterministic = true;
  keys[6].device = 1;
  keys[7].layout = ActivationLayout::channels_last;
  keys[8].x.strides[0] = 1000;
  keys[9].y.dims[2] = 7;
  keys[10].w.channels_last = true;
  keys[11].params.stride[1] = 2;
  keys[12].params.dilation[0] = 2;
  keys[13].groups = 1;
  std::unordered_set<CudnnConvKey, CudnnConvKeyHash> distinct(keys.begin(), keys.end());
  EXPECT_EQ(distinct.size(), keys.size());
  std::unordered_set<size_t> hashes;
  for (const CudnnConvKey& key : keys) hashes.insert(CudnnConvKeyHash{}(key));
  EXPECT_EQ(hashes.size(), keys.size()) << "no two of these keys share a hash";
  EXPECT_EQ(CudnnConvKeyHash{}(sample_key()), CudnnConvKeyHash{}(sample_key()));
  EXPECT_EQ(sample_key(), sample_key());
}

TEST(ConvCudnnKey, DescriptionNamesDirectionDtypeShapesAndGeometry) {
  const std::string text = describe(sample_key());
  for (const char* part : {"forward", "f32", "fma", "cuda:0", "(2,4,10,12)/(480,120,12,1)",
                           "(8,2,3,3)", "nchw", "groups 2"})
    EXPECT_NE(text.find(part), std::string::npos) << part << " in " << text;
}

TEST(ConvCudnnKey, CacheKeepsTheFirstChoicePerKeyAcrossThreads) {
  CudnnAlgoCache cache;
  const CudnnConvKey key = sample_key();
  EXPECT_FALSE(cache.find(key).has_value());
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&cache, t] {
      for (int i = 0; i < 100; ++i) {
        CudnnConvKey own = sample_key();
        own.device = i % 4;
        cache.insert(own, CudnnAlgoChoice{t, 0, 0});
      }
    });
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(cache.size(), 4u);
  const CudnnAlgoChoice first = *cache.find(key);
  EXPECT_EQ(cache.insert(key, CudnnAlgoChoice{99, 1, 1}), first);
  EXPECT_EQ(*cache.find(key), first);
  // entries: every key once, with the choice find gives.
  const auto entries = cache.entries();
  EXPECT_EQ(entries.size(), 4u);
  for (const auto& [entry_key, choice] : entries) EXPECT_EQ(*cache.find(entry_key), choice);
  cache.clear();
  EXPECT_EQ(cache.size(), 0u);
}

TEST(ConvCudnnKey, ForwardIntoAViewOnCpuMatchesTheWholeConv) {
  const Shape x_shape{1, 2, 6, 7}, w_shape{3, 2, 3, 3};
  Tensor x = Tensor::empty(x_shape, DType::f64), w = Tensor::empty(w_shape, DType::f64);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<double>()[i] = static_cast<double>(i % 7) - 3;
  for (int64_t i = 0; i < w.numel(); ++i) w.data<double>()[i] = static_cast<double>(i % 5) - 2;
  const ConvGeometry geometry{{1, 1}, {1, 1}, 1};
  const Tensor whole = conv_forward(x, w, nullptr, geometry);
  // The output rows 1..3 from the input rows 1..5, written into a box of a zeroed output.
  Tensor y = Tensor::zeros(whole.shape(), DType::f64);
  Tensor y_box = y.view_box(Box{{0, 0, 1, 0}, {1, 3, 3, 5}});
  conv_forward_into(x.view_box(Box{{0, 0, 1, 0}, {1, 2, 5, 7}}), w, nullptr, geometry, y_box);
  EXPECT_TRUE(bitwise_equal(y_box.contiguous(),
                            whole.view_box(Box{{0, 0, 1, 0}, {1, 3, 3, 5}}).contiguous()));
  EXPECT_EQ(y.item_as_double({0, 0, 0, 0}), 0.0) << "nothing written outside the box";
}

TEST(ConvCudnnKey, CudnnBackendRefusesCpuTensors) {
  const Tensor x = Tensor::zeros({1, 1, 5}, DType::f32), w = Tensor::zeros({1, 1, 3}, DType::f32);
  EXPECT_THROW(conv_forward(x, w, nullptr, ConvGeometry{{1}, {1}, 1}, ConvBackend::cudnn),
               InvalidArgument);
}

}  // namespace
}  // namespace tessera::ops
