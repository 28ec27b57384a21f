// Model parallelism of imported graphs as pure functions (ops/nn/onnx_partition.hpp): the cut
// points are exactly the places one activation crosses (a residual, or a parameter read on both
// sides, rules a place out), balanced cuts even out the stages' parameters, a stage's subgraph
// carries the constants and initializers it reads, and the tensor-parallel plan finds the MLP
// and Conv..Conv patterns (column- then row-parallel; ConvTranspose as either product) and nothing
// where a value leaves the region, and attention (fused or separate q/k/v projections .. output
// projection) split in whole heads.
#include "ops/nn/onnx_partition.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/errors.hpp"

namespace tessera::nn {
namespace {

using io::OnnxGraph;
using io::OnnxNode;

/// A float initializer of `shape` (values 0.5: only shapes and element counts matter here).
Tensor weight(const Shape& shape) {
  const std::vector<double> values(static_cast<size_t>(shape_numel(shape)), 0.5);
  return Tensor::from_values<double>(shape, values);
}

OnnxNode node(const std::string& op, std::vector<std::string> inputs,
              std::vector<std::string> outputs) {
  OnnxNode result;
  result.name = "/" + outputs[0];
  result.op_type = op;
  result.inputs = std::move(inputs);
  result.outputs = std::move(outputs);
  return result;
}

OnnxNode scalar_constant(const std::string& output) {
  OnnxNode result = node("Constant", {}, {output});
  io::OnnxAttribute value;
  value.kind = io::OnnxAttribute::Kind::tensor;
  value.tensor = weight({});
  result.attributes["value"] = value;
  return result;
}

/// The erf form of GELU PyTorch exports, from `x` to `y` (names prefixed by `p`).
void append_gelu(OnnxGraph& graph, const std::string& x, const std::string& y,
                 const std::string& p) {
  graph.nodes.push_back(scalar_constant(p + "sqrt2"));
  graph.nodes.push_back(node("Div", {x, p + "sqrt2"}, {p + "div"}));
  graph.nodes.push_back(node("Erf", {p + "div"}, {p + "erf"}));
  graph.nodes.push_back(scalar_constant(p + "one"));
  graph.nodes.push_back(node("Add", {p + "erf", p + "one"}, {p + "add"}));
  graph.nodes.push_back(node("Mul", {x, p + "add"}, {p + "mul"}));
  graph.nodes.push_back(scalar_constant(p + "half"));
  graph.nodes.push_back(node("Mul", {p + "mul", p + "half"}, {y}));
}

OnnxGraph graph_with_io() {
  OnnxGraph graph;
  graph.source = "test.onnx";
  graph.opset = 17;
  graph.inputs = {io::OnnxValue{"x", 11, {-1, 2, -1, -1}}};
  graph.outputs = {io::OnnxValue{"y", 11, {-1, 2, -1, -1}}};
  return graph;
}

/// The training fixture's net: Conv(2 -> 4) -> GELU -> Conv(4 -> 2).
OnnxGraph conv_gelu_conv() {
  OnnxGraph graph = graph_with_io();
  graph.initializers = {{"w1", weight({4, 2, 3, 3})},
                        {"b1", weight({4})},
                        {"w2", weight({2, 4, 3, 3})},
                        {"b2", weight({2})}};
  graph.nodes.push_back(node("Conv", {"x", "w1", "b1"}, {"c1"}));
  append_gelu(graph, "c1", "g", "gelu/");
  graph.nodes.push_back(node("Conv", {"g", "w2", "b2"}, {"y"}));
  return graph;
}

/// Linear layers as PyTorch exports them on [B, S, C]: MatMul with the transposed weight, then
/// the Add of the bias; `sizes` the features from input to output, ReLU between the layers.
OnnxGraph linear_chain(const std::vector<int64_t>& sizes) {
  OnnxGraph graph = graph_with_io();
  std::string value = "x";
  for (size_t l = 0; l + 1 < sizes.size(); ++l) {
    const std::string w = "w" + std::to_string(l), b = "b" + std::to_string(l);
    graph.initializers.emplace_back(w, weight({sizes[l], sizes[l + 1]}));
    graph.initializers.emplace_back(b, weight({sizes[l + 1]}));
    graph.nodes.push_back(node("MatMul", {value, w}, {"mm" + std::to_string(l)}));
    const bool last = l + 2 == sizes.size();
    const std::string sum = last ? "y" : "lin" + std::to_string(l);
    graph.nodes.push_back(node("Add", {b, "mm" + std::to_string(l)}, {sum}));
    if (!last) {
      graph.nodes.push_back(node("Relu", {sum}, {"act" + std::to_string(l)}));
      value = "act" + std::to_string(l);
    }
  }
  return graph;
}

std::vector<std::string> tensors(const std::vector<OnnxCutPoint>& cuts) {
  std::vector<std::string> names;
  for (const OnnxCutPoint& cut : cuts) names.push_back(cut.tensor);
  return names;
}

TEST(OnnxCutPoints, ConvGeluConvCutsWhereOneActivationCrosses) {
  // Inside GELU both c1 and the erf branch are alive; after its first Mul only one value is.
  EXPECT_EQ(tensors(onnx_cut_points(conv_gelu_conv())),
            (std::vector<std::string>{"c1", "gelu/mul", "g"}));
}

TEST(OnnxCutPoints, ResidualFromTheInputLeavesNoCut) {
  OnnxGraph graph = graph_with_io();
  graph.initializers = {{"w", weight({2, 2, 1, 1})}};
  graph.nodes.push_back(node("Conv", {"x", "w"}, {"c"}));
  graph.nodes.push_back(node("Relu", {"c"}, {"r"}));
  graph.nodes.push_back(node("Add", {"x", "r"}, {"y"}));
  EXPECT_TRUE(onnx_cut_points(graph).empty());
}

TEST(OnnxCutPoints, ParameterReadOnBothSidesIsNoCut) {
  OnnxGraph graph = graph_with_io();
  graph.initializers = {{"w", weight({8, 8})}};
  graph.nodes.push_back(node("MatMul", {"x", "w"}, {"a"}));
  graph.nodes.push_back(node("Relu", {"a"}, {"r"}));
  graph.nodes.push_back(node("MatMul", {"r", "w"}, {"y"}));  // tied weight
  EXPECT_TRUE(onnx_cut_points(graph).empty());
}

TEST(OnnxStageCuts, BalancedCutsEvenTheParameters) {
  // Weights 8x32, 32x4, 4x32 (+ biases): 288 | 132 + 160 beats 288 + 132 | 160.
  const OnnxGraph graph = linear_chain({8, 32, 4, 32});
  const std::vector<OnnxCutPoint> cuts = balanced_stage_cuts(graph, 2, "train", "--pp 2");
  ASSERT_EQ(cuts.size(), 1u);
  const OnnxStageCost first = onnx_stage_cost(graph, 0, cuts[0].position);
  const OnnxStageCost second = onnx_stage_cost(graph, cuts[0].position, graph.nodes.size());
  EXPECT_EQ(first.parameters, 8 * 32 + 32);
  EXPECT_EQ(second.parameters, 32 * 4 + 4 + 4 * 32 + 32);
  // Three stages: the best split puts the first weight alone (its bias goes on with the next
  // layer, 256 | 32 + 132 | 160), found among every choice of two cut points.
  const std::vector<OnnxCutPoint> three = balanced_stage_cuts(graph, 3, "train", "--pp 3");
  ASSERT_EQ(three.size(), 2u);
  const std::vector<size_t> bounds{0, three[0].position, three[1].position, graph.nodes.size()};
  int64_t largest = 0;
  for (size_t s = 0; s < 3; ++s)
    largest = std::max(largest, onnx_stage_cost(graph, bounds[s], bounds[s + 1]).parameters);
  EXPECT_EQ(largest, 8 * 32);
}

TEST(OnnxStageCuts, TooFewCutPointsIsAnErrorNamingThem) {
  try {
    balanced_stage_cuts(conv_gelu_conv(), 5, "train", "--pp 5");
    FAIL() << "expected an error";
  } catch (const InvalidArgument& error) {
    const std::string text = error.what();
    EXPECT_NE(text.find("--pp 5"), std::string::npos) << text;
    EXPECT_NE(text.find("3 cut point(s)"), std::string::npos) << text;
    EXPECT_NE(text.find("too few for 5 stages"), std::string::npos) << text;
  }
}

TEST(OnnxStageCuts, NamedCutsMustBeCutPointsInOrder) {
  const OnnxGraph graph = conv_gelu_conv();
  EXPECT_EQ(tensors(named_stage_cuts(graph, {"c1", "g"}, "train")),
            (std::vector<std::string>{"c1", "g"}));
  EXPECT_THROW(named_stage_cuts(graph, {"gelu/div"}, "train"), InvalidArgument);
  EXPECT_THROW(named_stage_cuts(graph, {"g", "c1"}, "train"), InvalidArgument);
}

TEST(OnnxStageGraph, StagesCarryTheirConstantsAndInitializers) {
  // The Constant 0.5 of GELU moved to the front: both stages read it, so both hold it.
  OnnxGraph graph = conv_gelu_conv();
  const auto half = std::find_if(graph.nodes.begin(), graph.nodes.end(),
                                 [](const OnnxNode& n) { return n.outputs[0] == "gelu/half"; });
  std::rotate(graph.nodes.begin(), half, half + 1);
  const std::vector<OnnxCutPoint> cuts = named_stage_cuts(graph, {"gelu/mul"}, "train");
  const OnnxGraph first = onnx_stage_graph(graph, cuts, 0);
  const OnnxGraph second = onnx_stage_graph(graph, cuts, 1);
  EXPECT_EQ(first.inputs[0].name, "x");
  EXPECT_EQ(first.outputs[0].name, "gelu/mul");
  EXPECT_EQ(second.inputs[0].name, "gelu/mul");
  EXPECT_EQ(second.outputs[0].name, "y");
  ASSERT_EQ(first.initializers.size(), 2u);
  EXPECT_EQ(first.initializers[0].first, "w1");
  ASSERT_EQ(second.initializers.size(), 2u);
  EXPECT_EQ(second.initializers[0].first, "w2");
  // Stage 1: the Constant (defined before the cut), the last Mul, the second Conv.
  ASSERT_EQ(second.nodes.size(), 3u);
  EXPECT_EQ(second.nodes[0].outputs[0], "gelu/half");
  EXPECT_EQ(second.nodes[1].op_type, "Mul");
  EXPECT_EQ(second.nodes[2].op_type, "Conv");
  EXPECT_EQ(first.nodes.size() + 2, graph.nodes.size());
  EXPECT_EQ(first.nodes[0].outputs[0], "gelu/half");
}

TEST(OnnxTensorParallelPlan, MlpColumnThenRowParallel) {
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(linear_chain({8, 16, 8}), 2);
  ASSERT_EQ(plan.patterns.size(), 1u);
  EXPECT_EQ(plan.patterns[0].kind, "mlp");
  EXPECT_EQ(plan.patterns[0].width, 16);
  // MatMul weights are [in, out]: column-parallel splits dim 1 (and the bias), row-parallel dim 0;
  // the second bias is added after the reduction, replicated.
  EXPECT_EQ(plan.sharded, (std::map<std::string, int>{{"w0", 1}, {"b0", 0}, {"w1", 0}}));
}

TEST(OnnxTensorParallelPlan, ConvFilterThenChannelParallel) {
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(conv_gelu_conv(), 2);
  ASSERT_EQ(plan.patterns.size(), 1u);
  EXPECT_EQ(plan.patterns[0].kind, "conv");
  EXPECT_EQ(plan.patterns[0].first, "/c1");
  EXPECT_EQ(plan.patterns[0].second, "/y");
  EXPECT_EQ(plan.sharded, (std::map<std::string, int>{{"w1", 0}, {"b1", 0}, {"w2", 1}}));
}

// ConvTranspose belongs to the conv family with its weight [in, out, k..] read the other way
// round: first in a pattern its dim 1 (and its bias) is split, second its dim 0. A grouped one, or
// one whose output feeds a Concat (as in a U-Net's decoder), is no pattern.
TEST(OnnxTensorParallelPlan, ConvTransposeFirstOrSecondInAConvPattern) {
  OnnxGraph graph = graph_with_io();
  graph.initializers = {{"w1", weight({2, 4, 3, 3})}, {"b1", weight({4})},
                        {"w2", weight({4, 4, 3, 3})}, {"w3", weight({4, 4, 3, 3})},
                        {"b3", weight({4})},          {"w4", weight({4, 2, 3, 3})},
                        {"b4", weight({2})}};
  graph.nodes.push_back(node("ConvTranspose", {"x", "w1", "b1"}, {"t1"}));
  append_gelu(graph, "t1", "g1", "gelu1/");
  graph.nodes.push_back(node("Conv", {"g1", "w2"}, {"c2"}));
  graph.nodes.push_back(node("Conv", {"c2", "w3", "b3"}, {"c3"}));
  append_gelu(graph, "c3", "g3", "gelu3/");
  graph.nodes.push_back(node("ConvTranspose", {"g3", "w4", "b4"}, {"y"}));
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(graph, 2);
  ASSERT_EQ(plan.patterns.size(), 2u);
  EXPECT_EQ(plan.patterns[0].kind, "conv");
  EXPECT_EQ(plan.patterns[0].first, "/t1");
  EXPECT_EQ(plan.patterns[0].second, "/c2");
  EXPECT_EQ(plan.patterns[0].width, 4);
  EXPECT_EQ(plan.patterns[1].first, "/c3");
  EXPECT_EQ(plan.patterns[1].second, "/y");
  EXPECT_EQ(plan.sharded, (std::map<std::string, int>{
                              {"w1", 1}, {"b1", 0}, {"w2", 1}, {"w3", 0}, {"b3", 0}, {"w4", 0}}));

  io::OnnxAttribute groups;
  groups.kind = io::OnnxAttribute::Kind::integer;
  groups.integer = 2;
  OnnxGraph grouped = graph;
  grouped.nodes.back().attributes["group"] = groups;
  grouped.initializers.back() = {"w4", weight({4, 1, 3, 3})};
  EXPECT_EQ(onnx_tensor_parallel_plan(grouped, 2).patterns.size(), 1u);

  OnnxGraph concat = graph;  // the first ConvTranspose's output concatenated with the input
  concat.nodes.insert(concat.nodes.begin() + 1, node("Concat", {"t1", "x"}, {"cat"}));
  concat.outputs.push_back(io::OnnxValue{"cat", 11, {}});
  EXPECT_EQ(onnx_tensor_parallel_plan(concat, 2).patterns.size(), 1u);
}

TEST(OnnxTensorParallelPlan, WidthNotDividedIsSkipped) {
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(conv_gelu_conv(), 3);
  EXPECT_TRUE(plan.patterns.empty());
  ASSERT_EQ(plan.skipped.size(), 1u);
  EXPECT_EQ(plan.skipped[0].width, 4);
  EXPECT_TRUE(plan.sharded.empty());
}

TEST(OnnxTensorParallelPlan, GemmWithTransposedWeight) {
  OnnxGraph graph = graph_with_io();
  graph.initializers = {
      {"w1", weight({16, 8})}, {"b1", weight({16})}, {"w2", weight({8, 16})}, {"b2", weight({8})}};
  io::OnnxAttribute trans;
  trans.kind = io::OnnxAttribute::Kind::integer;
  trans.integer = 1;
  graph.nodes.push_back(node("Gemm", {"x", "w1", "b1"}, {"h"}));
  graph.nodes.back().attributes["transB"] = trans;
  graph.nodes.push_back(node("Tanh", {"h"}, {"t"}));
  graph.nodes.push_back(node("Gemm", {"t", "w2", "b2"}, {"y"}));
  graph.nodes.back().attributes["transB"] = trans;
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(graph, 4);
  ASSERT_EQ(plan.patterns.size(), 1u);
  EXPECT_EQ(plan.sharded, (std::map<std::string, int>{{"w1", 0}, {"b1", 0}, {"w2", 1}}));
}

TEST(OnnxTensorParallelPlan, ValueLeavingTheRegionIsNoPattern) {
  // The hidden activation is also a graph output: its features would stay split.
  OnnxGraph graph = linear_chain({8, 16, 8});
  graph.outputs.push_back(io::OnnxValue{"act0", 11, {}});
  EXPECT_TRUE(onnx_tensor_parallel_plan(graph, 2).patterns.empty());
  // A non-elementwise op (Softmax over the split features) inside the region.
  OnnxGraph softmax = linear_chain({8, 16, 8});
  softmax.nodes[2] = node("Softmax", {"lin0"}, {"act0"});
  EXPECT_TRUE(onnx_tensor_parallel_plan(softmax, 2).patterns.empty());
}

/// An int64 initializer (shapes, Slice bounds).
Tensor integers(const std::vector<int64_t>& values) {
  return Tensor::from_values<int64_t>({static_cast<int64_t>(values.size())}, values);
}

OnnxNode transpose(const std::string& x, const std::string& y, std::vector<int64_t> perm) {
  OnnxNode result = node("Transpose", {x}, {y});
  io::OnnxAttribute attribute;
  attribute.kind = io::OnnxAttribute::Kind::integers;
  attribute.integers = std::move(perm);
  result.attributes["perm"] = attribute;
  return result;
}

/// A self-attention block on x [B, S, 8] with 2 heads of 4, as PyTorch exports it: q, k and v
/// from one fused MatMul [8, 24] (+ bias) cut by three Slices, or from three MatMuls; heads by
/// Reshape to `head_shape` and Transpose, softmax(q k^T / 2) v, heads merged back, the output
/// projection [8, 8] (+ bias).
OnnxGraph attention_block(bool fused, const std::string& head_shape = "heads") {
  OnnxGraph graph = graph_with_io();
  graph.inputs = {io::OnnxValue{"x", 11, {-1, -1, 8}}};
  graph.outputs = {io::OnnxValue{"y", 11, {-1, -1, 8}}};
  graph.initializers = {{"heads", integers({0, 0, 2, 4})},
                        {"merged", integers({0, 0, 8})},
                        {"wo", weight({8, 8})},
                        {"bo", weight({8})}};
  std::vector<std::string> parts = {"q", "k", "v"};
  if (fused) {
    graph.initializers.emplace_back("wqkv", weight({8, 24}));
    graph.initializers.emplace_back("bqkv", weight({24}));
    graph.initializers.emplace_back("axis", integers({-1}));
    graph.nodes.push_back(node("MatMul", {"x", "wqkv"}, {"qkv_mm"}));
    graph.nodes.push_back(node("Add", {"bqkv", "qkv_mm"}, {"qkv"}));
    for (int p = 0; p < 3; ++p) {
      const std::string start = "start" + std::to_string(p), end = "end" + std::to_string(p);
      graph.initializers.emplace_back(start, integers({8 * p}));
      graph.initializers.emplace_back(end, integers({8 * p + 8}));
      graph.nodes.push_back(node("Slice", {"qkv", start, end, "axis"}, {parts[p]}));
    }
  } else {
    for (const std::string& part : parts) {
      graph.initializers.emplace_back("w" + part, weight({8, 8}));
      graph.initializers.emplace_back("b" + part, weight({8}));
      graph.nodes.push_back(node("MatMul", {"x", "w" + part}, {part + "_mm"}));
      graph.nodes.push_back(node("Add", {"b" + part, part + "_mm"}, {part}));
    }
  }
  for (const std::string& part : parts)
    graph.nodes.push_back(node("Reshape", {part, head_shape}, {part + "h"}));
  graph.nodes.push_back(transpose("qh", "qt", {0, 2, 1, 3}));
  graph.nodes.push_back(transpose("kh", "kt", {0, 2, 3, 1}));
  graph.nodes.push_back(transpose("vh", "vt", {0, 2, 1, 3}));
  graph.nodes.push_back(node("MatMul", {"qt", "kt"}, {"scores"}));
  graph.nodes.push_back(scalar_constant("scale"));
  graph.nodes.push_back(node("Div", {"scores", "scale"}, {"scaled"}));
  graph.nodes.push_back(node("Softmax", {"scaled"}, {"probs"}));
  graph.nodes.push_back(node("MatMul", {"probs", "vt"}, {"heads_out"}));
  graph.nodes.push_back(transpose("heads_out", "ot", {0, 2, 1, 3}));
  graph.nodes.push_back(node("Reshape", {"ot", "merged"}, {"om"}));
  graph.nodes.push_back(node("MatMul", {"om", "wo"}, {"proj"}));
  graph.nodes.push_back(node("Add", {"bo", "proj"}, {"y"}));
  return graph;
}

TEST(OnnxTensorParallelPlan, FusedQkvAttentionSplitsWholeHeads) {
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(attention_block(true), 2);
  ASSERT_EQ(plan.patterns.size(), 1u);
  EXPECT_EQ(plan.patterns[0].kind, "attention");
  EXPECT_EQ(plan.patterns[0].first, "/qkv_mm");
  EXPECT_EQ(plan.patterns[0].second, "/proj");
  EXPECT_EQ(plan.patterns[0].width, 2);  // the heads
  // The fused weight and bias are split on dim 1 of their stacked layouts ([3 * 8, 8], [3, 8]),
  // the output projection on its in features; its bias is added after the reduction.
  EXPECT_EQ(plan.sharded, (std::map<std::string, int>{{"wqkv", 1}, {"bqkv", 1}, {"wo", 0}}));
  ASSERT_EQ(plan.fused.size(), 1u);
  EXPECT_EQ(plan.fused[0].node, "/qkv_mm");
  EXPECT_EQ(plan.fused[0].bias_node, "/qkv");
  EXPECT_EQ(plan.fused[0].weight, "wqkv");
  EXPECT_EQ(plan.fused[0].bias, "bqkv");
  EXPECT_EQ(plan.fused[0].parts, 3);
  EXPECT_TRUE(plan.notes.empty());
}

TEST(OnnxTensorParallelPlan, SeparateQkvProjectionsAreColumnParallel) {
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(attention_block(false), 2);
  ASSERT_EQ(plan.patterns.size(), 1u);
  EXPECT_EQ(plan.patterns[0].kind, "attention");
  EXPECT_EQ(plan.patterns[0].first, "/q_mm");
  EXPECT_EQ(plan.patterns[0].width, 2);
  EXPECT_EQ(plan.sharded,
            (std::map<std::string, int>{
                {"wq", 1}, {"bq", 0}, {"wk", 1}, {"bk", 0}, {"wv", 1}, {"bv", 0}, {"wo", 0}}));
  EXPECT_TRUE(plan.fused.empty());
}

TEST(OnnxTensorParallelPlan, AttentionHeadsNotDividedIsSkipped) {
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(attention_block(true), 4);
  EXPECT_TRUE(plan.patterns.empty());
  ASSERT_EQ(plan.skipped.size(), 1u);
  EXPECT_EQ(plan.skipped[0].kind, "attention");
  EXPECT_EQ(plan.skipped[0].width, 2);
  EXPECT_TRUE(plan.sharded.empty());
  EXPECT_TRUE(plan.fused.empty());
}

TEST(OnnxTensorParallelPlan, AttentionWithoutKnownHeadsIsANote) {
  // The heads' shape read from the data (the Shape of x): no constant head count.
  OnnxGraph graph = attention_block(true, "data_shape");
  graph.nodes.insert(graph.nodes.begin(), node("Shape", {"x"}, {"data_shape"}));
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(graph, 2);
  EXPECT_TRUE(plan.patterns.empty());
  EXPECT_TRUE(plan.sharded.empty());
  ASSERT_EQ(plan.notes.size(), 1u);
  EXPECT_NE(plan.notes[0].find("'/qkv_mm' (MatMul)"), std::string::npos) << plan.notes[0];
  EXPECT_NE(plan.notes[0].find("head count"), std::string::npos) << plan.notes[0];
}

TEST(OnnxTensorParallelPlan, AttentionValueLeavingTheBlockIsANote) {
  // The attention probabilities are also a graph output: the heads would stay split there.
  OnnxGraph graph = attention_block(true);
  graph.outputs.push_back(io::OnnxValue{"probs", 11, {}});
  const OnnxTensorParallelPlan plan = onnx_tensor_parallel_plan(graph, 2);
  EXPECT_TRUE(plan.sharded.empty());
  ASSERT_EQ(plan.notes.size(), 1u);
  EXPECT_NE(plan.notes[0].find("'probs' is a graph output"), std::string::npos) << plan.notes[0];
}

}  // namespace
}  // namespace tessera::nn
