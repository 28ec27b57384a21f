// Model parallelism for imported ONNX graphs, as plain functions on io::OnnxGraph (no mesh, no
// data), so they are tested without communication:
//   - pipeline cuts: the places in the topologically ordered node list where exactly one
//     activation crosses (constants and parameters do not count: each stage keeps those it
//     uses), the choice of cuts that balances the stages, and the subgraph of one stage;
//   - the tensor-parallel plan: the Megatron and Distconv patterns found in the graph (a weighted
//     product, elementwise ops, a second weighted product of the same family; attention: the q, k
//     and v projections, the heads' Reshape/Transpose, products and Softmax, the output
//     projection) and which dim of which initializer the tp dim splits.
// A stage's subgraph is an ordinary OnnxGraph, so nn::OnnxModel runs it on the stage's mesh; the
// plan is a map from initializer name to the tensor dim to shard, which OnnxModel applies when it
// makes the Parameters (the linear and conv op rules do the rest).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "io/onnx/onnx_graph.hpp"

namespace tessera::nn {

/// A place to cut a graph: nodes [0, position) before it, [position, n) after, and `tensor` the
/// one activation crossing.
struct OnnxCutPoint {
  size_t position = 0;
  std::string tensor;
  bool operator==(const OnnxCutPoint&) const = default;
};

/// Every cut point of `graph` in node order, one per crossing tensor (the first position it is
/// the only crossing activation), each leaving a node with data on both sides. A float
/// initializer of more than one element (a parameter or a buffer) used on both sides makes a
/// place no cut point: its gradient would be split between two stages.
std::vector<OnnxCutPoint> onnx_cut_points(const io::OnnxGraph& graph);

/// The cost that balance_stage_cuts evens out: the elements of the parameters (float
/// initializers of more than one element) the nodes [begin, end) use, then the nodes with data.
struct OnnxStageCost {
  int64_t parameters = 0;
  int64_t nodes = 0;
};
OnnxStageCost onnx_stage_cost(const io::OnnxGraph& graph, size_t begin, size_t end);

/// `stages - 1` cut points of `graph` minimizing the largest stage's parameter elements (ties:
/// its node count), found exactly by dynamic programming over the cut points. Too few cut
/// points is an InvalidArgument tagged `op` naming `what` (e.g. "--pp 2") and the cut points.
std::vector<OnnxCutPoint> balanced_stage_cuts(const io::OnnxGraph& graph, int stages,
                                              const std::string& op, const std::string& what);

/// The cut points crossed by `tensors`, in graph order; a name that is no cut point, or names
/// out of order, is an InvalidArgument tagged `op` listing the cut points.
std::vector<OnnxCutPoint> named_stage_cuts(const io::OnnxGraph& graph,
                                           const std::vector<std::string>& tensors,
                                           const std::string& op);

/// Stage `stage` of `graph` cut at `cuts`: its nodes, preceded by the constant nodes before it
/// whose values it reads (a Constant used on both sides is in both), the initializers it uses,
/// as input the crossing tensor of the cut before it (stage 0: the graph's inputs) and as output
/// the one of the cut after it (the last: the graph's outputs). Intermediate values get the
/// graph input's element type and no static shape.
io::OnnxGraph onnx_stage_graph(const io::OnnxGraph& graph, const std::vector<OnnxCutPoint>& cuts,
                               int stage);

/// One tensor-parallel pattern found in a graph.
struct OnnxTensorParallelPattern {
  std::string kind;    ///< "mlp" (MatMul/Gemm ... MatMul/Gemm), "conv" (Conv/ConvTranspose ..)
                       ///< or "attention" (q/k/v projections ... output projection)
  std::string first;   ///< the column-parallel (filter-parallel) node; attention: the fused q/k/v
                       ///< MatMul, or the first of the separate q, k and v MatMuls
  std::string second;  ///< the row-parallel (channel-parallel) node
  int64_t width = 0;   ///< the hidden features (channels) split over tp; attention: the heads
};

/// A fused projection: one MatMul whose out features hold `parts` equal parts side by side (q, k
/// and v), each split over tp on its own, so that every rank computes whole heads of each part.
/// No contiguous shard of the weight [in, parts * width] gives that, so its Parameter holds the
/// parts stacked on the in features, [parts * in, width] (part p's columns are rows [p * in,
/// (p + 1) * in)), and the bias [parts * width] as [parts, width]: tp's Shard(1) of those gives
/// each rank the same slice of every part. Saving writes them back in the file's layout.
struct OnnxFusedProjection {
  std::string node;       ///< the MatMul
  std::string bias_node;  ///< the Add of its bias ("" without one)
  std::string weight;     ///< the weight initializer [in, parts * width]
  std::string bias;       ///< the bias initializer [parts * width] ("" without one)
  int64_t parts = 0;
};

/// Where tensor parallelism applies in a graph.
struct OnnxTensorParallelPlan {
  std::vector<OnnxTensorParallelPattern> patterns;  ///< those `tp` divides, in node order
  std::vector<OnnxTensorParallelPattern> skipped;   ///< those whose width `tp` does not divide
  /// Initializer name -> the tensor dim the tp dim splits; every other parameter replicates. For
  /// a fused projection's weight and bias: the dim of the stacked layout (OnnxFusedProjection).
  std::map<std::string, int> sharded;
  /// The fused projections of the planned attention patterns (their initializers are in
  /// `sharded`).
  std::vector<OnnxFusedProjection> fused;
  /// What looked like attention but was left replicated, and why (for --verbose and --json).
  std::vector<std::string> notes;
};

/// The tensor-parallel plan of `graph` over `tp` ranks. A pattern: a weighted product P1 (MatMul
/// with a 2-d float initializer as b, optionally followed by the Add of a 1-d initializer bias;
/// Gemm with an initializer b; Conv or ConvTranspose of group 1 with an initializer weight, whose
/// out and in channels are its weight's dims 0 and 1, or 1 and 0), then only elementwise
/// ops (unary ones, and binary ones whose other operand is a scalar constant or another value of
/// the region), then a second product P2 of the same family taking the region's value as its
/// data input, with every value of the region used only inside it. P1's weight (and bias) is
/// split on its out features (channels), P2's weight on its in features; P2's bias replicates.
/// Weights used by more than one node are left alone.
/// Attention (found first): the q, k and v projections (one MatMul with a 2-d weight whose output
/// only Slice or Split nodes read, in whole parts, and Shape nodes; or three MatMuls of one input
/// with weights of one width, each optionally followed by its bias Add), then only Reshape,
/// Transpose, MatMuls of two such values, Softmax and elementwise ops as above, then a MatMul
/// with a 2-d weight (the output projection) taking the region's value as its data input. The
/// heads come from the Reshape of each part ([.., E] -> [.., h, E / h], the target a constant or
/// a Concat of shape pieces whose h or E / h piece is a constant); the projections are split on
/// their out features in whole heads, the output projection on its in features. A pattern whose
/// heads `tp` does not divide is in `skipped`; a candidate that is not recognised is a note.
OnnxTensorParallelPlan onnx_tensor_parallel_plan(const io::OnnxGraph& graph, int tp);

}  // namespace tessera::nn
