// Networks exported from PyTorch (tests/fixtures/onnx, made by
// tests/fixtures/make_onnx_fixtures.py: a 2-d U-Net, a 3-d conv net with GroupNorm and BatchNorm,
// an MLP block on [B, S, C], a channels-last ConvNeXt block, each at opsets 13 and 17) run as
// nn::OnnxModel on 1 rank, on 2 ranks (one dim sharded unevenly) and on a 2x2 mesh (two dims
// sharded unevenly), on the exported grid and on a larger one: the outputs equal PyTorch's within
// 1e-10 in f64, and the sharded outputs equal one rank's within 1e-12 relative. Hand-built graphs
// check the op fallback, folded shape arithmetic and the errors for unsupported or malformed
// graphs. The attention block under tensor parallelism (heads split over tp by the plan of
// ops/nn/onnx_partition.hpp) equals one rank and reduces each row-parallel product once.
#include "ops/nn/onnx_model.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>

#include "core/autograd.hpp"
#include "io/onnx/onnx_graph.hpp"
#include "ops/nn/onnx_partition.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/counting_comm.hpp"
#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;

/// The fixture's input sharded over `mesh` on the case's dims (lopsided extents), replicated
/// on a 1-rank mesh.
ShardTensor sharded_input(const Tensor& values, const DeviceMesh& mesh,
                          const std::vector<int>& shard_dims) {
  std::vector<Placement> placements(mesh.ndim(), Placement::replicate());
  std::vector<std::vector<int64_t>> extents(mesh.ndim());
  if (mesh.size() > 1)
    for (int m = 0; m < mesh.ndim(); ++m) {
      placements[m] = Placement::shard(shard_dims[m]);
      extents[m] = testing::lopsided(values.shape(shard_dims[m]), mesh.size(m));
    }
  return ShardTensor::distribute(values, mesh, placements, extents);
}

TEST(OnnxModel, ExportedNetworksMatchPyTorchOnUnevenShardsAndLargerGrids) {
  if (!io::onnx_available()) GTEST_SKIP() << "built without ONNX support";
  const std::string dir = testing::fixture_dir("onnx");
  const Json manifest = testing::read_manifest(dir);
  ASSERT_EQ(manifest["cases"].size(), 10u);
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      const std::vector<int> shape = world == 4 ? std::vector<int>{2, 2} : std::vector<int>{world};
      DeviceMesh mesh(comm, shape);
      for (const Json& fixture : manifest["cases"]) {
        nn::OnnxModel model =
            nn::OnnxModel::load(dir + fixture["model"].get<std::string>(), mesh, DType::f64);
        // Every node maps to a sharded op: nothing is gathered (GroupNorm recognised).
        EXPECT_TRUE(model.fallback_nodes().empty()) << fixture["name"];
        std::vector<int> shard_dims = fixture["shard_dims"].get<std::vector<int>>();
        shard_dims.resize(mesh.ndim());
        for (size_t g = 0; g < fixture["grids"].size(); ++g) {
          const Json& grid = fixture["grids"][g];
          const std::string where =
              fmt::format("{} grid {} on {} rank(s)", fixture["name"].get<std::string>(), g, world);
          const Json& input = grid["inputs"][0];
          const Tensor x = testing::read_fixture(dir, input["file"], input["shape"].get<Shape>());
          const ShardTensor y = model.forward(sharded_input(x, mesh, shard_dims));
          const Json& output = grid["outputs"][0];
          const Shape y_shape = output["shape"].get<Shape>();
          EXPECT_EQ(y.global_shape(), y_shape) << where;
          if (y.global_shape() != y_shape) continue;
          const Tensor reference = testing::read_fixture(dir, output["file"], y_shape);
          const Tensor full = y.full_tensor();
          EXPECT_LT(max_abs_diff(full, reference), 1e-10) << where;
          // Sharded against one rank (the same model on a 1-rank mesh of this rank).
          if (world > 1) {
            DeviceMesh single(comm->split(comm->rank(), 0), {1});
            nn::OnnxModel alone =
                nn::OnnxModel::load(dir + fixture["model"].get<std::string>(), single, DType::f64);
            const Tensor one = alone.forward(sharded_input(x, single, {})).full_tensor();
            EXPECT_LT(testing::relative_error(full, one), 1e-12) << where;
          }
        }
      }
    });
  }
}

