// Sharded pooling against PyTorch: every committed fixture (tests/fixtures/pool, made by
// tests/fixtures/make_pool_fixtures.py with torch.nn.functional.max_pool*d / avg_pool*d in
// float64: stride != kernel, padding, dilation, ceil_mode, count_include_pad, divisor_override,
// tied maxima) is run through ops::max_pool / ops::avg_pool on 1, 2 and 4 ranks with uneven
// shards, forward and backward through the tape.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;
const std::string kFixtureDir = testing::fixture_dir("pool");
using testing::lopsided;

Tensor read_fixture(const std::string& file, const Shape& shape) {
  return testing::read_fixture(kFixtureDir, file, shape);
}

TEST(PoolFixtures, ShardedPoolingMatchesPyTorchForwardAndGradient) {
  const Json manifest = testing::read_manifest(kFixtureDir);
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      for (const Json& fixture : manifest["cases"]) {
        const std::string name = fixture["name"];
        const int spatial = fixture["dims"];
        const Shape x_shape = fixture["x_shape"].get<Shape>();
        const Shape y_shape = fixture["y_shape"].get<Shape>();
        const Json& files = fixture["files"];
        ops::PoolOptions options;
        options.kernel_size = fixture["kernel_size"].get<std::vector<int64_t>>();
        options.stride = fixture["stride"].get<std::vector<int64_t>>();
        options.padding = fixture["padding"].get<std::vector<int64_t>>();
        options.dilation = fixture["dilation"].get<std::vector<int64_t>>();
        options.ceil_mode = fixture["ceil_mode"];
        options.count_include_pad = fixture["count_include_pad"];
        options.divisor_override = fixture["divisor_override"];
        const bool max = fixture["op"] == "max_pool";
        // Mesh: the world over the last spatial dim, or 2x2 over the last two spatial dims.
        const bool square = world == 4 && spatial >= 2;
        DeviceMesh mesh(comm, square ? std::vector<int>{2, 2} : std::vector<int>{world});
        std::vector<Placement> placements;
        std::vector<std::vector<int64_t>> extents;
        for (int m = 0; m < mesh.ndim(); ++m) {
          const int dim = static_cast<int>(x_shape.size()) - mesh.ndim() + m;
          placements.push_back(Placement::shard(dim));
          extents.push_back(lopsided(x_shape[dim], mesh.size(m)));
        }
        Tape tape;
        ShardTensor xs =
            ShardTensor::distribute(read_fixture(files["x"], x_shape), mesh, placements, extents);
        xs.set_requires_grad();
        const ShardTensor y = max ? ops::max_pool(xs, options) : ops::avg_pool(xs, options);
        const ShardTensor gys = ShardTensor::distribute(read_fixture(files["gy"], y_shape), mesh,
                                                        y.placements(), y.spec().extents);
        tape.backward(ops::sum(ops::mul(y, gys)));
        const std::string where = fmt::format("{} on {} rank(s)", name, world);
        ASSERT_EQ(y.global_shape(), y_shape) << where;
        EXPECT_LT(max_abs_diff(y.full_tensor(), read_fixture(files["y"], y_shape)), 1e-10) << where;
        EXPECT_LT(max_abs_diff(tape.grad(xs)->full_tensor(), read_fixture(files["gx"], x_shape)),
                  1e-10)
            << where;
      }
    });
  }
}

}  // namespace
}  // namespace tessera
