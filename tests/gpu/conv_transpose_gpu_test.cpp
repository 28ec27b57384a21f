// The transposed conv on a GPU (cuDNN; skipped, with the reason printed, when none is visible):
//  - every PyTorch fixture (tests/fixtures/conv_transpose) on cuda tensors in f64, on 1 rank and
//    sharded unevenly over 2 local ranks: y, dx, dw, db within 1e-10 of PyTorch;
//  - the random cases of the cpu sweep (tests/dist/conv_cases.hpp) sharded over 1, 2 and 4 local
//    ranks sharing the GPU equal the cpu op on one rank: f64 within 1e-12 (integer inputs: every
//    sum is exact), f32 within 1e-5.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/autograd.hpp"
#include "core/gpu_runtime.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/conv_cases.hpp"
#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;
const Device kGpu = Device::cuda(0);

#define SKIP_WITHOUT_GPU()                                                                    \
  if (gpu::device_count() == 0)                                                               \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the conv_transpose " \
                  "cuda tests need a GPU"

/// y, dx, dw[, db] (full, f64 on the cpu) of `c` on `mesh` in `dtype` on `device`, x laid out as
/// the case says (`sharded`) or replicated.
std::vector<Tensor> run_case(const testing::ConvTransposeCase& c, const DeviceMesh& mesh,
                             const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& gy,
                             DType dtype, Device device, bool sharded) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  auto placed = [&](const ShardTensor& t) {
    return ShardTensor(t.to_local().to_dtype(dtype).to(device), t.mesh(), t.spec());
  };
  Tape tape;
  ShardTensor xs = placed(sharded ? ShardTensor::distribute(x, mesh, c.placements, c.extents)
                                  : ShardTensor::distribute(x, mesh, replicated));
  xs.set_requires_grad();
  ShardTensor ws = placed(ShardTensor::distribute(w, mesh, replicated));
  ws.set_requires_grad();
  std::optional<ShardTensor> bs;
  if (c.bias) bs = placed(ShardTensor::distribute(b, mesh, replicated)).set_requires_grad();
  const ShardTensor y = ops::conv_transpose(xs, ws, bs, c.options);
  const ShardTensor gys =
      placed(ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents));
  tape.backward(ops::sum(ops::mul(y, gys)));
  auto host = [](const ShardTensor& t) {
    return t.full_tensor().to(Device::cpu()).to_dtype(DType::f64);
  };
  std::vector<Tensor> results{host(y), host(*tape.grad(xs)), host(*tape.grad(ws))};
  if (c.bias) results.push_back(host(*tape.grad(*bs)));
  return results;
}

TEST(ConvTransposeGpu, FixturesMatchPyTorchOnCuda) {
  SKIP_WITHOUT_GPU();
  const std::string dir = testing::fixture_dir("conv_transpose");
  const Json manifest = testing::read_manifest(dir);
  for (int world : {1, 2}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh mesh(comm, {world});
      for (const Json& fixture : manifest["cases"]) {
        const Json& inputs = fixture["inputs"];
        const Json& attrs = fixture["attrs"];
        testing::ConvTransposeCase c;
        c.x_shape = inputs[0]["shape"].get<Shape>();
        c.w_shape = inputs[1]["shape"].get<Shape>();
        c.bias = inputs.size() == 3;
        c.options.stride = attrs["stride"].get<std::vector<int64_t>>();
        c.options.padding = attrs["padding"].get<std::vector<int64_t>>();
        c.options.output_padding = attrs["output_padding"].get<std::vector<int64_t>>();
        c.options.dilation = attrs["dilation"].get<std::vector<int64_t>>();
        c.options.groups = attrs["groups"];
        const int last = static_cast<int>(c.x_shape.size()) - 1;
        c.placements = {Placement::shard(last)};
        c.extents = {testing::lopsided(c.x_shape[last], world)};
        const Json& output = fixture["outputs"][0];
        const Shape y_shape = output["shape"].get<Shape>();
        const Tensor b =
            c.bias ? testing::read_fixture(dir, inputs[2]["file"], inputs[2]["shape"].get<Shape>())
                   : Tensor();
        const auto result =
            run_case(c, mesh, testing::read_fixture(dir, inputs[0]["file"], c.x_shape),
                     testing::read_fixture(dir, inputs[1]["file"], c.w_shape), b,
                     testing::read_fixture(dir, output["gy"], y_shape), DType::f64, kGpu, true);
        EXPECT_LT(max_abs_diff(result[0], testing::read_fixture(dir, output["file"], y_shape)),
                  1e-10)
            << fixture["name"] << " y on " << world << " rank(s)";
        for (size_t i = 0; i < inputs.size(); ++i)
          EXPECT_LT(
              max_abs_diff(result[1 + i], testing::read_fixture(dir, inputs[i]["grad"],
                                                                inputs[i]["shape"].get<Shape>())),
              1e-10)
              << fixture["name"] << " gradient of " << inputs[i]["name"] << " on " << world
              << " rank(s)";
      }
    });
  }
}

TEST(ConvTransposeGpu, ShardedOnOneTwoAndFourLocalRanksMatchesTheCpuOnOneRank) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      const auto meshes = testing::mesh_factorizations(comm->size());
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
        DeviceMesh mesh(comm, meshes[mesh_index]);
        for (int index = 0; index < testing::sweep_cases(12); ++index) {
          testing::CaseRng rng(testing::case_seed(73, world, static_cast<int>(mesh_index), index));
          const testing::ConvTransposeCase c =
              testing::random_conv_transpose_case(mesh.shape(), rng);
          const Tensor x = testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
          const Tensor w = testing::integer_tensor(c.w_shape, DType::f64, rng, -3, 3);
          const Tensor b =
              testing::integer_tensor({c.w_shape[1] * c.options.groups}, DType::f64, rng, -3, 3);
          const ShardTensor probe =
              ops::conv_transpose(ShardTensor::distribute(x, single, {Placement::replicate()}),
                                  ShardTensor::distribute(w, single, {Placement::replicate()}),
                                  std::nullopt, c.options);
          const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
          const auto expected = run_case(c, single, x, w, b, gy, DType::f64, Device::cpu(), false);
          for (DType dtype : {DType::f64, DType::f32}) {
            const auto actual = run_case(c, mesh, x, w, b, gy, dtype, kGpu, true);
            for (size_t i = 0; i < expected.size(); ++i)
              EXPECT_LE(testing::relative_error(actual[i], expected[i]),
                        dtype == DType::f64 ? 1e-12 : 1e-5)
                  << i << " " << dtype_name(dtype) << " world " << world << " " << c.str();
          }
        }
      }
    });
  }
}

}  // namespace
}  // namespace tessera
