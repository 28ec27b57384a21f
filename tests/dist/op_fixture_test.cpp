// Ops against PyTorch through one generic fixture format (tests/fixtures/ops, made by
// tests/fixtures/make_op_fixtures.py, and tests/fixtures/conv_transpose, made by
// tests/fixtures/make_conv_transpose_fixtures.py, in float64): each case names an op, its
// attributes as `tessera run-op --attr` takes them, its inputs and outputs. The case runs through
// apply_op on 1, 2 and 4 ranks, its largest input sharded unevenly (on 4 ranks over a 2x2 mesh of
// its first and last dims), the others replicated; the outputs and the gradients of sum(y * gy)
// equal PyTorch's.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/autograd.hpp"
#include "core/op_schema.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;
/// The case's attributes as the op declares them (through the CLI's parser).
OpAttrs attrs_of(const std::string& op, const Json& attrs) {
  std::vector<std::string> assignments;
  for (const auto& [name, value] : attrs.items()) {
    std::string text;
    if (value.is_array()) {
      for (size_t i = 0; i < value.size(); ++i) text += (i ? "," : "") + value[i].dump();
    } else if (value.is_boolean()) {
      text = value.get<bool>() ? "1" : "0";
    } else if (value.is_string()) {
      text = value.get<std::string>();
    } else {
      text = value.dump();
    }
    assignments.push_back(name + "=" + text);
  }
  return parse_attrs(op, find_op(op)->attrs, assignments);
}

/// Every case of the fixture folder `folder` on 1, 2 and 4 ranks.
void check_fixtures(const std::string& folder) {
  const std::string kFixtureDir = testing::fixture_dir(folder);
  const Json manifest = testing::read_manifest(kFixtureDir);
  ASSERT_FALSE(manifest["cases"].empty());
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      for (const Json& fixture : manifest["cases"]) {
        const std::string op = fixture["op"];
        const std::string where =
            fmt::format("{} ({}) on {} rank(s)", std::string(fixture["name"]), op, world);
        // The largest input (the first, when the case names a dim to shard) leads: sharded over
        // the mesh (its last dim or that dim); the others replicated.
        size_t lead = 0;
        int64_t most = -1;
        for (size_t i = 0; i < fixture["inputs"].size(); ++i) {
          const Shape shape = fixture["inputs"][i]["shape"].get<Shape>();
          if (shape_numel(shape) > most && !fixture.contains("shard_dim")) {
            most = shape_numel(shape);
            lead = i;
          }
        }
        const bool square = world == 4;
        DeviceMesh mesh(comm, square ? std::vector<int>{2, 2} : std::vector<int>{world});
        Tape tape;
        std::vector<ShardTensor> inputs;
        for (size_t i = 0; i < fixture["inputs"].size(); ++i) {
          const Json& input = fixture["inputs"][i];
          const Shape shape = input["shape"].get<Shape>();
          const Tensor values = testing::read_fixture(kFixtureDir, input["file"], shape);
          std::vector<Placement> placements(mesh.ndim(), Placement::replicate());
          std::vector<std::vector<int64_t>> extents(mesh.ndim());
          if (i == lead) {
            const int last = fixture.contains("shard_dim") ? fixture["shard_dim"].get<int>()
                                                           : static_cast<int>(shape.size()) - 1;
            const std::vector<int> dims =
                square ? std::vector<int>{0, last} : std::vector<int>{last};
            for (int m = 0; m < mesh.ndim(); ++m) {
              if (m > 0 && dims[m] == dims[0]) continue;  // a 1-d lead: one mesh dim shards it
              placements[m] = Placement::shard(dims[m]);
              extents[m] = testing::lopsided(shape[dims[m]], mesh.size(m));
            }
          }
          inputs.push_back(ShardTensor::distribute(values, mesh, placements, extents));
          if (input.contains("grad")) inputs.back().set_requires_grad();
        }
        const std::vector<ShardTensor> outputs =
            apply_op(op, inputs, attrs_of(op, fixture["attrs"]));
        ASSERT_EQ(outputs.size(), fixture["outputs"].size()) << where;
        std::optional<ShardTensor> loss;
        for (size_t k = 0; k < outputs.size(); ++k) {
          const Json& output = fixture["outputs"][k];
          const Shape shape = output["shape"].get<Shape>();
          EXPECT_EQ(outputs[k].global_shape(), shape) << where;
          EXPECT_LT(max_abs_diff(outputs[k].full_tensor(),
                                 testing::read_fixture(kFixtureDir, output["file"], shape)),
                    1e-10)
              << where << ": output " << k;
          const ShardTensor gy =
              ShardTensor::distribute(testing::read_fixture(kFixtureDir, output["gy"], shape), mesh,
                                      outputs[k].placements(), outputs[k].spec().extents);
          const ShardTensor term = ops::sum(ops::mul(outputs[k], gy));
          loss = loss ? ops::add(*loss, term) : term;
        }
        tape.backward(*loss);
        for (size_t i = 0; i < inputs.size(); ++i) {
          const Json& input = fixture["inputs"][i];
          if (!input.contains("grad")) continue;
          const Shape shape = input["shape"].get<Shape>();
          ASSERT_TRUE(tape.grad(inputs[i])) << where << ": gradient of " << input["name"];
          EXPECT_LT(max_abs_diff(tape.grad(inputs[i])->full_tensor(),
                                 testing::read_fixture(kFixtureDir, input["grad"], shape)),
                    1e-10)
              << where << ": gradient of " << input["name"];
        }
      }
    });
  }
}

TEST(OpFixtures, OpsMatchPyTorchForwardAndGradientOnUnevenShards) {
  check_fixtures("ops");
}

TEST(OpFixtures, ConvTransposeMatchesPyTorchForwardAndGradientsOnUnevenShards) {
  check_fixtures("conv_transpose");
}

}  // namespace
}  // namespace tessera
