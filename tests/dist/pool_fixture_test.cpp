// Sharded pooling against PyTorch: every committed fixture (tests/fixtures/pool, made by
// tests/fixtures/make_pool_fixtures.py with torch.nn.functional.max_pool*d / avg_pool*d in
// float64: stride != kernel, padding, dilation, ceil_mode, count_include_pad, divisor_override,
// tied maxima) is run through ops::max_pool / ops::avg_pool on 1, 2 and 4 ranks with uneven
// shards, forward and backward through the tape.
#include <gtest/gtest.h>

#include "ops/ops.hpp"
#include "tests/dist/op_cases.hpp"

namespace tessera {
namespace {

TEST(PoolFixtures, ShardedPoolingMatchesPyTorchForwardAndGradient) {
  testing::check_fixtures(testing::fixture_dir("pool"), [](const nlohmann::json& fixture) {
    ops::PoolOptions options;
    options.kernel_size = fixture["kernel_size"].get<std::vector<int64_t>>();
    options.stride = fixture["stride"].get<std::vector<int64_t>>();
    options.padding = fixture["padding"].get<std::vector<int64_t>>();
    options.dilation = fixture["dilation"].get<std::vector<int64_t>>();
    options.ceil_mode = fixture["ceil_mode"];
    options.count_include_pad = fixture["count_include_pad"];
    options.divisor_override = fixture["divisor_override"];
    const bool max = fixture["op"] == "max_pool";
    return testing::UnaryOp([max, options](const ShardTensor& x) {
      return max ? ops::max_pool(x, options) : ops::avg_pool(x, options);
    });
  });
}

}  // namespace
}  // namespace tessera
