// Sharded pad against PyTorch: every committed fixture (tests/fixtures/pad, made by
// tests/fixtures/make_pad_fixtures.py with torch.nn.functional.pad in float64: every mode, 1/2/3
// padded dims (constant also 4 and 5), asymmetric pads, pads as wide as the mode allows) is run
// through ops::pad on 1, 2 and 4 ranks with uneven shards, forward and backward through the tape.
#include <gtest/gtest.h>

#include "ops/ops.hpp"
#include "tests/dist/op_cases.hpp"

namespace tessera {
namespace {

TEST(PadFixtures, ShardedPadMatchesPyTorchForwardAndGradient) {
  testing::check_fixtures(testing::fixture_dir("pad"), [](const nlohmann::json& fixture) {
    ops::PadOptions options;
    options.pad = fixture["pad"].get<std::vector<int64_t>>();
    options.mode = fixture["mode"];
    options.value = fixture["value"];
    return testing::UnaryOp([options](const ShardTensor& x) { return ops::pad(x, options); });
  });
}

}  // namespace
}  // namespace tessera
