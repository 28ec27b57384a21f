// The normalization cuda kernels on a GPU (skipped, with the reason printed, when none is
// visible):
//  - every PyTorch fixture (tests/fixtures/norm) through the ops on cuda tensors in f64: y, the
//    running statistics and gx, gw, gb within 1e-10 of PyTorch;
//  - the random cases of the cpu sweep (tests/dist/norm_cases.hpp) sharded over 1, 2 and 4 local
//    ranks sharing the GPU equal the cpu op on one rank: f64 within 1e-12, f32 within 1e-5 of the
//    largest value; f16 and bf16 run and match within their roundoff scale.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/autograd.hpp"
#include "core/gpu_runtime.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/norm_cases.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;
const Device kGpu = Device::cuda(0);

#define SKIP_WITHOUT_GPU()                                                                   \
  if (gpu::device_count() == 0)                                                              \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the normalization " \
                  "cuda kernel tests need a GPU"

/// y, running_mean, running_var, dx, dw, db (full, f64 on the cpu; absent ones empty) of a case
/// on `mesh`, in `dtype` on `device`, x laid out as the case says (`sharded`) or replicated.
std::vector<std::optional<Tensor>> run_case(const testing::NormCase& c, const DeviceMesh& mesh,
                                            const testing::NormInputs& in, const Tensor& gy,
                                            DType dtype, Device device, bool sharded) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  auto placed = [&](const ShardTensor& t) {
    return ShardTensor(t.to_local().to_dtype(dtype).to(device), t.mesh(), t.spec());
  };
  auto param = [&](const std::optional<Tensor>& value, bool grad) -> std::optional<ShardTensor> {
    if (!value) return std::nullopt;
    ShardTensor result = placed(ShardTensor::distribute(*value, mesh, replicated));
    if (grad) result.set_requires_grad();
    return result;
  };
  Tape tape;
  ShardTensor x = placed(sharded ? ShardTensor::distribute(in.x, mesh, c.placements, c.extents)
                                 : ShardTensor::distribute(in.x, mesh, replicated));
  x.set_requires_grad();
  const std::optional<ShardTensor> w = param(in.w, true), b = param(in.b, true);
  const auto outputs =
      testing::norm(c, x, w, b, param(in.running_mean, false), param(in.running_var, false));
  const ShardTensor gys =
      placed(ShardTensor::distribute(gy, mesh, outputs[0].placements(), outputs[0].spec().extents));
  tape.backward(ops::sum(ops::mul(outputs[0], gys)));
  auto host = [](const ShardTensor& t) {
    return std::optional<Tensor>(t.full_tensor().to(Device::cpu()).to_dtype(DType::f64));
  };
  std::vector<std::optional<Tensor>> results{host(outputs[0]), std::nullopt, std::nullopt};
  if (outputs.size() == 3) {
    results[1] = host(outputs[1]);
    results[2] = host(outputs[2]);
  }
  results.push_back(host(*tape.grad(x)));
  results.push_back(w ? host(*tape.grad(*w)) : std::nullopt);
  results.push_back(b ? host(*tape.grad(*b)) : std::nullopt);
  return results;
}

TEST(NormGpu, FixturesMatchPyTorchOnCuda) {
  SKIP_WITHOUT_GPU();
  const std::string dir = testing::fixture_dir("norm");
  const Json manifest = testing::read_manifest(dir);
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    for (const Json& fixture : manifest["cases"]) {
      testing::NormCase c;
      c.op = fixture["op"];
      c.x_shape = fixture["x_shape"].get<Shape>();
      const Shape params = fixture["param_shape"].get<Shape>();
      const Json& attrs = fixture["attrs"];
      const Json& files = fixture["files"];
      c.eps = attrs["eps"];
      c.groups = attrs.value("groups", int64_t{1});
      c.normalized_ndim = attrs.value("normalized_ndim", int64_t{1});
      c.training = attrs.value("training", 1) != 0;
      c.momentum = attrs.value("momentum", 0.1);
      c.has_w = fixture["has_w"];
      c.has_b = fixture["has_b"];
      c.has_running = c.op == "batch_norm";
      auto read = [&](const char* key, const Shape& shape) -> std::optional<Tensor> {
        if (!files.contains(key)) return std::nullopt;
        return testing::read_fixture(dir, files[key], shape);
      };
      testing::NormInputs in{*read("x", c.x_shape), read("w", params), read("b", params),
                             read("running_mean", params), read("running_var", params)};
      const auto result = run_case(c, mesh, in, *read("gy", c.x_shape), DType::f64, kGpu, false);
      const std::pair<const char*, Shape> expected[] = {{"y", c.x_shape},
                                                        {"running_mean_out", params},
                                                        {"running_var_out", params},
                                                        {"gx", c.x_shape},
                                                        {"gw", params},
                                                        {"gb", params}};
      for (size_t i = 0; i < result.size(); ++i) {
        const std::optional<Tensor> want = read(expected[i].first, expected[i].second);
        ASSERT_EQ(result[i].has_value(), want.has_value()) << expected[i].first;
        if (want) {
          EXPECT_LT(max_abs_diff(*result[i], *want), 1e-10)
              << fixture["name"] << " " << expected[i].first;
        }
      }
    }
  });
}

TEST(NormGpu, ShardedOnOneTwoAndFourLocalRanksMatchesTheCpuOnOneRank) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      const auto meshes = testing::mesh_factorizations(comm->size());
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
        DeviceMesh mesh(comm, meshes[mesh_index]);
        for (int index = 0; index < testing::sweep_cases(12); ++index) {
          testing::CaseRng rng(testing::case_seed(74, world, static_cast<int>(mesh_index), index));
          const testing::NormCase c = testing::random_norm_case(mesh.shape(), rng);
          const testing::NormInputs in = testing::random_norm_inputs(c, rng);
          const Tensor gy = testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
          for (DType dtype : {DType::f64, DType::f32, DType::f16, DType::bf16}) {
            const auto expected = run_case(c, single, in, gy, dtype, Device::cpu(), false);
            const auto actual = run_case(c, mesh, in, gy, dtype, kGpu, true);
            const double bound = dtype == DType::f64   ? 1e-12
                                 : dtype == DType::f32 ? 1e-5
                                 : dtype == DType::f16 ? 1e-2
                                                       : 5e-2;
            for (size_t i = 0; i < expected.size(); ++i) {
              ASSERT_EQ(actual[i].has_value(), expected[i].has_value());
              if (expected[i]) {
                EXPECT_LE(testing::relative_error(*actual[i], *expected[i]), bound)
                    << "result " << i << " " << dtype_name(dtype) << " world " << world << " "
                    << c.str();
              }
            }
          }
        }
      }
    });
  }
}

}  // namespace
}  // namespace tessera