TEST(OnnxModel, InitializersBecomeNamedParametersAndBatchNormStatisticsBuffers) {
  if (!io::onnx_available()) GTEST_SKIP() << "built without ONNX support";
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    nn::OnnxModel model =
        nn::OnnxModel::load(testing::fixture_dir("onnx") + "conv3d.opset17.onnx", mesh, DType::f64);
    std::vector<std::string> names;
    for (const auto& [name, parameter] : model.named_parameters()) {
      names.push_back(name);
      EXPECT_EQ(parameter.name(), name);
      EXPECT_EQ(parameter.tensor().dtype(), DType::f64);
    }
    EXPECT_NE(std::find(names.begin(), names.end(), "conv1.weight"), names.end());
    EXPECT_NE(std::find(names.begin(), names.end(), "head.bias"), names.end());
    std::vector<std::string> buffers;
    for (const auto& [name, buffer] : model.named_buffers()) buffers.push_back(name);
    EXPECT_EQ(buffers, (std::vector<std::string>{"norm2.running_mean", "norm2.running_var"}));
  });
}

/// The export back: every parameter scaled by 1.5 on a 2-rank mesh, the model saved, read back:
/// the same parameters (exactly) and outputs. With TESSERA_ONNX_EXPORT_DIR set, the saved file is
/// also written there for tests/cli/onnx_export_check.py (python3-onnx's checker).
TEST(OnnxModel, SavedModelHoldsTheCurrentParametersAndLoadsBack) {
  if (!io::onnx_available()) GTEST_SKIP() << "built without ONNX support";
  const std::string dir = testing::fixture_dir("onnx");
  const char* export_dir = std::getenv("TESSERA_ONNX_EXPORT_DIR");
  const std::string saved = export_dir ? std::string(export_dir) + "/conv3d.scaled.onnx"
                                       : ::testing::TempDir() + "conv3d.scaled.onnx";
  const Json manifest = testing::read_manifest(dir);
  const Json& grid = manifest["cases"][2]["grids"][1];  // conv3d opset 13, the larger grid
  ASSERT_EQ(manifest["cases"][2]["model"], "conv3d.opset13.onnx");
  const Tensor x = testing::read_fixture(dir, grid["inputs"][0]["file"],
                                         grid["inputs"][0]["shape"].get<Shape>());
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    nn::OnnxModel model = nn::OnnxModel::load(dir + "conv3d.opset13.onnx", mesh, DType::f64);
    for (auto& [name, parameter] : model.named_parameters()) {
      Tensor values = parameter.tensor().to_local().contiguous().clone();
      for (int64_t i = 0; i < values.numel(); ++i) values.data<double>()[i] *= 1.5;
      parameter.assign_local(values);
    }
    const ShardTensor y = model.forward(sharded_input(x, mesh, {2}));
    model.save(saved);
    nn::OnnxModel loaded = nn::OnnxModel::load(saved, mesh, DType::f64);
    const auto before = model.named_parameters();
    const auto after = loaded.named_parameters();
    EXPECT_EQ(before.size(), after.size());
    for (size_t i = 0; i < std::min(before.size(), after.size()); ++i) {
      EXPECT_EQ(before[i].first, after[i].first);
      EXPECT_EQ(max_abs_diff(before[i].second.tensor().full_tensor(),
                             after[i].second.tensor().full_tensor()),
                0.0)
          << before[i].first;
    }
    EXPECT_EQ(
        max_abs_diff(loaded.forward(sharded_input(x, mesh, {2})).full_tensor(), y.full_tensor()),
        0.0);
    // Scaled parameters change the network: the saved model is not the original.
    EXPECT_GT(max_abs_diff(y.full_tensor(),
                           testing::read_fixture(dir, grid["outputs"][0]["file"],
                                                 grid["outputs"][0]["shape"].get<Shape>())),
              1e-3);
  });
}

