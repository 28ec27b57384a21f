// What the sweeps and fixture tests of single-input sharded ops (pooling, interpolate) share:
// running an op forward and backward through the tape, sharded or replicated; running every
// PyTorch fixture of a family on 1, 2 and 4 ranks with uneven shards of the last spatial dims;
// and catching the one error a bad call throws.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera::testing {

/// A single-input op under test: y = op(x).
using UnaryOp = std::function<ShardTensor(const ShardTensor&)>;

/// Forward and dx of `op` on `mesh` (full tensors), for d loss / dy = gy; x laid out as
/// `placements` / `extents` when `sharded`, replicated otherwise. Expects dx in x's layout.
inline std::vector<Tensor> forward_and_grad(const UnaryOp& op, const DeviceMesh& mesh,
                                            const Tensor& x, const Tensor& gy,
                                            const std::vector<Placement>& placements,
                                            const std::vector<std::vector<int64_t>>& extents,
                                            bool sharded) {
  Tape tape;
  ShardTensor xs = sharded
                       ? ShardTensor::distribute(x, mesh, placements, extents)
                       : ShardTensor::distribute(
                             x, mesh, std::vector<Placement>(mesh.ndim(), Placement::replicate()));
  xs.set_requires_grad();
  const ShardTensor y = op(xs);
  // loss = sum(y * gy), so d loss / dy = gy.
  const ShardTensor gys = ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents);
  tape.backward(ops::sum(ops::mul(y, gys)));
  EXPECT_EQ(tape.grad(xs)->spec(), xs.spec()) << "dx comes back in x's layout";
  return {y.full_tensor(), tape.grad(xs)->full_tensor()};
}

/// forward_and_grad with every rank's pieces of x and gy in `dtype` on `device` (the gpu tests);
/// y and dx come back full, as f64 on the cpu.
inline std::vector<Tensor> forward_and_grad_on(const UnaryOp& op, const DeviceMesh& mesh,
                                               const Tensor& x, const Tensor& gy,
                                               const std::vector<Placement>& placements,
                                               const std::vector<std::vector<int64_t>>& extents,
                                               bool sharded, DType dtype, Device device) {
  auto placed = [&](const ShardTensor& t) {
    return ShardTensor(t.to_local().to_dtype(dtype).to(device), t.mesh(), t.spec());
  };
  Tape tape;
  ShardTensor xs =
      placed(sharded ? ShardTensor::distribute(x, mesh, placements, extents)
                     : ShardTensor::distribute(
                           x, mesh, std::vector<Placement>(mesh.ndim(), Placement::replicate())));
  xs.set_requires_grad();
  const ShardTensor y = op(xs);
  const ShardTensor gys =
      placed(ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents));
  tape.backward(ops::sum(ops::mul(y, gys)));
  return {y.full_tensor().to(Device::cpu()).to_dtype(DType::f64),
          tape.grad(xs)->full_tensor().to(Device::cpu()).to_dtype(DType::f64)};
}

