// Sharded normalizations against PyTorch: every committed fixture (tests/fixtures/norm, made by
// tests/fixtures/make_norm_fixtures.py with torch.nn.functional.group_norm / batch_norm /
// instance_norm / layer_norm in float64: optional w and b, batch_norm's running statistics
// updated in training and used in eval) is run through the ops on 1, 2 and 4 ranks with uneven
// shards of the batch, channel and spatial dims, forward and backward through the tape.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/norm_cases.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;
const std::string kFixtureDir = testing::fixture_dir("norm");
using testing::lopsided;

Tensor read_fixture(const std::string& file, const Shape& shape) {
  return testing::read_fixture(kFixtureDir, file, shape);
}

TEST(NormFixtures, ShardedNormalizationsMatchPyTorchForwardAndGradient) {
  const Json manifest = testing::read_manifest(kFixtureDir);
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
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
        // Mesh: the world over the last dim, or 2x2 over the first and last dims (batch and a
        // spatial or normalized dim; the channel dim for layer_norm over the last dims only).
        const bool square = world == 4;
        DeviceMesh mesh(comm, square ? std::vector<int>{2, 2} : std::vector<int>{world});
        const int last = static_cast<int>(c.x_shape.size()) - 1;
        const std::vector<int> dims = square ? std::vector<int>{1, last} : std::vector<int>{last};
        for (int m = 0; m < mesh.ndim(); ++m) {
          c.placements.push_back(Placement::shard(dims[m]));
          c.extents.push_back(lopsided(c.x_shape[dims[m]], mesh.size(m)));
        }
        const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
        auto param = [&](const char* key, bool grad) -> std::optional<ShardTensor> {
          if (!files.contains(key)) return std::nullopt;
          ShardTensor t =
              ShardTensor::distribute(read_fixture(files[key], params), mesh, replicated);
          if (grad) t.set_requires_grad();
          return t;
        };
        Tape tape;
        ShardTensor xs = ShardTensor::distribute(read_fixture(files["x"], c.x_shape), mesh,
                                                 c.placements, c.extents);
        xs.set_requires_grad();
        const std::optional<ShardTensor> w = param("w", true), b = param("b", true);
        const auto outputs =
            testing::norm(c, xs, w, b, param("running_mean", false), param("running_var", false));
        const ShardTensor gys =
            ShardTensor::distribute(read_fixture(files["gy"], c.x_shape), mesh,
                                    outputs[0].placements(), outputs[0].spec().extents);
        tape.backward(ops::sum(ops::mul(outputs[0], gys)));
        const std::string where =
            fmt::format("{} on {} rank(s)", std::string(fixture["name"]), world);
        EXPECT_LT(max_abs_diff(outputs[0].full_tensor(), read_fixture(files["y"], c.x_shape)),
                  1e-10)
            << where;
        EXPECT_LT(max_abs_diff(tape.grad(xs)->full_tensor(), read_fixture(files["gx"], c.x_shape)),
                  1e-10)
            << where;
        if (w) {
          EXPECT_LT(max_abs_diff(tape.grad(*w)->full_tensor(), read_fixture(files["gw"], params)),
                    1e-10)
              << where;
        }
        if (b) {
          EXPECT_LT(max_abs_diff(tape.grad(*b)->full_tensor(), read_fixture(files["gb"], params)),
                    1e-10)
              << where;
        }
        if (c.op == "batch_norm") {
          ASSERT_EQ(outputs.size(), 3u) << where;
          EXPECT_LT(max_abs_diff(outputs[1].full_tensor(),
                                 read_fixture(files["running_mean_out"], params)),
                    1e-10)
              << where;
          EXPECT_LT(max_abs_diff(outputs[2].full_tensor(),
                                 read_fixture(files["running_var_out"], params)),
                    1e-10)
              << where;
        }
      }
    });
  }
}

}  // namespace
}  // namespace tessera