io::OnnxNode node(const std::string& op, std::vector<std::string> inputs,
                  std::vector<std::string> outputs) {
  io::OnnxNode made;
  made.op_type = op;
  made.name = op + "_node";
  made.inputs = std::move(inputs);
  made.outputs = std::move(outputs);
  return made;
}

io::OnnxAttribute integers(std::vector<int64_t> values) {
  io::OnnxAttribute attribute;
  attribute.kind = io::OnnxAttribute::Kind::integers;
  attribute.integers = std::move(values);
  return attribute;
}

/// x [2, 3, 4, 5] -> Transpose(perm 0,2,1,3) -> Reshape to the first `keep` dims and -1 (shape
/// arithmetic: Shape, Slice, Concat) -> Relu: the Transpose relabels the layout (ops::permute), the
/// shape arithmetic is folded.
io::OnnxGraph reshape_graph(int64_t keep) {
  io::OnnxGraph graph;
  graph.source = "fallback";
  graph.opset = 17;
  graph.inputs = {{"x", 11, {-1, -1, -1, -1}}};
  graph.outputs = {{"y", 11, {}}};
  io::OnnxNode transpose = node("Transpose", {"x"}, {"t"});
  transpose.attributes["perm"] = integers({0, 2, 1, 3});
  io::OnnxNode shape = node("Shape", {"t"}, {"s"});
  io::OnnxNode slice = node("Slice", {"s", "zero", "two"}, {"s2"});
  io::OnnxNode concat = node("Concat", {"s2", "minus_one"}, {"target"});
  concat.attributes["axis"].kind = io::OnnxAttribute::Kind::integer;  // axis 0
  io::OnnxNode reshape = node("Reshape", {"t", "target"}, {"r"});
  io::OnnxNode relu = node("Relu", {"r"}, {"y"});
  graph.nodes = {transpose, shape, slice, concat, reshape, relu};
  graph.initializers = {{"zero", Tensor::from_values<int64_t>({1}, std::vector<int64_t>{0})},
                        {"two", Tensor::from_values<int64_t>({1}, std::vector<int64_t>{keep})},
                        {"minus_one", Tensor::from_values<int64_t>({1}, std::vector<int64_t>{-1})}};
  io::validate_onnx_graph(graph);
  return graph;
}

/// A Reshape that merges the last two dims (or keeps the shape) runs as ops::merge_last on the
/// shards; one that merges a sharded dim runs through the fallback.
TEST(OnnxModel, ReshapeKeepsShardsUnlessItMergesAShardedDimTransposeRelabelsShapesFold) {
  Tensor x = Tensor::empty({2, 3, 4, 5}, DType::f64);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<double>()[i] = std::sin(0.7 * i) - 0.2;
  // The expected values by plain loops: relu of x transposed (0,2,1,3), in row-major order.
  Tensor expected = Tensor::empty({2, 4, 3, 5}, DType::f64);
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t c = 0; c < 3; ++c)
        for (int64_t w = 0; w < 5; ++w)
          expected.data<double>()[((n * 4 + h) * 3 + c) * 5 + w] =
              std::max(0.0, x.data<double>()[((n * 3 + c) * 4 + h) * 5 + w]);
  // keep 3: the same shape; 2: [2, 4, 15] (merge_last; dim 1 stays sharded); 1: [2, 60] merges
  // the sharded dim 1 (the input's dim 2) and falls back.
  for (const auto& [keep, shape] :
       std::vector<std::pair<int64_t, Shape>>{{3, {2, 4, 3, 5}}, {2, {2, 4, 15}}, {1, {2, 60}}}) {
    for (int world : {1, 3}) {
      testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
        DeviceMesh mesh(comm, {world});
        nn::OnnxModel model(reshape_graph(keep), mesh, DType::f64);
        const ShardTensor y = model.forward(sharded_input(x, mesh, {2}));
        EXPECT_EQ(y.global_shape(), shape) << "keep " << keep;
        EXPECT_EQ(max_abs_diff(y.full_tensor(), expected.reshape(shape)), 0.0) << "keep " << keep;
        // Only a sharded input is gathered (and named); one rank has nothing to gather.
        const std::vector<std::string> gathered = world == 1 || keep > 1
                                                      ? std::vector<std::string>{}
                                                      : std::vector<std::string>{"Reshape_node"};
        EXPECT_EQ(model.fallback_nodes(), gathered) << "keep " << keep;
        if (keep == 2 && world == 3) {
          EXPECT_TRUE(y.placements()[0].is_shard() && y.placements()[0].dim == 1);
        }
      });
    }
  }
}

