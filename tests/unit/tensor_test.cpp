// Unit tests of Tensor on the host: views (slice, view_box), copies (contiguous, clone,
// copy_from, pack_box/unpack_box), conversions (to_dtype), fill and the comparisons, on every
// dtype.
#include "core/tensor.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/errors.hpp"

namespace tessera {
namespace {

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                DType::i32, DType::i64, DType::u8};

/// A value of every element that fits every dtype exactly (an integer in [0, 100]).
double pattern_value(int64_t flat_index) {
  return static_cast<double>((flat_index * 37 + 11) % 101);
}

/// Converts `value` to element type T without going through Tensor::to_dtype.
template <typename T>
T element_of(double value) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
    return T(static_cast<float>(value));
  else
    return static_cast<T>(value);
}

/// Writes `value` at a multi-index of `tensor` (host, any strides).
void set_element(Tensor& tensor, const std::vector<int64_t>& index, double value) {
  int64_t offset = 0;
  for (int d = 0; d < tensor.ndim(); ++d) offset += index[d] * tensor.strides()[d];
  dispatch_dtype(tensor.dtype(), [&]<typename T>() {
    static_cast<T*>(tensor.raw_data())[offset] = element_of<T>(value);
  });
}

/// Calls fn(index) for every multi-index of `shape`, row-major.
template <typename Fn>
void for_each_index(const Shape& shape, Fn&& fn) {
  if (shape_numel(shape) == 0) return;
  std::vector<int64_t> index(shape.size(), 0);
  while (true) {
    fn(index);
    int d = static_cast<int>(shape.size()) - 1;
    for (; d >= 0; --d) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

int64_t flat_index(const std::vector<int64_t>& index, const Shape& shape) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return flat;
}

/// A contiguous tensor whose element at row-major position i holds pattern_value(i).
Tensor pattern_tensor(const Shape& shape, DType dtype) {
  Tensor tensor = Tensor::empty(shape, dtype);
  for_each_index(shape, [&](const std::vector<int64_t>& index) {
    set_element(tensor, index, pattern_value(flat_index(index, shape)));
  });
  return tensor;
}

class TensorOnEveryDType : public ::testing::TestWithParam<DType> {};

TEST_P(TensorOnEveryDType, SliceSharesStorageAndShiftsIndices) {
  const Tensor tensor = pattern_tensor({3, 4, 5}, GetParam());
  Tensor middle = tensor.slice(1, 1, 3);
  EXPECT_EQ(middle.shape(), (Shape{3, 2, 5}));
  EXPECT_FALSE(middle.is_contiguous());
  for_each_index(middle.shape(), [&](const std::vector<int64_t>& index) {
    EXPECT_EQ(middle.item_as_double(index),
              tensor.item_as_double({index[0], index[1] + 1, index[2]}));
  });
  middle.fill(7);  // writes through the view
  EXPECT_EQ(tensor.item_as_double({2, 2, 4}), 7.0);
  EXPECT_EQ(tensor.item_as_double({2, 3, 4}), pattern_value(2 * 20 + 3 * 5 + 4));
  // A slice of the leading dim stays contiguous.
  EXPECT_TRUE(tensor.slice(0, 1, 2).is_contiguous());
}

TEST_P(TensorOnEveryDType, ViewBoxMatchesElementwiseIndexing) {
  const Tensor tensor = pattern_tensor({4, 5, 6}, GetParam());
  const Box box{{1, 0, 2}, {3, 4, 5}};
  const Tensor view = tensor.view_box(box);
  EXPECT_EQ(view.shape(), box.shape());
  for_each_index(view.shape(), [&](const std::vector<int64_t>& index) {
    EXPECT_EQ(view.item_as_double(index),
              tensor.item_as_double({index[0] + 1, index[1], index[2] + 2}));
  });
  // A view of a view composes the offsets.
  const Tensor inner = view.view_box(Box{{1, 1, 1}, {2, 3, 3}});
  EXPECT_EQ(inner.item_as_double({0, 1, 1}), tensor.item_as_double({2, 2, 4}));
}

TEST_P(TensorOnEveryDType, ContiguousCopiesOnlyNonContiguousViews) {
  const Tensor tensor = pattern_tensor({3, 4}, GetParam());
  EXPECT_EQ(tensor.contiguous().raw_data(), tensor.raw_data());
  const Tensor view = tensor.slice(1, 1, 4);
  const Tensor packed = view.contiguous();
  EXPECT_TRUE(packed.is_contiguous());
  EXPECT_NE(packed.raw_data(), view.raw_data());
  EXPECT_EQ(packed.strides(), (std::vector<int64_t>{3, 1}));
  EXPECT_TRUE(bitwise_equal(packed, view));
}

TEST_P(TensorOnEveryDType, CloneIsADeepCopy) {
  const Tensor tensor = pattern_tensor({2, 3, 2}, GetParam());
  Tensor copy = tensor.clone();
  EXPECT_TRUE(bitwise_equal(copy, tensor));
  EXPECT_NE(copy.raw_data(), tensor.raw_data());
  copy.fill(1);
  EXPECT_EQ(tensor.item_as_double({0, 0, 0}), pattern_value(0));
  // Cloning a strided view gives a contiguous tensor with the view's values.
  const Tensor view_copy = tensor.slice(2, 1, 2).clone();
  EXPECT_TRUE(view_copy.is_contiguous());
  EXPECT_EQ(view_copy.item_as_double({1, 2, 0}), tensor.item_as_double({1, 2, 1}));
}

TEST_P(TensorOnEveryDType, PackBoxWritesRowMajorAndUnpackBoxRestoresIt) {
  const DType dtype = GetParam();
  const Tensor tensor = pattern_tensor({4, 3, 5}, dtype);
  const Box box{{1, 1, 0}, {3, 3, 4}};
  std::vector<std::byte> buffer(static_cast<size_t>(box.volume()) * dtype_size(dtype));
  tensor.pack_box(box, buffer.data());
  // The buffer is the box in row-major order.
  const Tensor packed = Tensor::empty(box.shape(), dtype);
  std::memcpy(packed.raw_data(), buffer.data(), buffer.size());
  for_each_index(box.shape(), [&](const std::vector<int64_t>& index) {
    EXPECT_EQ(packed.item_as_double(index),
              tensor.item_as_double({index[0] + 1, index[1] + 1, index[2]}));
  });
  Tensor target = Tensor::zeros({4, 3, 5}, dtype);
  target.unpack_box(box, buffer.data());
  EXPECT_TRUE(bitwise_equal(target.view_box(box), tensor.view_box(box)));
  for_each_index(target.shape(), [&](const std::vector<int64_t>& index) {
    const bool inside =
        index[0] >= 1 && index[0] < 3 && index[1] >= 1 && index[1] < 3 && index[2] < 4;
    if (!inside) {
      EXPECT_EQ(target.item_as_double(index), 0.0);
    }
  });
  // Packing from a strided view: box coordinates are the view's own.
  const Tensor view = tensor.slice(2, 1, 5);
  std::vector<std::byte> from_view(static_cast<size_t>(6) * dtype_size(dtype));
  view.pack_box(Box{{0, 0, 1}, {2, 1, 4}}, from_view.data());
  Tensor unpacked = Tensor::zeros({2, 1, 3}, dtype);
  unpacked.unpack_box(Box::of_shape({2, 1, 3}), from_view.data());
  EXPECT_TRUE(bitwise_equal(unpacked, tensor.view_box(Box{{0, 0, 2}, {2, 1, 5}})));
}

TEST_P(TensorOnEveryDType, CopyFromBetweenNonContiguousViewsCopiesEveryElement) {
  const DType dtype = GetParam();
  const Tensor source_base = pattern_tensor({5, 6, 4}, dtype);
  const Tensor source = source_base.view_box(Box{{1, 0, 1}, {4, 6, 3}});  // strided
  Tensor destination_base = Tensor::zeros({3, 8, 6}, dtype);
  Tensor destination = destination_base.view_box(Box{{0, 1, 2}, {3, 7, 4}});  // strided
  ASSERT_FALSE(source.is_contiguous());
  ASSERT_FALSE(destination.is_contiguous());
  destination.copy_from(source);
  EXPECT_TRUE(bitwise_equal(destination, source));
  // Elements outside the destination view stay zero.
  EXPECT_EQ(destination_base.item_as_double({0, 0, 2}), 0.0);
  EXPECT_EQ(destination_base.item_as_double({2, 7, 3}), 0.0);
  EXPECT_EQ(destination_base.item_as_double({1, 3, 1}), 0.0);
  EXPECT_EQ(destination_base.item_as_double({1, 3, 4}), 0.0);
  EXPECT_EQ(destination_base.item_as_double({1, 3, 3}), source_base.item_as_double({2, 2, 2}));
}

TEST_P(TensorOnEveryDType, FillSetsEveryElementOfTheViewAndNothingElse) {
  Tensor tensor = Tensor::zeros({4, 4}, GetParam());
  Tensor column = tensor.slice(1, 2, 3);
  column.fill(5);
  for_each_index(tensor.shape(), [&](const std::vector<int64_t>& index) {
    EXPECT_EQ(tensor.item_as_double(index), index[1] == 2 ? 5.0 : 0.0);
  });
}

TEST_P(TensorOnEveryDType, BitwiseEqualComparesValuesNotStrides) {
  const DType dtype = GetParam();
  const Tensor tensor = pattern_tensor({3, 4}, dtype);
  const Tensor view = tensor.slice(1, 0, 2);
  EXPECT_TRUE(bitwise_equal(view, view.clone()));
  Tensor changed = tensor.clone();
  set_element(changed, {2, 3}, pattern_value(11) + 1);
  EXPECT_FALSE(bitwise_equal(changed, tensor));
  EXPECT_FALSE(bitwise_equal(tensor, tensor.slice(0, 0, 2)));
  const DType other = dtype == DType::f32 ? DType::i32 : DType::f32;
  EXPECT_FALSE(bitwise_equal(tensor, Tensor::zeros({3, 4}, other)));
}

TEST_P(TensorOnEveryDType, ToDtypePreservesSmallIntegersToEveryDType) {
  const Tensor tensor = pattern_tensor({2, 5}, GetParam());
  EXPECT_EQ(tensor.to_dtype(GetParam()).raw_data(), tensor.raw_data());
  for (DType target : all_dtypes) {
    const Tensor converted = tensor.slice(1, 1, 4).to_dtype(target);
    EXPECT_EQ(converted.dtype(), target);
    EXPECT_EQ(converted.shape(), (Shape{2, 3}));
    for_each_index(converted.shape(), [&](const std::vector<int64_t>& index) {
      EXPECT_EQ(converted.item_as_double(index), tensor.item_as_double({index[0], index[1] + 1}))
          << dtype_name(GetParam()) << " -> " << dtype_name(target);
    });
  }
}

TEST_P(TensorOnEveryDType, MaxAbsDiffIsTheLargestElementwiseDifference) {
  const DType dtype = GetParam();
  const Tensor tensor = pattern_tensor({3, 3}, dtype);
  EXPECT_EQ(max_abs_diff(tensor, tensor.clone()), 0.0);
  Tensor changed = tensor.clone();
  set_element(changed, {1, 1}, tensor.item_as_double({1, 1}) + 3);
  set_element(changed, {2, 0}, tensor.item_as_double({2, 0}) + 1);
  EXPECT_EQ(max_abs_diff(tensor, changed), 3.0);
  EXPECT_EQ(max_abs_diff(changed, tensor), 3.0);
  EXPECT_THROW(max_abs_diff(tensor, tensor.slice(0, 0, 1)), InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, TensorOnEveryDType, ::testing::ValuesIn(all_dtypes),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

TEST(Tensor, DefaultIsAnEmptyF32Vector) {
  const Tensor tensor;
  EXPECT_EQ(tensor.shape(), (Shape{0}));
  EXPECT_EQ(tensor.dtype(), DType::f32);
  EXPECT_EQ(tensor.numel(), 0);
  EXPECT_EQ(tensor.raw_data(), nullptr);
  EXPECT_TRUE(tensor.device().is_cpu());
  EXPECT_TRUE(bitwise_equal(tensor, tensor.clone()));
}

TEST(Tensor, ZeroExtentTensorsCopyPackAndFillNothing) {
  for (DType dtype : all_dtypes) {
    Tensor tensor = Tensor::zeros({3, 0, 2}, dtype);
    EXPECT_EQ(tensor.numel(), 0);
    EXPECT_TRUE(tensor.is_contiguous());
    tensor.fill(1);
    const Tensor copy = tensor.clone();
    EXPECT_TRUE(bitwise_equal(copy, tensor));
    tensor.pack_box(Box::of_shape({3, 0, 2}), nullptr);
    tensor.unpack_box(Box::of_shape({3, 0, 2}), nullptr);
    EXPECT_EQ(tensor.to_dtype(DType::f64).numel(), 0);
    // An empty box of a non-empty tensor moves nothing either.
    const Tensor full = pattern_tensor({3, 2}, dtype);
    full.pack_box(Box{{1, 2}, {3, 2}}, nullptr);
    EXPECT_EQ(max_abs_diff(tensor, copy), 0.0);
  }
}

TEST(Tensor, ZeroDimTensorHoldsOneElement) {
  Tensor scalar = Tensor::zeros({}, DType::f64);
  EXPECT_EQ(scalar.numel(), 1);
  scalar.fill(2.5);
  EXPECT_EQ(scalar.item_as_double({}), 2.5);
  EXPECT_EQ(scalar.clone().item_as_double({}), 2.5);
  EXPECT_EQ(scalar.to_dtype(DType::f16).item_as_double({}), 2.5);
}

TEST(Tensor, ToDtypeRoundsLikeTheScalarConversions) {
  const std::vector<float> values{1.0f + std::ldexp(1.0f, -11), 65520.0f, 1.0f / 3.0f, -0.0f,
                                  1.0f + std::ldexp(1.0f, -8)};
  const Tensor tensor = Tensor::from_values<float>({5}, values);
  const Tensor halves = tensor.to_dtype(DType::f16);
  const Tensor bf16s = tensor.to_dtype(DType::bf16);
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(halves.data<Half>()[i].bits, Half(values[i]).bits) << i;
    EXPECT_EQ(bf16s.data<BFloat16>()[i].bits, BFloat16(values[i]).bits) << i;
  }
  // Float to integer truncates toward zero, as static_cast does.
  const Tensor ints =
      Tensor::from_values<double>({3}, std::vector<double>{2.7, -2.7, 100.0}).to_dtype(DType::i32);
  EXPECT_EQ(ints.data<int32_t>()[0], 2);
  EXPECT_EQ(ints.data<int32_t>()[1], -2);
  EXPECT_EQ(ints.data<int32_t>()[2], 100);
}

TEST(Tensor, MaxAbsDiffReportsNaN) {
  const Tensor a = Tensor::from_values<float>({2}, std::vector<float>{1.0f, 2.0f});
  const Tensor b = Tensor::from_values<float>(
      {2}, std::vector<float>{1.0f, std::numeric_limits<float>::quiet_NaN()});
  EXPECT_TRUE(std::isnan(max_abs_diff(a, b)));
  EXPECT_FALSE(bitwise_equal(a, b));
}

TEST(CopyStridedHost, StridedInnerDimsMoveEveryElementOfEverySize) {
  // A [5, 7] block read down the columns of a [7, 9] array of elements of 1, 2, 4, 8 and 3 bytes
  // (3: no machine word; the generic path) into a [5, 7] array whose inner stride is 2: every
  // element lands once, the gaps keep their bytes.
  for (size_t element : {size_t{1}, size_t{2}, size_t{4}, size_t{8}, size_t{3}}) {
    std::vector<unsigned char> source(7 * 9 * element), target(5 * 14 * element, 0xee);
    for (size_t b = 0; b < source.size(); ++b) source[b] = static_cast<unsigned char>(b * 7 + 1);
    const int64_t shape[] = {5, 7};
    const int64_t src_strides[] = {1, 9};  // column-major view: the inner dim is strided
    const int64_t dst_strides[] = {14, 2};
    copy_strided_host(target.data(), dst_strides, source.data(), src_strides, shape, 2, element);
    for (int64_t i = 0; i < 5; ++i)
      for (int64_t j = 0; j < 14; ++j)
        for (size_t b = 0; b < element; ++b) {
          const unsigned char got = target[(i * 14 + j) * element + b];
          if (j % 2 == 1) {
            EXPECT_EQ(got, 0xee) << "gap touched, element size " << element;
          } else {
            EXPECT_EQ(got, source[(i + (j / 2) * 9) * element + b])
                << "element size " << element << " at " << i << ", " << j / 2;
          }
        }
  }
}

TEST(Tensor, ArgumentsAreCheckedWithInvalidArgument) {
  EXPECT_THROW(Tensor::from_values<float>({2, 2}, std::vector<float>{1, 2, 3}), InvalidArgument);
  EXPECT_THROW(Tensor::empty({2, -1}, DType::f32), InvalidArgument);
  const Tensor tensor = Tensor::zeros({2, 3}, DType::i64);
  EXPECT_THROW(tensor.data<float>(), InvalidArgument);
  EXPECT_NO_THROW(tensor.data<int64_t>());
  EXPECT_THROW(tensor.slice(2, 0, 1), InvalidArgument);
  EXPECT_THROW(tensor.slice(1, 2, 4), InvalidArgument);
  EXPECT_THROW(tensor.slice(1, 2, 1), InvalidArgument);
  EXPECT_THROW(tensor.view_box(Box{{0, 0}, {3, 1}}), InvalidArgument);
  EXPECT_THROW(tensor.view_box(Box{{0}, {1}}), InvalidArgument);
  Tensor destination = Tensor::zeros({2, 3}, DType::f64);
  EXPECT_THROW(destination.copy_from(tensor), InvalidArgument);
  EXPECT_THROW(destination.copy_from(Tensor::zeros({3, 2}, DType::f64)), InvalidArgument);
  EXPECT_THROW(tensor.item_as_double({2, 0}), InvalidArgument);
}

TEST(Tensor, StrNamesDtypeShapeAndDevice) {
  EXPECT_EQ(Tensor::zeros({4, 5}, DType::bf16).str(), "bf16 (4, 5) cpu");
}

TEST(Device, ParseAcceptsCpuAndCudaIndices) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_EQ(Device::parse("cuda"), Device::cuda(0));
  EXPECT_EQ(Device::parse("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::cuda(2).str(), "cuda:2");
  EXPECT_THROW(Device::parse("cuda:x"), InvalidArgument);
  EXPECT_THROW(Device::parse("gpu"), InvalidArgument);
}

}  // namespace
}  // namespace tessera
