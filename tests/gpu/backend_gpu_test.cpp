// GPU tests of the cuda backend: every call (copy, fill, accumulate, scale, convert, sum) on
// random data of every dtype and on dense, boxed, transposed, broadcast and 0-d layouts, checked
// against the cpu backend on the same bytes; and the caching allocator on a real device. Each
// test skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/dtype.hpp"
#include "core/gpu_runtime.hpp"

namespace tessera {
namespace {

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                DType::i32, DType::i64, DType::u8};
constexpr ReduceOp all_reduce_ops[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min,
                                       ReduceOp::prod};

/// Random elements of `dtype`: reals in [-4, 4) for floating dtypes, integers in [-60, 60]
/// ([0, 60] for u8) otherwise.
std::vector<unsigned char> random_elements(DType dtype, int64_t count, std::mt19937& random) {
  std::vector<unsigned char> bytes(static_cast<size_t>(count) * dtype_size(dtype));
  std::uniform_real_distribution<double> real(-4.0, 4.0);
  std::uniform_int_distribution<int> integer(dtype == DType::u8 ? 0 : -60, 60);
  dispatch_dtype(dtype, [&]<typename T>() {
    T* out = reinterpret_cast<T*>(bytes.data());
    for (int64_t i = 0; i < count; ++i) {
      const double value = is_floating(dtype) ? real(random) : integer(random);
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
        out[i] = T(static_cast<float>(value));
      else
        out[i] = static_cast<T>(value);
    }
  });
  return bytes;
}

/// Element `i` of `bytes` as a double.
double element_at(DType dtype, const std::vector<unsigned char>& bytes, size_t i) {
  return dispatch_dtype(dtype, [&]<typename T>() {
    return static_cast<double>(static_cast<float>(reinterpret_cast<const T*>(bytes.data())[i]));
  });
}

/// Relative tolerance of one rounding in `dtype` (0: integers compare exactly).
double rounding_of(DType dtype) {
  switch (dtype) {
    case DType::f64: return 1e-15;
    case DType::f32: return 1e-6;
    case DType::f16: return 1e-3;
    case DType::bf16: return 8e-3;
    default: return 0.0;
  }
}

/// Expects the same bytes (`exact`) or the same values up to one rounding of `dtype`.
void expect_same(DType dtype, const std::vector<unsigned char>& gpu,
                 const std::vector<unsigned char>& cpu, bool exact, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  if (exact || !is_floating(dtype)) {
    EXPECT_EQ(gpu, cpu) << what;
    return;
  }
  const size_t count = gpu.size() / dtype_size(dtype);
  int reported = 0;
  for (size_t i = 0; i < count && reported < 5; ++i) {
    const double g = dtype == DType::f64 ? reinterpret_cast<const double*>(gpu.data())[i]
                                         : element_at(dtype, gpu, i);
    const double c = dtype == DType::f64 ? reinterpret_cast<const double*>(cpu.data())[i]
                                         : element_at(dtype, cpu, i);
    if (std::abs(g - c) > rounding_of(dtype) * std::max(1.0, std::abs(c))) {
      ADD_FAILURE() << what << ": element " << i << " is " << g << " on cuda, " << c << " on cpu";
      ++reported;
    }
  }
}

/// A strided layout over an allocation of `extent` elements.
struct Operand {
  std::vector<int64_t> strides;
  int64_t extent;
};

/// One layout of a test: the shape, the destination and the source.
struct LayoutCase {
  std::string name;
  std::vector<int64_t> shape;
  Operand dst, src;
};

std::vector<LayoutCase> layout_cases() {
  return {
      {"dense", {4, 33}, {{33, 1}, 132}, {{33, 1}, 132}},
      {"box_in_padded_array", {3, 5, 8}, {{60, 10, 1}, 180}, {{40, 8, 1}, 120}},
      {"box_with_16_byte_rows", {3, 5, 8}, {{80, 16, 1}, 240}, {{40, 8, 1}, 120}},
      {"transpose", {6, 7}, {{7, 1}, 42}, {{1, 6}, 42}},
      {"broadcast_source", {5, 4}, {{4, 1}, 20}, {{0, 1}, 4}},
      {"unit_dims", {1, 9, 1, 3}, {{100, 3, 50, 1}, 27}, {{0, 3, 0, 1}, 27}},
      {"scalar", {}, {{}, 1}, {{}, 1}},
  };
}

/// The cuda device and a stream of it, for the tests of one fixture.
class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpu::device_count() == 0)
      GTEST_SKIP() << "no CUDA device visible (built with CUDA " << (gpu::compiled() ? "on" : "off")
                   << ")";
    stream_ = Stream{Device::cuda(0), gpu::create_stream(0)};
    other_stream_ = Stream{Device::cuda(0), gpu::create_stream(0)};
  }
  void TearDown() override {
    // Blocks still held are released first: a release records an event on its stream, which
    // must still exist (recording on a destroyed stream crashes inside the driver).
    release_all();
    if (stream_.handle) gpu::destroy_stream(stream_.handle, 0);
    if (other_stream_.handle) gpu::destroy_stream(other_stream_.handle, 0);
    stream_ = Stream{};
    other_stream_ = Stream{};
  }

  /// Device memory holding `bytes` (uploaded before the call returns).
  void* upload(const std::vector<unsigned char>& bytes) {
    void* device = cuda_backend().allocate(bytes.size(), Device::cuda(0), stream_, "test");
    gpu::synchronize_stream(stream_.handle, 0);
    gpu::copy_bytes(device, bytes.data(), bytes.size());
    owned_.push_back({device, bytes.size()});
    return device;
  }
  /// The bytes at `device` once the stream's work is done.
  std::vector<unsigned char> download(const void* device, size_t bytes) {
    gpu::synchronize_stream(stream_.handle, 0);
    std::vector<unsigned char> host(bytes);
    gpu::copy_bytes(host.data(), device, bytes);
    return host;
  }
  void release_all() {
    for (auto [pointer, bytes] : owned_)
      cuda_backend().release(pointer, bytes, Device::cuda(0), stream_);
    owned_.clear();
  }

  Stream stream_, other_stream_;
  std::vector<std::pair<void*, size_t>> owned_;
  std::mt19937 random_{2024};
};