/// x [2, 3, 7, 5] -> Slice(dims 2 and 3: [1, -1) and [2, 5)) -> Slice(dim 2, step 2): the unit
/// steps run as ops::split on the sharded dims, the step 2 through the fallback.
TEST(OnnxModel, SliceOfShardedDataSplitsWithUnitStepsAndFallsBackOtherwise) {
  io::OnnxGraph graph;
  graph.source = "slice";
  graph.opset = 13;
  graph.inputs = {{"x", 11, {-1, -1, -1, -1}}};
  graph.outputs = {{"y", 11, {}}};
  auto i64 = [](std::vector<int64_t> values) {
    const Shape shape{static_cast<int64_t>(values.size())};
    return Tensor::from_values<int64_t>(shape, values);
  };
  graph.initializers = {{"starts", i64({1, 2})}, {"ends", i64({-1, 9})}, {"axes", i64({2, 3})},
                        {"s2", i64({0})},        {"e2", i64({100})},     {"a2", i64({2})},
                        {"step2", i64({2})}};
  graph.nodes = {node("Slice", {"x", "starts", "ends", "axes"}, {"cut"}),
                 node("Slice", {"cut", "s2", "e2", "a2", "step2"}, {"y"})};
  graph.nodes[1].name = "Strided";
  io::validate_onnx_graph(graph);
  Tensor x = Tensor::empty({2, 3, 7, 5}, DType::f64);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<double>()[i] = std::cos(0.3 * i);
  // y = x[:, :, 1:6:2, 2:5] by plain loops.
  Tensor expected = Tensor::empty({2, 3, 3, 3}, DType::f64);
  for (int64_t nc = 0; nc < 6; ++nc)
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t w = 0; w < 3; ++w)
        expected.data<double>()[(nc * 3 + h) * 3 + w] =
            x.data<double>()[(nc * 7 + 1 + 2 * h) * 5 + 2 + w];
  for (int world : {1, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh mesh(comm, world == 4 ? std::vector<int>{2, 2} : std::vector<int>{1});
      nn::OnnxModel model(graph, mesh, DType::f64);
      const ShardTensor y = model.forward(sharded_input(x, mesh, {2, 3}));
      EXPECT_EQ(y.global_shape(), (Shape{2, 3, 3, 3}));
      EXPECT_EQ(max_abs_diff(y.full_tensor(), expected), 0.0);
      const std::vector<std::string> gathered =
          world == 1 ? std::vector<std::string>{} : std::vector<std::string>{"Strided"};
      EXPECT_EQ(model.fallback_nodes(), gathered);
    });
  }
}