/// The cuda sweep of a single-input op family: on 1, 2 and 4 local ranks and every mesh of them,
/// 12 random cases per mesh (make_case(mesh shape, rng) -> a case with placements, extents and
/// str(); make_input(x shape, rng) -> x in f64), the op (apply(case, x)) sharded on `gpu` in
/// f64, f32, f16 and bf16 against the cpu on one rank: y and dx within 1e-12, 1e-5, 1e-2 and
/// 5e-2 relative (the half types' gradient sums round in another order).
template <typename MakeCase, typename MakeInput, typename Apply>
void expect_cuda_sweep_matches_cpu(int seed, Device gpu, MakeCase make_case, MakeInput make_input,
                                   Apply apply) {
  for (int world : {1, 2, 4}) {
    run_world(world, [&](std::shared_ptr<Comm> comm) {
      const auto meshes = mesh_factorizations(comm->size());
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
        DeviceMesh mesh(comm, meshes[mesh_index]);
        for (int index = 0; index < sweep_cases(12); ++index) {
          CaseRng rng(case_seed(seed, world, static_cast<int>(mesh_index), index));
          const auto c = make_case(mesh.shape(), rng);
          const Tensor x = make_input(c.x_shape, rng);
          const UnaryOp op = [&](const ShardTensor& xs) { return apply(c, xs); };
          const ShardTensor probe =
              op(ShardTensor::distribute(x, single, {Placement::replicate()}));
          const Tensor gy = integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
          for (DType dtype : {DType::f64, DType::f32, DType::f16, DType::bf16}) {
            const auto expected = forward_and_grad_on(op, single, x, gy, c.placements, c.extents,
                                                      false, dtype, Device::cpu());
            const auto actual =
                forward_and_grad_on(op, mesh, x, gy, c.placements, c.extents, true, dtype, gpu);
            const double bound = dtype == DType::f64   ? 1e-12
                                 : dtype == DType::f32 ? 1e-5
                                 : dtype == DType::f16 ? 1e-2
                                                       : 5e-2;
            for (size_t i = 0; i < expected.size(); ++i)
              EXPECT_LE(relative_error(actual[i], expected[i]), bound)
                  << (i == 0 ? "y " : "dx ") << dtype_name(dtype) << " world " << world << " "
                  << c.str();
          }
        }
      }
    });
  }
}

/// Runs every case of the fixture directory `dir` (manifest.json: name, dims, x_shape, y_shape,
/// files x, gy, y, gx) on 1, 2 and 4 ranks: x sharded unevenly over the last spatial dim, or on 4
/// ranks 2x2 over the last two; `op_of(case)` gives the op of a case. y and dx (through the
/// tape) must equal the fixture's within 1e-10.
inline void check_fixtures(const std::string& dir,
                           const std::function<UnaryOp(const nlohmann::json&)>& op_of) {
  const nlohmann::json manifest = read_manifest(dir);
  for (int world : {1, 2, 4}) {
    run_world(world, [&](std::shared_ptr<Comm> comm) {
      for (const nlohmann::json& fixture : manifest["cases"]) {
        const std::string name = fixture["name"];
        const int spatial = fixture["dims"];
        const Shape x_shape = fixture["x_shape"].get<Shape>();
        const Shape y_shape = fixture["y_shape"].get<Shape>();
        const nlohmann::json& files = fixture["files"];
        const FixtureLayout layout = fixture_layout(x_shape, spatial, world);
        DeviceMesh mesh(comm, layout.mesh);
        const auto result = forward_and_grad(
            op_of(fixture), mesh, read_fixture(dir, files["x"], x_shape),
            read_fixture(dir, files["gy"], y_shape), layout.placements, layout.extents, true);
        const std::string where = fmt::format("{} on {} rank(s)", name, world);
        ASSERT_EQ(result[0].shape(), y_shape) << where;
        EXPECT_LT(max_abs_diff(result[0], read_fixture(dir, files["y"], y_shape)), 1e-10) << where;
        EXPECT_LT(max_abs_diff(result[1], read_fixture(dir, files["gx"], x_shape)), 1e-10) << where;
      }
    });
  }
}

/// The message of the InvalidArgument that `call(x)` throws for x of `shape` (zeros, replicated),
/// on one rank or under mpiexec on the launched world (every rank throws the same error); empty
/// when nothing is thrown.
inline std::string error_of(const Shape& shape, const UnaryOp& call) {
  std::string message;
  const int world = mpi_backend() ? mpi_world()->size() : 1;
  run_world(world, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {world});
    const ShardTensor x =
        ShardTensor::distribute(Tensor::zeros(shape, DType::f64), mesh, {Placement::replicate()});
    try {
      call(x);
    } catch (const InvalidArgument& error) {
      message = error.what();
    }
  });
  return message;
}

}  // namespace tessera::testing
