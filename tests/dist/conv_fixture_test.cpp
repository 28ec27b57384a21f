// The sharded convolution against PyTorch: every committed fixture (tests/fixtures/conv, made by
// tests/fixtures/make_conv_fixtures.py with torch.nn.functional.conv*d in float64: padding,
// circular padding, stride, dilation, groups, even kernels, bias) is run through ops::conv on
// 1, 2 and 4 ranks with uneven shards, forward and backward through the tape.
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
const std::string kFixtureDir = testing::fixture_dir("conv");
using testing::lopsided;

Tensor read_fixture(const std::string& file, const Shape& shape) {
  return testing::read_fixture(kFixtureDir, file, shape);
}

TEST(ConvFixtures, ShardedConvMatchesPyTorchForwardAndGradients) {
  const Json manifest = testing::read_manifest(kFixtureDir);
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      for (const Json& fixture : manifest["cases"]) {
        const std::string name = fixture["name"];
        const int spatial = fixture["dims"];
        const Shape x_shape = fixture["x_shape"].get<Shape>();
        const Shape w_shape = fixture["w_shape"].get<Shape>();
        const Shape y_shape = fixture["y_shape"].get<Shape>();
        const Json& files = fixture["files"];
        const Tensor x = read_fixture(files["x"], x_shape), w = read_fixture(files["w"], w_shape);
        const Tensor gy = read_fixture(files["gy"], y_shape);
        const bool has_bias = fixture["has_bias"];
        ops::ConvOptions options;
        options.stride = fixture["stride"].get<std::vector<int64_t>>();
        options.dilation = fixture["dilation"].get<std::vector<int64_t>>();
        options.padding.clear();
        for (const Json& pair : fixture["padding"]) {
          options.padding.push_back(pair[0]);
          options.padding_hi.push_back(pair[1]);
        }
        options.groups = fixture["groups"];
        options.padding_mode = fixture["padding_mode"];
        const testing::FixtureLayout layout = testing::fixture_layout(x_shape, spatial, world);
        DeviceMesh mesh(comm, layout.mesh);
        const std::vector<Placement>& placements = layout.placements;
        const std::vector<std::vector<int64_t>>& extents = layout.extents;
        const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
        Tape tape;
        ShardTensor xs = ShardTensor::distribute(x, mesh, placements, extents);
        xs.set_requires_grad();
        ShardTensor ws = ShardTensor::distribute(w, mesh, replicated);
        ws.set_requires_grad();
        std::optional<ShardTensor> bs;
        if (has_bias)
          bs = ShardTensor::distribute(read_fixture(files["b"], {w_shape[0]}), mesh, replicated)
                   .set_requires_grad();
        const ShardTensor y = ops::conv(xs, ws, bs, options);
        const ShardTensor gys = ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents);
        tape.backward(ops::sum(ops::mul(y, gys)));
        const std::string where = fmt::format("{} on {} rank(s)", name, world);
        EXPECT_LT(max_abs_diff(y.full_tensor(), read_fixture(files["y"], y_shape)), 1e-10) << where;
        EXPECT_LT(max_abs_diff(tape.grad(xs)->full_tensor(), read_fixture(files["gx"], x_shape)),
                  1e-10)
            << where;
        EXPECT_LT(max_abs_diff(tape.grad(ws)->full_tensor(), read_fixture(files["gw"], w_shape)),
                  1e-10)
            << where;
        if (has_bias) {
          EXPECT_LT(
              max_abs_diff(tape.grad(*bs)->full_tensor(), read_fixture(files["gb"], {w_shape[0]})),
              1e-10)
              << where;
        }
      }
    });
  }
}

}  // namespace
}  // namespace tessera