/// One forward and backward of `graph` on `mesh` (x and the loss weights replicated, loss
/// sum(y * target)): y, x's gradient and every parameter's gradient, gathered, each parameter's
/// in its initializer's layout (a fused projection's stacked weight [3 * in, width] and bias
/// [3, width] unstacked by hand here: column p * width + e of the weight is row p * in + i).
std::map<std::string, Tensor> attention_step(const io::OnnxGraph& graph, const DeviceMesh& mesh,
                                             const nn::OnnxTensorParallelPlan& plan,
                                             const Tensor& x, const Tensor& target,
                                             const std::function<void()>& after_step = {}) {
  std::map<std::string, std::vector<Placement>> placements;
  for (const auto& [name, dim] : plan.sharded)
    placements[name] = std::vector<Placement>{Placement::shard(dim)};
  nn::OnnxModel model(graph, mesh, DType::f64, placements, plan.fused);
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  ShardTensor xs = ShardTensor::distribute(x, mesh, replicated);
  xs.set_requires_grad();
  Tape tape;
  const ShardTensor y = model.forward(xs);
  tape.backward(ops::sum(ops::mul(y, ShardTensor::distribute(target, mesh, replicated))));
  if (after_step) after_step();
  std::map<std::string, Tensor> values{{"y", y.full_tensor()},
                                       {"dx", tape.grad(xs)->full_tensor()}};
  std::set<std::string> stacked_weights;
  for (const nn::OnnxFusedProjection& projection : plan.fused)
    stacked_weights.insert(projection.weight);
  for (const auto& [name, parameter] : model.named_parameters()) {
    const Tensor grad = parameter.grad()->full_tensor().contiguous();
    if (!stacked_weights.count(name)) {  // a stacked bias [3, width]: the same order
      values[name] = grad.reshape({grad.numel()});
      continue;
    }
    const int64_t in = grad.shape(0) / 3, width = grad.shape(1);
    Tensor unstacked = Tensor::empty({in, 3 * width}, DType::f64);
    for (int64_t p = 0; p < 3; ++p)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t e = 0; e < width; ++e)
          unstacked.data<double>()[i * 3 * width + p * width + e] =
              grad.data<double>()[(p * in + i) * width + e];
    values[name] = unstacked.reshape({unstacked.numel()});
  }
  return values;
}

// The exported attention block (fused q/k/v MatMul, Slices, heads by Reshape/Transpose, softmax
// attention, output projection, then an MLP) with its heads and the MLP's hidden features split
// over tp 2: the output, x's gradient and every parameter's gradient equal one rank's within
// 1e-12, and one step moves exactly four all-reduces of the activations [B, S, E] over tp:
// forward the output projection's and fc2's Partial sums (each reduced once, right after its
// product), backward x's gradient at the inputs of the q/k/v projection and of fc1.
TEST(OnnxModel, TensorParallelAttentionEqualsOneRankAndReducesEachProductOnce) {
  const io::OnnxGraph graph =
      io::read_onnx(testing::fixture_dir("onnx") + "attention.opset17.onnx");
  Tensor x = Tensor::empty({2, 6, 8}, DType::f64), target = Tensor::empty({2, 6, 8}, DType::f64);
  for (int64_t i = 0; i < x.numel(); ++i) {
    x.data<double>()[i] = std::sin(0.37 * i) + 0.1;
    target.data<double>()[i] = std::cos(0.23 * i);
  }
  const nn::OnnxTensorParallelPlan plan = nn::onnx_tensor_parallel_plan(graph, 2);
  ASSERT_EQ(plan.patterns.size(), 2u);
  EXPECT_EQ(plan.patterns[0].kind, "attention");
  ASSERT_EQ(plan.fused.size(), 1u);
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    // One rank's reference: each rank alone, with the whole weights.
    const std::map<std::string, Tensor> reference =
        attention_step(graph, DeviceMesh(comm->split(comm->rank(), 0), {1}, {"tp"}), {}, x, target);
    auto ledger = std::make_shared<testing::CountingComm::Ledger>();
    const DeviceMesh mesh(std::make_shared<testing::CountingComm>(comm, ledger), {2}, {"tp"});
    std::vector<std::pair<std::string, int64_t>> step_calls;
    const std::map<std::string, Tensor> values =
        attention_step(graph, mesh, plan, x, target, [&] { step_calls = ledger->calls; });
    ASSERT_EQ(values.size(), reference.size());
    for (const auto& [name, value] : reference)
      EXPECT_LT(testing::relative_error(values.at(name), value), 1e-12) << name;
    // One step: exactly four all-reduces of A; besides them only the biases the plan splits
    // move (the pointwise add gathers a sharded bias, as for any column-parallel MatMul's bias,
    // and reduce-scatters its gradient): at most fc1's 16 f64.
    const int64_t activation = 2 * 6 * 8 * 8;
    std::vector<std::pair<std::string, int64_t>> reductions, others;
    for (const auto& call : step_calls)
      (call.first == "all_reduce" ? reductions : others).push_back(call);
    const std::vector<std::pair<std::string, int64_t>> expected(4, {"all_reduce", activation});
    EXPECT_EQ(reductions, expected);
    for (const auto& [kind, bytes] : others)
      EXPECT_TRUE((kind == "all_gather" || kind == "reduce_scatter") && bytes <= 16 * 8)
          << kind << " of " << bytes << " bytes";
  });
}

