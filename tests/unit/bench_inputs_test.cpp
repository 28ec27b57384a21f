// The benchmark inputs of apps/bench/bench_inputs.hpp: a box made on its own holds exactly the
// values of that box of the whole tensor (threaded or not, in every dtype), and every element
// is a function of its seed and global index alone.
#include "apps/bench/bench_inputs.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"

namespace tessera::bench {
namespace {

/// Row-major strides of `shape`.
std::vector<int64_t> strides_of(const Shape& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

/// Expects `piece` to equal the box `box` of `full` (f32), element by element.
void expect_box_of(const Tensor& full, const Box& box, const Tensor& piece) {
  ASSERT_EQ(piece.shape(), box.shape());
  const std::vector<int64_t> global_stride = strides_of(full.shape());
  const Shape extents = box.shape();
  std::vector<int64_t> coord(extents.size(), 0);
  int64_t mismatches = 0;
  for (int64_t k = 0; k < piece.numel(); ++k) {
    int64_t flat = 0;
    for (size_t d = 0; d < coord.size(); ++d) flat += (box.lo[d] + coord[d]) * global_stride[d];
    mismatches += piece.data<float>()[k] != full.data<float>()[flat];
    for (size_t d = coord.size(); d-- > 0;) {
      if (++coord[d] < extents[d]) break;
      coord[d] = 0;
    }
  }
  EXPECT_EQ(mismatches, 0) << "box " << box.str();
}

TEST(BenchInputs, BoxEqualsSliceOfWholeTensor) {
  struct Case {
    Shape shape;
    Box box;
  };
  const std::vector<Case> cases{
      {{7}, {{2}, {6}}},
      {{3, 5, 11}, {{0, 0, 0}, {3, 5, 11}}},
      {{3, 5, 11}, {{1, 2, 3}, {3, 4, 10}}},
      {{2, 3, 4, 5, 6}, {{1, 0, 2, 1, 0}, {2, 3, 4, 4, 6}}},
      {{1, 4, 37, 33}, {{0, 1, 18, 0}, {1, 4, 37, 33}}},  // an S(2) shard
      {{1, 4, 37, 33}, {{0, 0, 5, 5}, {1, 4, 5, 9}}},     // empty
  };
  for (const Case& c : cases) {
    const Tensor full = random_tensor(c.shape, 11);
    expect_box_of(full, c.box, random_box(c.shape, c.box, 11));
  }
}

TEST(BenchInputs, ThreadedBoxEqualsSliceOfWholeTensor) {
  // Above the threading threshold, on several threads: chunks start mid-box.
  set_compute_threads(4);
  const Shape shape{2, 4, 301, 1003};
  const Tensor full = random_tensor(shape, 5);
  expect_box_of(full, {{0, 1, 50, 0}, {2, 4, 251, 1003}},
                random_box(shape, {{0, 1, 50, 0}, {2, 4, 251, 1003}}, 5));
  expect_box_of(full, {{1, 0, 0, 7}, {2, 4, 301, 1000}},
                random_box(shape, {{1, 0, 0, 7}, {2, 4, 301, 1000}}, 5));
  set_compute_threads(1);
  expect_box_of(full, Box::of_shape(shape), random_tensor(shape, 5));
}

TEST(BenchInputs, ElementDependsOnSeedAndGlobalIndexOnly) {
  const Tensor values = random_tensor({4, 9, 16}, 3);
  int64_t outside = 0, differ_from_other_seed = 0;
  for (int64_t i = 0; i < values.numel(); ++i) {
    const float value = values.data<float>()[i];
    EXPECT_EQ(value, input_value(3, static_cast<uint64_t>(i)));
    outside += value < -0.5f || value >= 0.5f;
    differ_from_other_seed += value != input_value(4, static_cast<uint64_t>(i));
  }
  EXPECT_EQ(outside, 0);
  EXPECT_GT(differ_from_other_seed, values.numel() * 9 / 10);
  // The same tensor seen with another shape of the same size holds the same flat values.
  const Tensor flat = random_tensor({values.numel()}, 3);
  EXPECT_EQ(std::memcmp(flat.data<float>(), values.data<float>(), values.numel() * sizeof(float)),
            0);
}

TEST(BenchInputs, LowPrecisionBoxIsTheF32BoxConverted) {
  const Shape shape{2, 3, 17, 19};
  const Box box{{0, 1, 4, 0}, {2, 3, 13, 19}};
  const Tensor f32 = random_box(shape, box, 9);
  for (DType dtype : {DType::bf16, DType::f16, DType::f64}) {
    const Tensor made = random_box(shape, box, 9, dtype);
    const Tensor converted = f32.to_dtype(dtype);
    ASSERT_EQ(made.dtype(), dtype);
    EXPECT_EQ(std::memcmp(made.raw_data(), converted.raw_data(), made.nbytes()), 0)
        << dtype_name(dtype);
  }
}

TEST(BenchInputs, BoxOutsideTheShapeIsRejected) {
  EXPECT_THROW(random_box({4, 5}, {{0, 0}, {4, 6}}, 1), InvalidArgument);
  EXPECT_THROW(random_box({4, 5}, {{0}, {4}}, 1), InvalidArgument);
  EXPECT_THROW(random_box({4, 5}, {{-1, 0}, {2, 5}}, 1), InvalidArgument);
}

TEST(BenchInputs, CountWrongCountsElementsBeyondTheTolerance) {
  // Several chunks of the threaded count; the changed elements sit in different chunks.
  const Shape shape{3, 100003};
  for (DType dtype : {DType::f32, DType::bf16}) {
    const Tensor reference = random_tensor(shape, 21, dtype);
    EXPECT_EQ(count_wrong(reference, reference, 1e-2).wrong, 0) << dtype_name(dtype);
    EXPECT_EQ(count_wrong(reference, reference, 1e-2).max_error, 0) << dtype_name(dtype);
    Tensor output = random_tensor(shape, 21);
    float* values = output.data<float>();
    for (int64_t i : {int64_t{0}, int64_t{70000}, int64_t{300008}}) values[i] += 0.5f;
    for (int64_t i : {int64_t{5}, int64_t{200000}}) values[i] += 1e-4f;  // within 1e-2
    const Mismatch mismatch = count_wrong(reference, output.to_dtype(dtype), 1e-2);
    EXPECT_EQ(mismatch.wrong, 3) << dtype_name(dtype);
    // The largest error: 0.5 added to one of the three, over 1 + |reference|.
    double largest = 0;
    for (int64_t i : {int64_t{0}, int64_t{70000}, int64_t{300008}}) {
      const double r = reference.to_dtype(DType::f64).data<double>()[i];
      const double o = output.to_dtype(dtype).to_dtype(DType::f64).data<double>()[i];
      largest = std::max(largest, std::fabs(o - r) / (1 + std::fabs(r)));
    }
    EXPECT_DOUBLE_EQ(mismatch.max_error, largest) << dtype_name(dtype);
  }
  // A NaN is wrong whatever the tolerance, and the largest error.
  Tensor output = random_tensor({4, 5}, 3);
  output.data<float>()[7] = NAN;
  const Mismatch nan = count_wrong(random_tensor({4, 5}, 3), output, 1e-2);
  EXPECT_EQ(nan.wrong, 1);
  EXPECT_TRUE(std::isinf(nan.max_error));
}

TEST(BenchInputs, CountWrongRejectsOutputsOfAnotherShapeOrDtype) {
  const Tensor reference = random_tensor({4, 5}, 1);
  EXPECT_THROW(count_wrong(reference, random_tensor({5, 4}, 1), 1e-4), InvalidArgument);
  EXPECT_THROW(count_wrong(reference, random_tensor({4, 5}, 1, DType::bf16), 1e-4),
               InvalidArgument);
}

}  // namespace
}  // namespace tessera::bench
