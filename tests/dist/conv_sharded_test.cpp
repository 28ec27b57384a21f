// Sharded convolution: for a seeded sweep of random cases (conv1d/2d/3d, kernels 1..5 even and
// odd, stride 1..3, dilation 1..3, explicit/same padding, zeros/circular padding, groups, bias,
// 1-d..3-d meshes, uneven, empty and thinner-than-the-halo shards, batch sharding), the
// sharded forward and every gradient (dx, dw, db through the autograd tape) equal the same
// code run unsharded on one rank.
#include <gtest/gtest.h>

#include "core/autograd.hpp"
#include "core/op_registry.hpp"
#include "ops/ops.hpp"
#include "tests/dist/conv_cases.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;
using testing::ConvCase;
using testing::random_conv_case;

/// Forward and gradients on `mesh`: y (full), dx, dw, db (full tensors).
std::vector<Tensor> run_case(const ConvCase& c, const DeviceMesh& mesh, const Tensor& x,
                             const Tensor& w, const Tensor& b, const Tensor& gy, bool sharded) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  Tape tape;
  ShardTensor xs = sharded ? ShardTensor::distribute(x, mesh, c.placements, c.extents)
                           : ShardTensor::distribute(x, mesh, replicated);
  xs.set_requires_grad();
  ShardTensor ws = ShardTensor::distribute(w, mesh, replicated);
  ws.set_requires_grad();
  std::optional<ShardTensor> bs;
  if (c.bias) bs = ShardTensor::distribute(b, mesh, replicated).set_requires_grad();
  const ShardTensor y = ops::conv(xs, ws, bs, c.options);
  // loss = sum(y * gy), so d loss / dy = gy.
  const ShardTensor gys = ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents);
  tape.backward(ops::sum(ops::mul(y, gys)));
  std::vector<Tensor> results{y.full_tensor(), tape.grad(xs)->full_tensor(),
                              tape.grad(ws)->full_tensor()};
  EXPECT_EQ(tape.grad(xs)->spec(), xs.spec()) << "dx comes back in x's layout";
  EXPECT_EQ(tape.grad(ws)->placements(), replicated) << "dw is reduced to replicated exactly once";
  if (c.bias) results.push_back(tape.grad(*bs)->full_tensor());
  return results;
}

TEST(ConvSharded, RandomCasesMatchUnshardedForwardAndGradients) {
  int total_cases = 0;
  testing::run_every_world([&](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    // The unsharded reference runs the same code on a one-rank mesh of this rank alone.
    auto self = comm->split(comm->rank(), 0);
    DeviceMesh single(self, {1});
    int cases = 0;
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < testing::cases_per_mesh(comm->size(), 90); ++index, ++cases) {
        CaseRng rng(testing::case_seed(41, comm->size(), static_cast<int>(mesh_index), index));
        const ConvCase c = random_conv_case(mesh.shape(), rng);
        const Tensor x = testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
        const Tensor w = testing::integer_tensor(c.w_shape, DType::f64, rng, -3, 3);
        const Tensor b = testing::integer_tensor({c.w_shape[0]}, DType::f64, rng, -3, 3);
        // gy needs y's shape: run the reference forward first.
        ShardTensor probe = ops::conv(ShardTensor::distribute(x, single, {Placement::replicate()}),
                                      ShardTensor::distribute(w, single, {Placement::replicate()}),
                                      std::nullopt, c.options);
        const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
        const auto expected = run_case(c, single, x, w, b, gy, false);
        const auto actual = run_case(c, mesh, x, w, b, gy, true);
        const char* names[] = {"y", "dx", "dw", "db"};
        for (size_t i = 0; i < expected.size(); ++i)
          EXPECT_LE(testing::relative_error(actual[i], expected[i]), 1e-12)
              << names[i] << " case " << index << " mesh " << testing::shape_str(mesh.shape())
              << " x " << fmt::format("{}", c.x_shape) << " w " << fmt::format("{}", c.w_shape)
              << " stride " << fmt::format("{}", c.options.stride) << " dilation "
              << fmt::format("{}", c.options.dilation) << " padding "
              << fmt::format("{}", c.options.padding) << " " << c.options.padding_name << " "
              << c.options.padding_mode << " groups " << c.options.groups << " layout "
              << actual.size();
      }
    }
    if (comm->rank() == 0) total_cases += cases;
  });
  if (!testing::mpi_backend()) {
    EXPECT_GE(total_cases, 500);
  }
}

// The forward's interior runs while the halos are in flight, its boundary after they land
// (OverlapKernel); with overlap off the plain kernel runs on the complete haloed piece. In f64
// every output element is the same sum either way, so the two agree bit for bit.
TEST(ConvSharded, HaloOverlapGivesBitwiseTheSameForwardAsNoOverlap) {
  int compared = 0;
  for (int world_size = 1; world_size <= 4; ++world_size) {
    const auto meshes = testing::mesh_factorizations(world_size);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      for (int index = 0; index < 24; ++index) {
        const auto outputs =
            testing::with_and_without_cpu_overlap(world_size, [&](std::shared_ptr<Comm> comm) {
              DeviceMesh mesh(comm, meshes[mesh_index]);
              CaseRng rng(testing::case_seed(42, world_size, static_cast<int>(mesh_index), index));
              const ConvCase c = random_conv_case(mesh.shape(), rng);
              const Tensor x = testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
              const Tensor w = testing::integer_tensor(c.w_shape, DType::f64, rng, -3, 3);
              const ShardTensor y = ops::conv(
                  ShardTensor::distribute(x, mesh, c.placements, c.extents),
                  ShardTensor::distribute(
                      w, mesh, std::vector<Placement>(mesh.ndim(), Placement::replicate())),
                  std::nullopt, c.options);
              return std::vector<Tensor>{y.full_tensor()};
            });
        if (outputs[0].empty()) continue;  // under mpiexec only the launcher's world size runs
        EXPECT_TRUE(bitwise_equal(outputs[0][0], outputs[1][0]))
            << "world " << world_size << " mesh " << testing::shape_str(meshes[mesh_index])
            << " case " << index;
        ++compared;
      }
    }
  }
  if (!testing::mpi_backend()) {
    EXPECT_GT(compared, 100);
  }
}

}  // namespace
}  // namespace tessera