StridedRef ref_of(void* data, const LayoutCase& layout, const Operand& operand) {
  return {data, layout.shape.data(), operand.strides.data(), static_cast<int>(layout.shape.size())};
}

TEST_F(CudaBackendTest, CopyMatchesCpuOnEveryLayoutAndDtype) {
  for (DType dtype : all_dtypes) {
    for (const LayoutCase& layout : layout_cases()) {
      auto dst = random_elements(dtype, layout.dst.extent, random_);
      const auto src = random_elements(dtype, layout.src.extent, random_);
      void* dst_device = upload(dst);
      void* src_device = upload(src);
      cuda_backend().copy(ref_of(dst_device, layout, layout.dst),
                          ref_of(src_device, layout, layout.src), dtype_size(dtype), stream_);
      cpu_backend().copy(ref_of(dst.data(), layout, layout.dst),
                         ref_of(const_cast<unsigned char*>(src.data()), layout, layout.src),
                         dtype_size(dtype), Stream{});
      expect_same(dtype, download(dst_device, dst.size()), dst, true,
                  fmt::format("copy {} {}", dtype_name(dtype), layout.name));
    }
  }
}

TEST_F(CudaBackendTest, FillMatchesCpuOnEveryLayoutAndDtype) {
  for (DType dtype : all_dtypes) {
    for (const LayoutCase& layout : layout_cases()) {
      for (double value : {0.0, 1.0, -3.25, 42.0}) {
        if (dtype == DType::u8 && value < 0) continue;
        auto dst = random_elements(dtype, layout.dst.extent, random_);
        void* dst_device = upload(dst);
        cuda_backend().fill(ref_of(dst_device, layout, layout.dst), dtype, value, stream_);
        cpu_backend().fill(ref_of(dst.data(), layout, layout.dst), dtype, value, Stream{});
        expect_same(dtype, download(dst_device, dst.size()), dst, true,
                    fmt::format("fill {} {} with {}", dtype_name(dtype), layout.name, value));
      }
    }
  }
}

TEST_F(CudaBackendTest, AccumulateMatchesCpuForEveryOpLayoutAndDtype) {
  for (DType dtype : all_dtypes) {
    for (ReduceOp op : all_reduce_ops) {
      for (const LayoutCase& layout : layout_cases()) {
        auto dst = random_elements(dtype, layout.dst.extent, random_);
        const auto src = random_elements(dtype, layout.src.extent, random_);
        void* dst_device = upload(dst);
        void* src_device = upload(src);
        cuda_backend().accumulate(ref_of(dst_device, layout, layout.dst),
                                  ref_of(src_device, layout, layout.src), dtype, op, stream_);
        cpu_backend().accumulate(ref_of(dst.data(), layout, layout.dst),
                                 ref_of(const_cast<unsigned char*>(src.data()), layout, layout.src),
                                 dtype, op, Stream{});
        expect_same(
            dtype, download(dst_device, dst.size()), dst, false,
            fmt::format("accumulate {} {} {}", reduce_op_name(op), dtype_name(dtype), layout.name));
      }
      release_all();
    }
  }
}

