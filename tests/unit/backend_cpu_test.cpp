// Unit tests of the cpu device backend (fill, accumulate, scale, convert, sum on strided views,
// every dtype), the host allocator's statistics, the transfer counters and the choice of a
// rank's default device. No Comm and no GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/backend/backend.hpp"
#include "core/backend/transfer.hpp"
#include "core/host_allocator.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"

namespace tessera {
namespace {

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                DType::i32, DType::i64, DType::u8};

/// A contiguous tensor whose element i holds (i * 7 + 3) % 50 (exact in every dtype).
Tensor pattern(const Shape& shape, DType dtype) {
  Tensor values = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < values.numel(); ++i) values.data<double>()[i] = (i * 7 + 3) % 50;
  return values.to_dtype(dtype);
}

double at(const Tensor& tensor, int64_t flat) {
  const Tensor dense = tensor.contiguous().to_dtype(DType::f64);
  return dense.data<double>()[flat];
}

class CpuBackendOnEveryDType : public ::testing::TestWithParam<DType> {};

TEST_P(CpuBackendOnEveryDType, FillOfAStridedViewTouchesOnlyTheView) {
  Tensor base = Tensor::zeros({4, 6}, GetParam());
  Tensor view = base.view_box(Box{{1, 2}, {3, 5}});
  cpu_backend().fill(strided_ref(view), GetParam(), 9, Stream{});
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t c = 0; c < 6; ++c)
      EXPECT_EQ(at(base, r * 6 + c), (r >= 1 && r < 3 && c >= 2 && c < 5) ? 9 : 0) << r << c;
}

TEST_P(CpuBackendOnEveryDType, AccumulateSumMaxMinOnTransposedSources) {
  const DType dtype = GetParam();
  const Tensor a = pattern({3, 4}, dtype);
  Tensor b_base = pattern({4, 3}, dtype);
  // A transposed view of b: strides (1, 3).
  Tensor b = b_base.view_box(Box{{0, 0}, {4, 3}});
  std::vector<double> bt(12);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j) bt[i * 4 + j] = at(b_base, j * 3 + i);
  const int64_t shape[2] = {3, 4};
  const int64_t strides[2] = {1, 3};
  const StridedRef transposed{b.raw_data(), shape, strides, 2};
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
    Tensor out = a.clone();
    cpu_backend().accumulate(strided_ref(out), transposed, dtype, op, Stream{});
    for (int64_t i = 0; i < 12; ++i) {
      const double x = at(a, i), y = bt[i];
      double expected = op == ReduceOp::sum   ? x + y
                        : op == ReduceOp::max ? std::max(x, y)
                                              : std::min(x, y);
      if (dtype == DType::u8) expected = std::fmod(expected, 256);
      EXPECT_EQ(at(out, i), expected) << reduce_op_name(op) << " element " << i;
    }
  }
}

TEST_P(CpuBackendOnEveryDType, ScaleByTwoDoublesEveryElement) {
  Tensor t = pattern({5, 3}, GetParam());
  cpu_backend().scale(strided_ref(t), GetParam(), 2.0, Stream{});
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(at(t, i), 2 * ((i * 7 + 3) % 50));
}

TEST_P(CpuBackendOnEveryDType, SumOfAPatternIsExact) {
  const Tensor t = pattern({7, 5}, GetParam());
  double expected = 0;
  for (int64_t i = 0; i < 35; ++i) expected += (i * 7 + 3) % 50;
  EXPECT_EQ(cpu_backend().sum(t.raw_data(), 35, GetParam(), Stream{}), expected);
}

