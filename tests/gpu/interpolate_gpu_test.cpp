// The interpolate cuda kernels on a GPU (skipped, with the reason printed, when none is visible):
//  - every PyTorch fixture (tests/fixtures/interpolate) through ops::interpolate on cuda tensors
//    in f64, forward and gx within 1e-10 of PyTorch;
//  - the random cases of the cpu sweep (tests/dist/interpolate_cases.hpp) sharded over 1, 2 and
//    4 local ranks sharing the GPU equal the cpu op on one rank: f64 within 1e-12 (the backward's
//    atomic adds sum in another order), f32 within 1e-5; f16 and bf16 within their roundoff.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/gpu_runtime.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/interpolate_cases.hpp"
#include "tests/dist/op_cases.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;
const Device kGpu = Device::cuda(0);

#define SKIP_WITHOUT_GPU()                                                                      \
  if (gpu::device_count() == 0)                                                                 \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the interpolate cuda " \
                  "kernel tests need a GPU"

/// y and dx (full, f64 on the cpu) of a case on `mesh`, x in `dtype` on `device`, laid out as
/// the case says (`sharded`) or replicated.
std::vector<Tensor> run_case(const testing::InterpolateCase& c, const DeviceMesh& mesh,
                             const Tensor& x, const Tensor& gy, DType dtype, Device device,
                             bool sharded) {
  return testing::forward_and_grad_on(
      [&](const ShardTensor& xs) { return testing::interpolate(c, xs); }, mesh, x, gy, c.placements,
      c.extents, sharded, dtype, device);
}

TEST(InterpolateGpu, FixturesMatchPyTorchOnCuda) {
  SKIP_WITHOUT_GPU();
  const std::string dir = testing::fixture_dir("interpolate");
  const Json manifest = testing::read_manifest(dir);
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    for (const Json& fixture : manifest["cases"]) {
      testing::InterpolateCase c;
      c.x_shape = fixture["x_shape"].get<Shape>();
      c.options.size = fixture["size"].get<std::vector<int64_t>>();
      c.options.scale_factor = fixture["scale_factor"].get<std::vector<double>>();
      c.options.mode = fixture["mode"];
      if (!fixture["align_corners"].is_null()) c.options.align_corners = fixture["align_corners"];
      c.options.recompute_scale_factor = fixture["recompute_scale_factor"];
      const Shape y_shape = fixture["y_shape"].get<Shape>();
      const Json& files = fixture["files"];
      const auto result =
          run_case(c, mesh, testing::read_fixture(dir, files["x"], c.x_shape),
                   testing::read_fixture(dir, files["gy"], y_shape), DType::f64, kGpu, false);
      EXPECT_LT(max_abs_diff(result[0], testing::read_fixture(dir, files["y"], y_shape)), 1e-10)
          << fixture["name"];
      EXPECT_LT(max_abs_diff(result[1], testing::read_fixture(dir, files["gx"], c.x_shape)), 1e-10)
          << fixture["name"];
    }
  });
}

TEST(InterpolateGpu, ShardedOnOneTwoAndFourLocalRanksMatchesTheCpuOnOneRank) {
  SKIP_WITHOUT_GPU();
  testing::expect_cuda_sweep_matches_cpu(
      75, kGpu,
      [](const std::vector<int>& mesh, testing::CaseRng& rng) {
        return testing::random_interpolate_case(mesh, rng);
      },
      [](const Shape& shape, testing::CaseRng& rng) {
        return testing::random_interpolate_input(shape, rng);
      },
      [](const auto& c, const ShardTensor& x) { return testing::interpolate(c, x); });
}

}  // namespace
}  // namespace tessera
