// HDF5 IO of cuda tensors (skipped, with the reason printed, when no GPU is visible): a device
// tensor is written and read through pinned host slabs, so each byte crosses between host and
// device exactly once (transfer_stats), whatever the slab size, and the values equal the cpu
// tensor's. Sharded reads, scatter, gather_write, write_sharded and checkpoints on 1, 2 and 4
// local ranks sharing one GPU leave pieces on the device and files equal to the cpu ones.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "core/backend/transfer.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"
#include "io/hdf5/checkpoint.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"
#include "tests/common/scoped_env.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/io_test_support.hpp"

namespace tessera {
namespace {

#define SKIP_WITHOUT_GPU()                                                                      \
  if (gpu::device_count() == 0)                                                                 \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): IO of device tensors " \
                  "needs a GPU"

using testing::ScopedEnv;

Tensor pattern(const Shape& shape) {
  Tensor tensor = Tensor::empty(shape, DType::f32);
  for (int64_t i = 0; i < tensor.numel(); ++i)
    tensor.data<float>()[i] = static_cast<float>((i * 7919) % 10007) - 5000.0f;
  return tensor;
}

TEST(IoGpu, DeviceTensorsCrossInSlabsOnceEachWay) {
  SKIP_WITHOUT_GPU();
  // One folder per process: memcheck and racecheck run this binary at the same time.
  const std::string dir =
      ::testing::TempDir() + "/tessera_io_gpu_" + std::to_string(static_cast<long>(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = dir + "/device.h5";
  const Tensor host = pattern({37, 19, 11});
  const Tensor device = host.to(Device::cuda(0));
  for (const char* slab_bytes : {"100", "4096", "1000000000"}) {
    ScopedEnv slabs("TESSERA_IO_SLAB_BYTES", slab_bytes);
    TransferStats before = transfer_stats();
    io::write_dataset(file, "/x", device);
    TransferStats after = transfer_stats();
    EXPECT_EQ(after.device_to_host_bytes - before.device_to_host_bytes, host.nbytes());
    EXPECT_EQ(after.host_to_device_bytes, before.host_to_device_bytes);
    EXPECT_TRUE(bitwise_equal(io::read_dataset(file, "/x"), host)) << slab_bytes;

    before = transfer_stats();
    const Tensor read = io::read_dataset(file, "/x", std::nullopt, Device::cuda(0));
    after = transfer_stats();
    EXPECT_EQ(read.device(), Device::cuda(0));
    EXPECT_EQ(after.host_to_device_bytes - before.host_to_device_bytes, host.nbytes());
    EXPECT_TRUE(bitwise_equal(read.to(Device::cpu()), host)) << slab_bytes;

    const Box box{{3, 2, 1}, {30, 19, 7}};
    const Tensor piece = io::read_hyperslab(file, "/x", box, DType::f32, Device::cuda(0));
    EXPECT_TRUE(bitwise_equal(piece.to(Device::cpu()), host.view_box(box).contiguous()));
    io::create_dataset(file, "/boxes", host.shape(), DType::f32);
    io::write_hyperslab(file, "/boxes", Box{{0, 0, 0}, {20, 19, 11}},
                        device.view_box(Box{{0, 0, 0}, {20, 19, 11}}));
    io::write_hyperslab(file, "/boxes", Box{{20, 0, 0}, {37, 19, 11}},
                        device.view_box(Box{{20, 0, 0}, {37, 19, 11}}));
    EXPECT_TRUE(bitwise_equal(io::read_dataset(file, "/boxes"), host)) << slab_bytes;
  }
  std::filesystem::remove_all(dir);
}

TEST(IoGpu, ShardedIoAndCheckpointsKeepPiecesOnTheDevice) {
  SKIP_WITHOUT_GPU();
  ScopedEnv device("TESSERA_DEVICE", "cuda:0");
  ScopedEnv slabs("TESSERA_IO_SLAB_BYTES", "512");
  const Tensor full = pattern({29, 13});
  for (int ranks : {1, 2, 4}) {
    run_local_ranks(ranks, [&](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "io_gpu", "sharded");
      const std::string input = dir + "/in.h5", output = dir + "/out.h5";
      if (comm->rank() == 0) io::write_dataset(input, "/u", full);
      comm->barrier();
      DeviceMesh mesh(comm, {comm->size()});
      const std::vector<Placement> rows{Placement::shard(0)};
      const ShardTensor read = io::read_sharded(input, "/u", mesh, rows);
      const ShardTensor scattered = io::scatter(input, "/u", mesh, rows, {}, 0, 256);
      for (const ShardTensor* t : {&read, &scattered}) {
        EXPECT_EQ(t->to_local().device(), Device::cuda(0));
        EXPECT_TRUE(bitwise_equal(t->to_local().to(Device::cpu()),
                                  full.view_box(t->local_box()).contiguous()));
      }
      io::gather_write(scattered, output, "/gathered", comm->size() - 1, 256);
      io::write_sharded(read, output, "/turns", /*collective=*/false);
      io::save_checkpoint(dir + "/ckpt.h5", {{"u", read}}, 0, 256);
      const auto loaded = io::load_checkpoint(dir + "/ckpt.h5", mesh);
      ASSERT_EQ(loaded.size(), 1u);
      EXPECT_EQ(loaded[0].second.to_local().device(), Device::cuda(0));
      EXPECT_TRUE(bitwise_equal(loaded[0].second.to_local().to(Device::cpu()),
                                read.to_local().to(Device::cpu())));
      if (comm->rank() == 0) {
        EXPECT_TRUE(bitwise_equal(io::read_dataset(output, "/gathered"), full));
        EXPECT_TRUE(bitwise_equal(io::read_dataset(output, "/turns"), full));
      }
      comm->barrier();
      testing::remove_test_dir(*comm, dir);
    });
  }
}

}  // namespace
}  // namespace tessera
