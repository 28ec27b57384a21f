// The Gray-Scott simulation on a GPU (skipped, with the reason printed, when none is visible):
// the cuda step kernel equals the cpu step bit for bit (no fused multiply-add on either side),
// f32 and f64, for the whole run sharded over 1, 2 and 4 local ranks sharing the GPU.
#include <gtest/gtest.h>

#include <cstring>

#include "apps/sim/gray_scott.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"
#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

#define SKIP_WITHOUT_GPU()                                                                      \
  if (gpu::device_count() == 0)                                                                 \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the cuda step of the " \
                  "Gray-Scott simulation needs a GPU"

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()).contiguous(), y = b.to(Device::cpu()).contiguous();
  return x.shape() == y.shape() && x.dtype() == y.dtype() &&
         std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

TEST(GrayScottGpu, CudaRunEqualsCpuRunBitForBit) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::f32, DType::f64}) {
    sim::GrayScottConfig config;
    config.size = {19, 13, 33};
    config.dtype = dtype;
    constexpr int kSteps = 20;
    std::array<Tensor, 2> expected;
    run_local_ranks(1, [&](std::shared_ptr<Comm> comm) {  // cpu (TESSERA_DEVICE unset)
      sim::GrayScott cpu(DeviceMesh(comm, {1}), {Placement::replicate()}, {}, config);
      for (int s = 0; s < kSteps; ++s) cpu.step();
      expected = {cpu.field(0).to_local(), cpu.field(1).to_local()};
    });
    ::setenv("TESSERA_DEVICE", "cuda", 1);
    for (int world : {1, 2, 4}) {
      run_local_ranks(world, [&](std::shared_ptr<Comm> comm) {
        const DeviceMesh mesh(comm, {world});
        sim::GrayScott gpu(mesh, {Placement::shard(world == 4 ? 2 : 0)}, {}, config);
        for (int s = 0; s < kSteps; ++s) gpu.step();
        synchronize(current_rank_context().compute());
        const Box box = gpu.spec().local_box(mesh.coord());
        for (int species = 0; species < 2; ++species) {
          const Tensor mine = gpu.field(species).to_local();
          EXPECT_TRUE(mine.device().is_cuda());
          EXPECT_TRUE(same_bits(mine, expected[species].view_box(box)))
              << dtype_name(dtype) << " species " << species << " on " << world << " ranks";
        }
      });
    }
    ::unsetenv("TESSERA_DEVICE");
  }
}

}  // namespace
}  // namespace tessera
