// Sharded interpolate against PyTorch: every committed fixture (tests/fixtures/interpolate, made
// by tests/fixtures/make_interpolate_fixtures.py with torch.nn.functional.interpolate in float64:
// every mode, 1/2/3-d, size and scale_factor up and down, integer and not, align_corners both
// ways, recompute_scale_factor) is run through ops::interpolate on 1, 2 and 4 ranks with uneven
// shards, forward and backward through the tape.
#include <gtest/gtest.h>

#include "ops/ops.hpp"
#include "tests/dist/op_cases.hpp"

namespace tessera {
namespace {

TEST(InterpolateFixtures, ShardedInterpolateMatchesPyTorchForwardAndGradient) {
  testing::check_fixtures(testing::fixture_dir("interpolate"), [](const nlohmann::json& fixture) {
    ops::InterpolateOptions options;
    options.size = fixture["size"].get<std::vector<int64_t>>();
    options.scale_factor = fixture["scale_factor"].get<std::vector<double>>();
    options.mode = fixture["mode"];
    if (!fixture["align_corners"].is_null()) options.align_corners = fixture["align_corners"];
    options.recompute_scale_factor = fixture["recompute_scale_factor"];
    return testing::UnaryOp(
        [options](const ShardTensor& x) { return ops::interpolate(x, options); });
  });
}

}  // namespace
}  // namespace tessera
