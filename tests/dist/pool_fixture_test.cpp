// Sharded pooling against PyTorch: every committed fixture (tests/fixtures/pool, made by
// tests/fixtures/make_pool_fixtures.py with torch.nn.functional.max_pool*d / avg_pool*d in
// float64: stride != kernel, padding, dilation, ceil_mode, count_include_pad, divisor_override,
// tied maxima) is run through ops::max_pool / ops::avg_pool on 1, 2 and 4 ranks with uneven
// shards, forward and backward through the tape; max_pool's indices equal PyTorch's
// (return_indices=True) exactly.
#include <gtest/gtest.h>

#include "ops/ops.hpp"
#include "tests/dist/op_cases.hpp"

namespace tessera {
namespace {

/// The options of a fixture case.
ops::PoolOptions options_of(const nlohmann::json& fixture) {
  ops::PoolOptions options;
  options.kernel_size = fixture["kernel_size"].get<std::vector<int64_t>>();
  options.stride = fixture["stride"].get<std::vector<int64_t>>();
  options.padding = fixture["padding"].get<std::vector<int64_t>>();
  options.dilation = fixture["dilation"].get<std::vector<int64_t>>();
  options.ceil_mode = fixture["ceil_mode"];
  options.count_include_pad = fixture["count_include_pad"];
  options.divisor_override = fixture["divisor_override"];
  return options;
}

TEST(PoolFixtures, ShardedPoolingMatchesPyTorchForwardAndGradient) {
  testing::check_fixtures(testing::fixture_dir("pool"), [](const nlohmann::json& fixture) {
    const ops::PoolOptions options = options_of(fixture);
    const bool max = fixture["op"] == "max_pool";
    return testing::UnaryOp([max, options](const ShardTensor& x) {
      return max ? ops::max_pool(x, options) : ops::avg_pool(x, options);
    });
  });
}

TEST(PoolFixtures, ShardedMaxPoolIndicesEqualPyTorchs) {
  const std::string dir = testing::fixture_dir("pool");
  const nlohmann::json manifest = testing::read_manifest(dir);
  int checked = 0;
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      for (const nlohmann::json& fixture : manifest["cases"]) {
        if (fixture["op"] != "max_pool") continue;
        const Shape x_shape = fixture["x_shape"].get<Shape>();
        const Shape y_shape = fixture["y_shape"].get<Shape>();
        // The layouts of check_fixtures.
        const testing::FixtureLayout layout =
            testing::fixture_layout(x_shape, fixture["dims"], world);
        DeviceMesh mesh(comm, layout.mesh);
        const ops::PoolOptions options = options_of(fixture);
        const Tensor x = testing::read_fixture(dir, fixture["files"]["x"], x_shape);
        const ShardTensor indices =
            ops::max_pool_with_indices(
                ShardTensor::distribute(x, mesh, layout.placements, layout.extents), options)
                .second;
        const Tensor actual = indices.full_tensor().to_dtype(DType::f64);
        const Tensor expected = testing::read_fixture(dir, fixture["files"]["indices"], y_shape);
        ASSERT_EQ(actual.shape(), y_shape) << fixture["name"];
        EXPECT_EQ(max_abs_diff(actual, expected), 0.0)
            << fixture["name"] << " on " << world << " rank(s)";
        if (comm->rank() == 0) ++checked;
      }
    });
  }
  if (!testing::mpi_backend()) {
    EXPECT_EQ(checked, 3 * 12);  // every max case on 1, 2 and 4 ranks
  }
}

}  // namespace
}  // namespace tessera
