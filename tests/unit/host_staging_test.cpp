// Unit tests of IO host staging (io/host_staging.hpp): the contiguous slabs of a row-major tensor
// cover it exactly, in memory order, each contiguous and within the size asked; cpu tensors are
// handed over in place (no copy, nothing counted as a transfer); bad ranges are refused.
#include "io/host_staging.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <vector>

#include "core/backend/transfer.hpp"
#include "core/errors.hpp"

namespace tessera::io {
namespace {

/// Checks contiguous_slabs(shape, element, limit): every box lies in the tensor, is contiguous
/// in memory (its byte range holds exactly its elements), within the limit (or one element),
/// and consecutive boxes tile the tensor's bytes in order.
void check_slabs(const Shape& shape, size_t element, size_t limit) {
  const std::vector<Box> slabs = contiguous_slabs(shape, element, limit);
  const size_t total = static_cast<size_t>(shape_numel(shape)) * element;
  size_t next = 0;
  const std::vector<int64_t> strides = contiguous_strides(shape);
  for (const Box& slab : slabs) {
    ASSERT_EQ(slab.ndim(), shape.size());
    for (size_t d = 0; d < shape.size(); ++d) {
      EXPECT_LE(0, slab.lo[d]);
      EXPECT_LT(slab.lo[d], slab.hi[d]);
      EXPECT_LE(slab.hi[d], shape[d]);
    }
    const ByteRange range = byte_range_of(slab, shape, element);
    EXPECT_EQ(range.offset, next) << slab.str();
    EXPECT_LE(range.bytes, std::max(limit, element)) << slab.str();
    // Contiguous: the last element's offset is the first's plus volume - 1.
    size_t last = 0;
    for (size_t d = 0; d < shape.size(); ++d)
      last += static_cast<size_t>((slab.hi[d] - 1) * strides[d]);
    EXPECT_EQ(last * element + element, range.offset + range.bytes) << slab.str();
    next = range.offset + range.bytes;
  }
  EXPECT_EQ(next, total);
}

TEST(HostStaging, SlabsTileEveryShapeContiguouslyWithinTheLimit) {
  std::mt19937_64 generator(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int ndim = 1 + static_cast<int>(generator() % 4);
    Shape shape;
    for (int d = 0; d < ndim; ++d) shape.push_back(1 + static_cast<int64_t>(generator() % 7));
    const size_t element = size_t{1} << (generator() % 4);
    const size_t limit = 1 + generator() % 200;
    check_slabs(shape, element, limit);
  }
}

TEST(HostStaging, SlabsAreRangesOfTheOutermostDimThatFits) {
  // 4 x 5 x 6 f32: one index of dim 0 is 120 bytes, of dim 1 24 bytes.
  EXPECT_EQ(contiguous_slabs({4, 5, 6}, 4, SIZE_MAX).size(), 1u);  // the whole tensor
  EXPECT_EQ(contiguous_slabs({1, 1}, 1, SIZE_MAX).size(), 1u);
  const std::vector<Box> rows = contiguous_slabs({4, 5, 6}, 4, 250);  // 2 indices of dim 0
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].lo, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(rows[0].hi, (std::vector<int64_t>{2, 5, 6}));
  const std::vector<Box> inner = contiguous_slabs({4, 5, 6}, 4, 50);  // 2 indices of dim 1
  ASSERT_EQ(inner.size(), 4u * 3u);
  EXPECT_EQ(inner[2].lo, (std::vector<int64_t>{0, 4, 0}));
  EXPECT_EQ(inner[2].hi, (std::vector<int64_t>{1, 5, 6}));
  EXPECT_EQ(contiguous_slabs({4, 5, 6}, 4, 1).size(), 120u);  // single elements
  EXPECT_TRUE(contiguous_slabs({4, 0, 6}, 4, 64).empty());
  EXPECT_EQ(contiguous_slabs({}, 8, 1).size(), 1u);  // a 0-d tensor is one slab
}

TEST(HostStaging, CpuTensorsAreHandedOverInPlaceWithoutTransfers) {
  Tensor tensor = Tensor::empty({6, 7}, DType::f32);
  for (int64_t i = 0; i < 42; ++i) tensor.data<float>()[i] = static_cast<float>(i);
  const std::vector<Box> slabs = contiguous_slabs(tensor.shape(), 4, 40);
  std::vector<ByteRange> ranges;
  for (const Box& slab : slabs) ranges.push_back(byte_range_of(slab, tensor.shape(), 4));
  const TransferStats before = transfer_stats();
  std::vector<float> seen;
  stream_to_host(
      tensor, ranges,
      [&](size_t k, const void* host) {
        EXPECT_EQ(host, static_cast<const char*>(tensor.raw_data()) + ranges[k].offset);
        const auto* values = static_cast<const float*>(host);
        seen.insert(seen.end(), values, values + ranges[k].bytes / 4);
      },
      "test");
  ASSERT_EQ(seen.size(), 42u);
  for (int i = 0; i < 42; ++i) EXPECT_EQ(seen[i], static_cast<float>(i));

  Tensor filled = Tensor::zeros({6, 7}, DType::f32);
  stream_from_host(
      filled, ranges,
      [&](size_t k, void* host) {
        auto* values = static_cast<float*>(host);
        for (size_t i = 0; i < ranges[k].bytes / 4; ++i)
          values[i] = static_cast<float>(ranges[k].offset / 4 + i);
      },
      "test");
  EXPECT_TRUE(bitwise_equal(filled, tensor));
  const TransferStats after = transfer_stats();
  EXPECT_EQ(after.host_to_device_bytes, before.host_to_device_bytes);
  EXPECT_EQ(after.device_to_host_bytes, before.device_to_host_bytes);
}

TEST(HostStaging, RangesOutsideTheTensorAndNonContiguousDestinationsAreRefused) {
  Tensor tensor = Tensor::zeros({4, 4}, DType::f32);
  const std::vector<ByteRange> outside{{60, 8}};
  EXPECT_THROW(stream_to_host(
                   tensor, outside, [](size_t, const void*) {}, "test"),
               Error);
  EXPECT_THROW(stream_from_host(
                   tensor, outside, [](size_t, void*) {}, "test"),
               Error);
  const Tensor strided = tensor.view_box(Box{{0, 0}, {4, 2}});
  const std::vector<ByteRange> first{{0, 4}};
  EXPECT_THROW(stream_from_host(
                   strided, first, [](size_t, void*) {}, "test"),
               Error);
}

TEST(HostStaging, SlabSizeComesFromTheEnvironment) {
  ::unsetenv("TESSERA_IO_SLAB_BYTES");
  EXPECT_EQ(io_slab_bytes(Device::cpu()), SIZE_MAX);
  EXPECT_EQ(io_slab_bytes(Device::cuda(0)), size_t{64} << 20);
  ::setenv("TESSERA_IO_SLAB_BYTES", "4096", 1);
  EXPECT_EQ(io_slab_bytes(Device::cpu()), 4096u);
  EXPECT_EQ(io_slab_bytes(Device::cuda(0)), 4096u);
  ::setenv("TESSERA_IO_SLAB_BYTES", "12x", 1);
  EXPECT_THROW(io_slab_bytes(Device::cpu()), Error);
  ::setenv("TESSERA_IO_SLAB_BYTES", "0", 1);
  EXPECT_THROW(io_slab_bytes(Device::cpu()), Error);
  ::unsetenv("TESSERA_IO_SLAB_BYTES");
}

}  // namespace
}  // namespace tessera::io