TEST_F(CudaBackendTest, ScaleMatchesCpuOnEveryLayoutAndDtype) {
  for (DType dtype : all_dtypes) {
    for (const LayoutCase& layout : layout_cases()) {
      for (double factor : {0.5, -2.0, 3.0}) {
        if (dtype == DType::u8 && factor < 0) continue;
        auto dst = random_elements(dtype, layout.dst.extent, random_);
        void* dst_device = upload(dst);
        cuda_backend().scale(ref_of(dst_device, layout, layout.dst), dtype, factor, stream_);
        cpu_backend().scale(ref_of(dst.data(), layout, layout.dst), dtype, factor, Stream{});
        expect_same(dtype, download(dst_device, dst.size()), dst, false,
                    fmt::format("scale {} {} by {}", dtype_name(dtype), layout.name, factor));
      }
    }
    release_all();
  }
}

TEST_F(CudaBackendTest, ConvertMatchesCpuBetweenEveryPairOfDtypes) {
  const size_t count = 1000;
  for (DType from : all_dtypes) {
    const auto src = random_elements(from, count, random_);
    void* src_device = upload(src);
    for (DType to : all_dtypes) {
      // Negative values have no u8 image (the conversion is undefined on the host).
      if (to == DType::u8 && from != DType::u8) continue;
      std::vector<unsigned char> dst(count * dtype_size(to));
      void* dst_device = upload(dst);
      cuda_backend().convert(dst_device, to, src_device, from, count, stream_);
      cpu_backend().convert(dst.data(), to, src.data(), from, count, Stream{});
      expect_same(to, download(dst_device, dst.size()), dst, true,
                  fmt::format("convert {} to {}", dtype_name(from), dtype_name(to)));
    }
    release_all();
  }
}

TEST_F(CudaBackendTest, SumMatchesCpuAndIsDeterministic) {
  for (DType dtype : all_dtypes) {
    for (size_t count : {size_t{1}, size_t{1000}, size_t{100003}, size_t{3} << 20}) {
      const auto data = random_elements(dtype, static_cast<int64_t>(count), random_);
      void* device = upload(data);
      const double on_gpu = cuda_backend().sum(device, count, dtype, stream_);
      const double on_cpu = cpu_backend().sum(data.data(), count, dtype, Stream{});
      EXPECT_NEAR(on_gpu, on_cpu, 1e-10 * std::max(1.0, std::abs(on_cpu)))
          << dtype_name(dtype) << " x " << count;
      // The same order every time and on every stream: bit for bit.
      for (int repeat = 0; repeat < 3; ++repeat) {
        EXPECT_EQ(cuda_backend().sum(device, count, dtype, stream_), on_gpu);
        EXPECT_EQ(cuda_backend().sum(device, count, dtype, other_stream_), on_gpu);
      }
      release_all();
    }
  }
}

TEST_F(CudaBackendTest, SteadyStateAllocationReachesCudaMallocNoMore) {
  DeviceBackend& backend = cuda_backend();
  const size_t sizes[] = {100, 4096, size_t{3} << 20, 70000};
  uint64_t after_first = 0;
  for (int iteration = 0; iteration < 20; ++iteration) {
    std::vector<void*> blocks;
    for (size_t bytes : sizes)
      blocks.push_back(backend.allocate(bytes, Device::cuda(0), stream_, "test"));
    backend.fill(StridedRef{blocks[1], nullptr, nullptr, 0}, DType::f32, 1.0, stream_);
    for (size_t i = 0; i < blocks.size(); ++i)
      backend.release(blocks[i], sizes[i], Device::cuda(0), stream_);
    if (iteration == 0) after_first = backend.allocator_stats(Device::cuda(0)).raw_allocations;
  }
  EXPECT_EQ(backend.allocator_stats(Device::cuda(0)).raw_allocations, after_first);
  gpu::synchronize_stream(stream_.handle, 0);
}

TEST_F(CudaBackendTest, BlockReleasedOnOneStreamServesAnotherAfterItsWork) {
  DeviceBackend& backend = cuda_backend();
  void* block = backend.allocate(size_t{1} << 20, Device::cuda(0), stream_, "test");
  backend.release(block, size_t{1} << 20, Device::cuda(0), stream_);
  gpu::synchronize_stream(stream_.handle, 0);  // the release event has completed
  void* reused = backend.allocate(size_t{1} << 20, Device::cuda(0), other_stream_, "test");
  EXPECT_EQ(reused, block);
  backend.release(reused, size_t{1} << 20, Device::cuda(0), other_stream_);
  gpu::synchronize_stream(other_stream_.handle, 0);
}

TEST_F(CudaBackendTest, OutOfMemoryNamesTheDeviceAndSizes) {
  try {
    cuda_backend().allocate(size_t{1} << 50, Device::cuda(0), stream_, "conv");
    FAIL() << "a petabyte allocation succeeded";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("[conv] out of memory on cuda:0: asked 1.00 PiB"),
              std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace tessera