TEST_P(CpuBackendOnEveryDType, ConvertRoundTripsThroughF64) {
  const Tensor t = pattern({6}, GetParam());
  Tensor wide = Tensor::empty({6}, DType::f64);
  cpu_backend().convert(wide.raw_data(), DType::f64, t.raw_data(), GetParam(), 6, Stream{});
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(wide.data<double>()[i], (i * 7 + 3) % 50);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, CpuBackendOnEveryDType, ::testing::ValuesIn(all_dtypes),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(BackendFor, CpuTensorsUseTheCpuBackend) {
  EXPECT_EQ(&backend_for(Device::cpu()), &cpu_backend());
  EXPECT_EQ(backend_for(Device::cuda(0)).name(), "cuda");
}

TEST(HostAllocatorStats, InUseGrowsAndShrinksWithTensorsAndPeakStays) {
  const AllocatorStats before = host_allocator_stats();
  size_t during = 0;
  {
    const Tensor big = Tensor::empty({1 << 20}, DType::f32);  // 4 MiB
    during = host_allocator_stats().in_use;
    EXPECT_GE(during, before.in_use + (size_t{4} << 20));
  }
  const AllocatorStats after = host_allocator_stats();
  EXPECT_EQ(after.in_use, before.in_use);
  EXPECT_GE(after.peak_in_use, during);
}

TEST(HostAllocatorStats, ReleasedBlocksAreReusedWithoutSystemAllocations) {
  { const Tensor warm = Tensor::empty({300000}, DType::f32); }
  const uint64_t raw = host_allocator_stats().raw_allocations;
  for (int i = 0; i < 10; ++i) {
    const Tensor again = Tensor::empty({300000}, DType::f32);
  }
  EXPECT_EQ(host_allocator_stats().raw_allocations, raw);
}

TEST(HostAllocator, BlocksOfTwoMibAndMoreStartOnAHugePageBoundaryAndHoldTheirBytes) {
  // Large blocks are placed for transparent huge pages (unless TESSERA_HOST_HUGE_PAGES=0); every
  // block stays 64-byte aligned and usable to its last byte, and a released one is handed out
  // again.
  const char* setting = std::getenv("TESSERA_HOST_HUGE_PAGES");
  const bool huge = setting == nullptr || std::string(setting) != "0";
  for (const size_t bytes : {size_t{100} << 10, (size_t{2} << 20) - 64, size_t{2} << 20,
                             (size_t{3} << 20) + 1, size_t{14} << 20}) {
    void* block = host_allocate(bytes, "test");
    const auto address = reinterpret_cast<uintptr_t>(block);
    EXPECT_EQ(address % 64, 0u) << bytes;
    if (huge && bytes >= (size_t{2} << 20)) {
      EXPECT_EQ(address % (size_t{2} << 20), 0u) << bytes;
    }
    std::memset(block, 0x5a, bytes);
    const auto* last = static_cast<const unsigned char*>(block) + bytes - 1;
    EXPECT_EQ(*last, 0x5a) << bytes;
    host_release(block, bytes);
    void* again = host_allocate(bytes, "test");
    EXPECT_EQ(again, block) << bytes << ": a released block is reused";
    host_release(again, bytes);
  }
}

TEST(TransferStats, HostCopiesCountNothing) {
  const TransferStats before = transfer_stats();
  const Tensor a = pattern({100}, DType::f32);
  const Tensor b = a.clone();
  const Tensor c = a.to(Device::cpu());
  const TransferStats after = transfer_stats();
  EXPECT_EQ(after.host_to_device_bytes, before.host_to_device_bytes);
  EXPECT_EQ(after.device_to_host_bytes, before.device_to_host_bytes);
}

TEST(TransferStats, CountTransferSortsBytesByDirection) {
  const TransferStats before = transfer_stats();
  count_transfer(Device::cuda(0), Device::cpu(), 100);
  count_transfer(Device::cpu(), Device::cuda(1), 30);
  count_transfer(Device::cuda(0), Device::cuda(1), 7);
  count_transfer(Device::cuda(0), Device::cuda(0), 1000);  // within one device: not a transfer
  const TransferStats after = transfer_stats();
  EXPECT_EQ(after.host_to_device_bytes - before.host_to_device_bytes, 100u);
  EXPECT_EQ(after.device_to_host_bytes - before.device_to_host_bytes, 30u);
  EXPECT_EQ(after.device_to_device_bytes - before.device_to_device_bytes, 7u);
  EXPECT_EQ(after.host_to_device_copies - before.host_to_device_copies, 1u);
}

TEST(DefaultRankDevice, CpuUnlessAsked) {
  EXPECT_EQ(default_rank_device("", 3, 8), Device::cpu());
  EXPECT_EQ(default_rank_device("cpu", 3, 8), Device::cpu());
}

TEST(DefaultRankDevice, CudaSpreadsLocalRanksOverTheVisibleDevices) {
  EXPECT_EQ(default_rank_device("cuda", 0, 2), Device::cuda(0));
  EXPECT_EQ(default_rank_device("cuda", 1, 2), Device::cuda(1));
  EXPECT_EQ(default_rank_device("cuda", 2, 2), Device::cuda(0));
  EXPECT_EQ(default_rank_device("cuda", 3, 1), Device::cuda(0));  // four ranks share one GPU
}

TEST(DefaultRankDevice, ExplicitIndexIsKeptAndChecked) {
  EXPECT_EQ(default_rank_device("cuda:1", 0, 2), Device::cuda(1));
  EXPECT_THROW(default_rank_device("cuda:2", 0, 2), InvalidArgument);
  EXPECT_THROW(default_rank_device("cuda", 0, 0), InvalidArgument);
  EXPECT_THROW(default_rank_device("gpu", 0, 1), InvalidArgument);
}

TEST(RankContext, CpuContextHasNoStreamsAndOrderingIsANoOp) {
  RankContext& context = current_rank_context();
  EXPECT_TRUE(context.device().is_cpu());
  EXPECT_EQ(context.compute().handle, nullptr);
  EXPECT_EQ(compute_stream_for(Device::cpu()).handle, nullptr);
  order_after(context.comm(), context.compute());  // must not throw on cpu
  synchronize(context.compute());
}

TEST(RankContext, ScopeInstallsAndRestoresTheThreadsContext) {
  auto mine = std::make_shared<RankContext>(Device::cpu());
  {
    RankContextScope scope(mine);
    EXPECT_EQ(&current_rank_context(), mine.get());
  }
  EXPECT_NE(&current_rank_context(), mine.get());
}

TEST(CudaWithoutAGpu, AskingForADeviceThatDoesNotExistFailsClearly) {
  // In a build without CUDA or on a machine without a GPU, a cuda tensor cannot be made.
  if (gpu::device_count() > 0) GTEST_SKIP() << "a GPU is present";
  try {
    Tensor::empty({4}, DType::f32, Device::cuda(0));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("cuda"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace tessera