TEST(OnnxModel, UnsupportedOpIsOneErrorNamingNodeAndOpType) {
  io::OnnxGraph graph = reshape_graph(2);
  graph.nodes[5].op_type = "NonMaxSuppression";
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    try {
      nn::OnnxModel model(graph, mesh, DType::f64);
      ADD_FAILURE() << "expected an error";
    } catch (const InvalidArgument& error) {
      EXPECT_STREQ(error.what(),
                   "[onnx] node 'Relu_node' (NonMaxSuppression): op type 'NonMaxSuppression' is "
                   "not supported (no sharded op and no fallback; see docs/models.md)");
    }
  });
}

TEST(OnnxModel, BadAttributeIsRefusedWhenTheModelIsBuilt) {
  io::OnnxGraph graph = reshape_graph(2);
  graph.nodes[5] = node("MaxPool", {"r"}, {"y"});
  graph.nodes[5].attributes["kernel_shape"] = integers({2});
  graph.nodes[5].attributes["pads"] = integers({0, 1});
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    EXPECT_THROW(
        {
          try {
            nn::OnnxModel model(graph, mesh, DType::f64);
          } catch (const InvalidArgument& error) {
            EXPECT_NE(std::string(error.what()).find("node 'MaxPool_node' (MaxPool): asymmetric"),
                      std::string::npos)
                << error.what();
            throw;
          }
        },
        InvalidArgument);
  });
}

TEST(OnnxGraph, ValidationNamesTheNodeAndTheMissingInput) {
  io::OnnxGraph graph = reshape_graph(2);
  std::swap(graph.nodes[0], graph.nodes[1]);  // Shape before the Transpose defining its input
  try {
    io::validate_onnx_graph(graph);
    ADD_FAILURE() << "expected an error";
  } catch (const InvalidArgument& error) {
    EXPECT_STREQ(error.what(),
                 "[onnx] node 'Shape_node' (Shape): input 't' is not defined before the node (a "
                 "graph input, an initializer or an earlier node's output)");
  }
  graph = reshape_graph(2);
  graph.opset = 11;
  EXPECT_THROW(io::validate_onnx_graph(graph), InvalidArgument);
}

TEST(OnnxGraph, TruncatedAndCorruptedFilesAreOneInvalidArgument) {
  if (!io::onnx_available()) GTEST_SKIP() << "built without ONNX support";
  std::ifstream in(testing::fixture_dir("onnx") + "unet2d.opset13.onnx", std::ios::binary);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  ASSERT_GT(bytes.size(), 1000u);
  EXPECT_NO_THROW(io::parse_onnx(bytes, "unet2d"));
  uint64_t state = 12345;
  auto next = [&state] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return state >> 33;
  };
  int refused = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::string damaged = bytes;
    if (trial % 2 == 0) {
      damaged.resize(next() % bytes.size());
    } else {
      for (int flip = 0; flip < 4; ++flip) damaged[next() % damaged.size()] ^= (1 << (next() % 8));
    }
    try {
      io::parse_onnx(damaged, "damaged");
    } catch (const InvalidArgument& error) {
      ++refused;
      EXPECT_EQ(std::string(error.what()).rfind("[onnx] ", 0), 0u) << error.what();
    }
  }
  EXPECT_GT(refused, 100);  // every truncation but the harmless ones is refused
}

}  // namespace
}  // namespace tessera
