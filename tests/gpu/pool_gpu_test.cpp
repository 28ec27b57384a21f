// The pooling cuda kernels on a GPU (skipped, with the reason printed, when none is visible):
//  - every PyTorch fixture (tests/fixtures/pool) through ops::max_pool / ops::avg_pool on cuda
//    tensors in f64, forward and gx within 1e-10 of PyTorch, max_pool's indices exactly;
//  - max_pool's indices sharded on cuda equal the cpu's on one rank;
//  - the random cases of the cpu sweep (tests/dist/pool_cases.hpp) sharded over 1, 2 and 4
//    local ranks sharing the GPU equal the cpu op on one rank: f64 within 1e-12, f32 within 1e-5
//    of the largest value; f16 and bf16 run and match within their roundoff scale.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/gpu_runtime.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/op_cases.hpp"
#include "tests/dist/pool_cases.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;
const Device kGpu = Device::cuda(0);

#define SKIP_WITHOUT_GPU()                                                                  \
  if (gpu::device_count() == 0)                                                             \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the pooling cuda " \
                  "kernel tests need a GPU"

/// y and dx (full, f64 on the cpu) of a case on `mesh`, x in `dtype` on `device`, laid out as
/// the case says (`sharded`) or replicated.
std::vector<Tensor> run_case(const testing::PoolCase& c, const DeviceMesh& mesh, const Tensor& x,
                             const Tensor& gy, DType dtype, Device device, bool sharded) {
  return testing::forward_and_grad_on([&](const ShardTensor& xs) { return testing::pool(c, xs); },
                                      mesh, x, gy, c.placements, c.extents, sharded, dtype, device);
}

TEST(PoolGpu, FixturesMatchPyTorchOnCuda) {
  SKIP_WITHOUT_GPU();
  const std::string dir = testing::fixture_dir("pool");
  const Json manifest = testing::read_manifest(dir);
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    for (const Json& fixture : manifest["cases"]) {
      testing::PoolCase c;
      c.max = fixture["op"] == "max_pool";
      c.x_shape = fixture["x_shape"].get<Shape>();
      c.options.kernel_size = fixture["kernel_size"].get<std::vector<int64_t>>();
      c.options.stride = fixture["stride"].get<std::vector<int64_t>>();
      c.options.padding = fixture["padding"].get<std::vector<int64_t>>();
      c.options.dilation = fixture["dilation"].get<std::vector<int64_t>>();
      c.options.ceil_mode = fixture["ceil_mode"];
      c.options.count_include_pad = fixture["count_include_pad"];
      c.options.divisor_override = fixture["divisor_override"];
      const Shape y_shape = fixture["y_shape"].get<Shape>();
      const Json& files = fixture["files"];
      const auto result =
          run_case(c, mesh, testing::read_fixture(dir, files["x"], c.x_shape),
                   testing::read_fixture(dir, files["gy"], y_shape), DType::f64, kGpu, false);
      EXPECT_LT(max_abs_diff(result[0], testing::read_fixture(dir, files["y"], y_shape)), 1e-10)
          << fixture["name"];
      EXPECT_LT(max_abs_diff(result[1], testing::read_fixture(dir, files["gx"], c.x_shape)), 1e-10)
          << fixture["name"];
      if (!c.max) continue;
      // The indices (return_indices=True) exactly.
      const ShardTensor x =
          ShardTensor::distribute(testing::read_fixture(dir, files["x"], c.x_shape).to(kGpu), mesh,
                                  {Placement::replicate()});
      const Tensor indices = ops::max_pool_with_indices(x, c.options)
                                 .second.full_tensor()
                                 .to(Device::cpu())
                                 .to_dtype(DType::f64);
      EXPECT_EQ(max_abs_diff(indices, testing::read_fixture(dir, files["indices"], y_shape)), 0.0)
          << fixture["name"];
    }
  });
}

TEST(PoolGpu, ShardedOnOneTwoAndFourLocalRanksMatchesTheCpuOnOneRank) {
  SKIP_WITHOUT_GPU();
  testing::expect_cuda_sweep_matches_cpu(
      63, kGpu,
      [](const std::vector<int>& mesh, testing::CaseRng& rng) {
        return testing::random_pool_case(mesh, rng);
      },
      [](const Shape& shape, testing::CaseRng& rng) { return testing::random_input(shape, rng); },
      [](const auto& c, const ShardTensor& x) { return testing::pool(c, x); });
}

// max_pool's indices on cuda, x sharded over 1, 2 and 4 local ranks sharing the GPU, in f64 and
// f32: exactly the cpu's on one rank (the same windows, the same first maximum).
TEST(PoolGpu, MaxPoolIndicesShardedOnCudaEqualTheCpuOnOneRank) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh mesh(comm, {world});
      auto self = comm->split(comm->rank(), 0);
      DeviceMesh single(self, {1});
      int cases = 0;
      for (int index = 0; cases < 12; ++index) {
        testing::CaseRng rng(testing::case_seed(69, world, 0, index));
        const testing::PoolCase c = testing::random_pool_case(mesh.shape(), rng);
        if (!c.max) continue;
        ++cases;
        const Tensor x = testing::random_input(c.x_shape, rng);
        const Tensor expected =
            ops::max_pool_with_indices(ShardTensor::distribute(x, single, {Placement::replicate()}),
                                       c.options)
                .second.full_tensor();
        for (DType dtype : {DType::f64, DType::f32}) {
          const ShardTensor cpu = ShardTensor::distribute(x, mesh, c.placements, c.extents);
          const ShardTensor xs(cpu.to_local().to_dtype(dtype).to(kGpu), mesh, cpu.spec());
          const Tensor actual =
              ops::max_pool_with_indices(xs, c.options).second.full_tensor().to(Device::cpu());
          EXPECT_EQ(max_abs_diff(actual.to_dtype(DType::f64), expected.to_dtype(DType::f64)), 0.0)
              << dtype_name(dtype) << " on " << world << " rank(s): " << c.str();
        }
      }
    });
  }
}

}  // namespace
}  // namespace tessera
