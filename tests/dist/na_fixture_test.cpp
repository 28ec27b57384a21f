// The sharded neighborhood attention against PyTorch: every committed fixture (tests/fixtures/na,
// made by tests/fixtures/na/make_na_fixtures.py as masked dense attention in float64: 1-d/2-d/3-d,
// even kernels, dilation, causal axes, relative positional bias) is run through
// ops::neighborhood_attention on 1, 2 and 4 ranks with uneven shards, forward and backward
// through the tape.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;
const std::string kFixtureDir = testing::fixture_dir("na");
using testing::lopsided;

Tensor read_fixture(const std::string& file, const Shape& shape) {
  return testing::read_fixture(kFixtureDir, file, shape);
}

TEST(NaFixtures, ShardedNaMatchesPyTorchForwardAndGradients) {
  const Json manifest = testing::read_manifest(kFixtureDir);
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      for (const Json& fixture : manifest["cases"]) {
        const std::string name = fixture["name"];
        const int spatial = fixture["dims"];
        const Shape shape = fixture["q_shape"].get<Shape>();
        Shape lse_shape = shape;
        lse_shape.pop_back();
        const Shape rpb_shape = fixture["rpb_shape"].get<Shape>();
        const Json& files = fixture["files"];
        ops::NaOptions options;
        options.kernel_size = fixture["kernel_size"].get<std::vector<int64_t>>();
        options.dilation = fixture["dilation"].get<std::vector<int64_t>>();
        options.causal = fixture["causal"].get<std::vector<int64_t>>();
        options.scale = fixture["scale"].get<double>();
        // Mesh: the world over the last spatial axis, or 2x2 over the last two spatial axes.
        const bool square = world == 4 && spatial >= 2;
        DeviceMesh mesh(comm, square ? std::vector<int>{2, 2} : std::vector<int>{world});
        std::vector<Placement> placements;
        std::vector<std::vector<int64_t>> extents;
        for (int m = 0; m < mesh.ndim(); ++m) {
          const int dim = spatial + 1 - mesh.ndim() + m;
          placements.push_back(Placement::shard(dim));
          extents.push_back(lopsided(shape[dim], mesh.size(m)));
        }
        const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
        Tape tape;
        auto sharded = [&](const char* key) {
          return ShardTensor::distribute(read_fixture(files[key], shape), mesh, placements, extents)
              .set_requires_grad();
        };
        ShardTensor q = sharded("q"), k = sharded("k"), v = sharded("v");
        if (fixture["has_rpb"])
          options.rpb =
              ShardTensor::distribute(read_fixture(files["rpb"], rpb_shape), mesh, replicated)
                  .set_requires_grad();
        const ops::NaResult result = ops::neighborhood_attention(q, k, v, options);
        const ShardTensor go =
            ShardTensor::distribute(read_fixture(files["go"], shape), mesh,
                                    result.output.placements(), result.output.spec().extents);
        tape.backward(ops::sum(ops::mul(result.output, go)));
        const std::string where = fmt::format("{} on {} rank(s)", name, world);
        EXPECT_LT(max_abs_diff(result.output.full_tensor(), read_fixture(files["o"], shape)), 1e-10)
            << where;
        EXPECT_LT(max_abs_diff(result.lse.full_tensor(), read_fixture(files["lse"], lse_shape)),
                  1e-10)
            << where;
        for (auto [key, leaf] : {std::pair{"gq", &q}, std::pair{"gk", &k}, std::pair{"gv", &v}})
          EXPECT_LT(max_abs_diff(tape.grad(*leaf)->full_tensor(), read_fixture(files[key], shape)),
                    1e-10)
              << where << " " << key;
        if (options.rpb) {
          EXPECT_LT(max_abs_diff(tape.grad(*options.rpb)->full_tensor(),
                                 read_fixture(files["grpb"], rpb_shape)),
                    1e-10)
              << where;
        }
      }
    });
  }
}

}  // namespace
}  // namespace tessera
