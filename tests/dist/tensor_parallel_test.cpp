// Tensor parallelism (ops/nn/tensor_parallel.hpp, the linear rule's column/row-parallel layouts,
// split_last/merge_last): the rule's layouts; 10 steps of SGD with momentum and of AdamW (f64)
// give the losses and final parameters of the one-rank run of the plain layers (1e-10 relative)
// for the MLP and the attention block over tp 2 and 4, a sequence-parallel transformer block
// (uneven sequence shards), convolutions filter- and channel-parallel alone and with spatial
// sharding, conv / conv_transpose pairs (either one filter-parallel, the other channel-parallel)
// alone and with spatial sharding, and dp 2 x tp 2 (x domain 2) with the data-parallel reducer; the
// bytes every collective moves in a step equal the analytic volume; bad input is one clear error on
// every rank.
#include "ops/nn/tensor_parallel.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>

#include "core/tessera.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"
#include "tests/dist/counting_comm.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"
#include "tests/dist/training_support.hpp"

namespace tessera {
namespace {

using testing::CountingComm;
using testing::expect_close;
using testing::RunResult;
using testing::values_of;

/// The model of a run: which block, its sizes; a mesh and how the data lies on it.
enum class Block {
  mlp,
  attention,
  transformer,
  filter_conv,
  channel_conv,
  conv_pair,
  conv_transpose_pair,
  transpose_conv_pair
};

bool is_conv(Block block) {
  return block == Block::filter_conv || block == Block::channel_conv || block == Block::conv_pair ||
         block == Block::conv_transpose_pair || block == Block::transpose_conv_pair;
}

struct Layout {
  std::vector<int> shape;
  std::vector<std::string> names;
  std::vector<Placement> placements;  ///< of x and target [B, S, E]
  std::vector<std::vector<int64_t>> extents;
  nn::TensorParallelOptions tp;
  bool ddp = false;  ///< gradients through the bucketed reducer
};

constexpr int64_t kBatch = 4, kSequence = 7, kEmbed = 8, kHeads = 4, kHidden = 16;

std::shared_ptr<nn::Module> make_block(const DeviceMesh& mesh, Block block,
                                       const nn::TensorParallelOptions& tp) {
  switch (block) {
    case Block::mlp:
      return std::make_shared<nn::ParallelMlp>(mesh, kEmbed, kHidden, 11, DType::f64, tp);
    case Block::attention:
      return std::make_shared<nn::ParallelAttention>(mesh, kEmbed, kHeads, 21, DType::f64, tp);
    case Block::transformer:
      return std::make_shared<nn::ParallelTransformerBlock>(mesh, kEmbed, kHeads, kHidden, 31,
                                                            DType::f64, tp);
    default: break;
  }
  // Convolutions on x [N, 2, 11, 9], k3, padding same: filter-parallel 2 -> 4, channel-parallel
  // 2 -> 3, and the pair filter-parallel 2 -> 4, tanh, channel-parallel 4 -> 2.
  auto config = [](int64_t in, int64_t out) {
    return nn::ConvConfig{.in_channels = in, .out_channels = out, .dtype = DType::f64};
  };
  if (block == Block::filter_conv)
    return std::make_shared<nn::FilterParallelConv>(mesh, config(2, 4), 41, tp);
  if (block == Block::channel_conv)
    return std::make_shared<nn::ChannelParallelConv>(mesh, config(2, 3), 42, tp);
  auto pair = std::make_shared<nn::Sequential>();
  // With transposed convolutions: a strided conv down (11 x 9 -> 6 x 5), filter-parallel 2 -> 4,
  // tanh, and a strided transposed conv back up, channel-parallel 4 -> 2; or a transposed conv
  // filter-parallel 2 -> 4 (stride 1, dilation 2, 11 x 9 -> 13 x 11), tanh, and a conv
  // channel-parallel 4 -> 2 back to 11 x 9.
  if (block == Block::conv_transpose_pair) {
    nn::ConvConfig down = config(2, 4);
    down.options.stride = {2};
    down.options.padding = {1};
    down.options.padding_name = "";
    pair->append(std::make_shared<nn::FilterParallelConv>(mesh, down, 45, tp));
    pair->append(std::make_shared<nn::Activation>("tanh"));
    pair->append(std::make_shared<nn::ChannelParallelConvTranspose>(
        mesh,
        nn::ConvTransposeConfig{.in_channels = 4,
                                .out_channels = 2,
                                .kernel = 3,
                                .dtype = DType::f64,
                                .options = {.stride = {2}, .padding = {1}}},
        46, tp));
    return pair;
  }
  if (block == Block::transpose_conv_pair) {
    pair->append(std::make_shared<nn::FilterParallelConvTranspose>(
        mesh,
        nn::ConvTransposeConfig{.in_channels = 2,
                                .out_channels = 4,
                                .kernel = 2,
                                .dtype = DType::f64,
                                .options = {.dilation = {2}}},
        47, tp));
    pair->append(std::make_shared<nn::Activation>("tanh"));
    nn::ConvConfig valid = config(4, 2);
    valid.options.padding_name = "valid";
    pair->append(std::make_shared<nn::ChannelParallelConv>(mesh, valid, 48, tp));
    return pair;
  }
  pair->append(std::make_shared<nn::FilterParallelConv>(mesh, config(2, 4), 43, tp));
  pair->append(std::make_shared<nn::Activation>("tanh"));
  pair->append(std::make_shared<nn::ChannelParallelConv>(mesh, config(4, 2), 44, tp));
  return pair;
}

using testing::adamw;
using testing::MakeOptimizer;
using testing::sgd;

/// x and target (small integers / 4) laid out as `layout` says: [B, S, E], or for the
/// convolutions x [4, 2, 11, 9] and the target of the block's output channels.
std::pair<ShardTensor, ShardTensor> data(const DeviceMesh& mesh, const Layout& layout,
                                         Block block) {
  testing::CaseRng rng(91);
  const Shape x_shape = is_conv(block) ? Shape{4, 2, 11, 9} : Shape{kBatch, kSequence, kEmbed};
  Shape y_shape = x_shape;
  if (block == Block::filter_conv) y_shape[1] = 4;
  if (block == Block::channel_conv) y_shape[1] = 3;
  auto values = [&](const Shape& shape) {
    Tensor t = testing::integer_tensor(shape, DType::f64, rng, -4, 4).to_dtype(DType::f64);
    for (double& v : std::span(t.data<double>(), t.numel())) v /= 4;
    return t;
  };
  const Tensor x = values(x_shape), target = values(y_shape);
  return {ShardTensor::distribute(x, mesh, layout.placements, layout.extents),
          ShardTensor::distribute(target, mesh, layout.placements, layout.extents)};
}

/// Every rank that holds the same shard of a parameter holds the same bits.
void expect_replicas_identical(const DeviceMesh& mesh, const Layout& layout, nn::Module& module,
                               int step) {
  std::vector<int> replica_dims;
  for (int m = 0; m < mesh.ndim(); ++m)
    if (mesh.names()[m] != layout.tp.dim) replica_dims.push_back(m);
  if (replica_dims.empty()) return;
  auto replicas = mesh.sub_comm(replica_dims);
  for (const Parameter& parameter : module.parameters()) {
    const std::vector<double> mine = values_of(parameter.tensor().to_local());
    std::vector<double> root = mine;
    replicas->broadcast(root.data(), root.size(), DType::f64, 0);
    EXPECT_EQ(std::memcmp(mine.data(), root.data(), mine.size() * sizeof(double)), 0)
        << parameter.name() << " differs between replicas after step " << step;
  }
}

RunResult train(std::shared_ptr<Comm> comm, const Layout& layout, Block block,
                const MakeOptimizer& make, int steps) {
  DeviceMesh mesh(comm, layout.shape, layout.names);
  auto model = make_block(mesh, block, layout.tp);
  auto optimizer = make(model->parameters());
  std::unique_ptr<nn::GradReducer> reducer;
  if (layout.ddp) reducer = std::make_unique<nn::GradReducer>(model->parameters());
  const auto [x, target] = data(mesh, layout, block);
  RunResult result;
  for (int step = 0; step < steps; ++step) {
    optimizer->zero_grad();
    {
      Tape tape;
      const ShardTensor loss = ops::mse_loss(model->forward(x), target);
      result.losses.push_back(values_of(loss.full_tensor())[0]);
      tape.backward(loss);
    }
    if (reducer) reducer->finish();
    optimizer->step();
    expect_replicas_identical(mesh, layout, *model, step);
  }
  for (const Parameter& parameter : model->parameters())
    result.parameters.push_back(values_of(parameter.tensor().full_tensor()));
  return result;
}

/// The plain layers on one rank (no tp dim).
Layout one_rank() {
  return {{1}, {"tp"}, {Placement::replicate()}, {}, nn::TensorParallelOptions{.dim = ""}};
}

/// tp over every rank of the world, the data replicated over it.
Layout tp_only(int world) {
  return {{world}, {"tp"}, {Placement::replicate()}, {}, {}};
}

/// Trains `block` on `layout` over `world` ranks with both optimizers and compares each with the
/// one-rank run of the plain layers.
void expect_trains_like_one_rank(int world, Block block, const Layout& layout,
                                 const std::string& what) {
  testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
    auto alone = comm->split(comm->rank(), 0);
    const RunResult sgd_reference = train(alone, one_rank(), block, sgd, 10);
    const RunResult adamw_reference = train(alone, one_rank(), block, adamw, 10);
    EXPECT_LT(adamw_reference.losses.back(), adamw_reference.losses.front());
    expect_close(train(comm, layout, block, sgd, 10), sgd_reference, what + " sgd");
    expect_close(train(comm, layout, block, adamw, 10), adamw_reference, what + " adamw");
  });
}

// The linear rule: w Shard(0) over a mesh dim gives y Shard(last) there from a replicated x;
// w Shard(1) moves x to Shard(last) with w's extents and gives y Partial(sum).
TEST(TensorParallel, LinearRuleGivesColumnAndRowParallelLayouts) {
  const std::vector<int> mesh{2, 3};
  const ShardSpec x = ShardSpec::make({4, 5, 6}, mesh, {Placement::shard(0), Placement::shard(1)});
  const RuleFn rule = find_op("linear")->rule;
  const ShardSpec column =
      ShardSpec::make({9, 6}, mesh, {Placement::replicate(), Placement::shard(0)}, {{}, {4, 3, 2}});
  const OpRule c = rule({x, column}, {});
  EXPECT_EQ(c.inputs[0].placements[1], Placement::replicate());  // x gathered over tp
  EXPECT_EQ(c.inputs[1], column);
  EXPECT_EQ(c.outputs[0].placements[0], Placement::shard(0));
  EXPECT_EQ(c.outputs[0].placements[1], Placement::shard(2));
  EXPECT_EQ(c.outputs[0].extents[1], (std::vector<int64_t>{4, 3, 2}));
  const ShardSpec row =
      ShardSpec::make({9, 6}, mesh, {Placement::replicate(), Placement::shard(1)}, {{}, {1, 2, 3}});
  const OpRule r = rule({x, row}, {});
  EXPECT_EQ(r.inputs[0].placements[1], Placement::shard(2));
  EXPECT_EQ(r.inputs[0].extents[1], (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(r.outputs[0].placements[0], Placement::shard(0));
  EXPECT_EQ(r.outputs[0].placements[1], Placement::partial(ReduceOp::sum));
  const ShardSpec bias =
      ShardSpec::make({9}, mesh, {Placement::replicate(), Placement::replicate()});
  EXPECT_THROW(rule({x, row, bias}, {}), Error);  // a bias counted once per rank of the sum
}

// split_last keeps a sharding in whole rows of `inner` (8 + 4 of 12 -> 2 + 1 heads of 4) and
// replicates one that is not (6 + 6); merge_last undoes it; values and gradients are the full
// tensor's reshape.
TEST(TensorParallel, SplitLastAndMergeLastKeepWholeHeadShardsAndMatchTheFullReshape) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"tp"});
    testing::CaseRng rng(7);
    const Tensor full = testing::integer_tensor({2, 3, 12}, DType::f64, rng, -9, 9);
    const Tensor weights = testing::integer_tensor({2, 3, 3, 4}, DType::f64, rng, -9, 9);
    const std::vector<double> expected = values_of(full);
    for (const std::vector<int64_t>& extents :
         {std::vector<int64_t>{8, 4}, std::vector<int64_t>{6, 6}}) {
      ShardTensor x = ShardTensor::distribute(full, mesh, {Placement::shard(2)}, {extents});
      x.set_requires_grad();
      Tape tape;
      const ShardTensor heads = ops::split_last(x, 4);
      EXPECT_EQ(heads.global_shape(), (Shape{2, 3, 3, 4}));
      if (extents[0] == 8) {
        EXPECT_EQ(heads.placements()[0], Placement::shard(2));
        EXPECT_EQ(heads.spec().extents[0], (std::vector<int64_t>{2, 1}));
      } else {
        EXPECT_EQ(heads.placements()[0], Placement::replicate());
      }
      EXPECT_EQ(values_of(heads.full_tensor()), expected);
      const ShardTensor merged = ops::merge_last(heads);
      EXPECT_EQ(merged.global_shape(), full.shape());
      EXPECT_EQ(values_of(merged.full_tensor()), expected);
      const ShardTensor w = ShardTensor::distribute(weights, mesh, {Placement::replicate()});
      tape.backward(ops::sum(ops::mul(heads, w)));
      EXPECT_EQ(values_of(tape.grad(x)->full_tensor()), values_of(weights));
    }
  });
}

// Each rank holds its slice of the weights (never the whole), and the activations have the
// layouts of Megatron's regions: Shard(last) after a column-parallel layer, replicated (or
// sequence-sharded with sequence parallelism) after a row-parallel one.
TEST(TensorParallel, LayersHoldTheirSlicesAndGiveTheRegionLayouts) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"tp"});
    nn::ColumnParallelLinear column(mesh, 8, 6, true, 1, DType::f64);
    nn::RowParallelLinear row(mesh, 6, 8, true, 2, DType::f64);
    nn::RowParallelLinear row_sp(mesh, 6, 8, true, 2, DType::f64, {.sequence_parallel = true});
    EXPECT_EQ(column.weight().tensor().to_local().shape(), (Shape{3, 8}));
    EXPECT_EQ(column.bias().tensor().to_local().shape(), (Shape{3}));
    EXPECT_EQ(row.weight().tensor().to_local().shape(), (Shape{8, 3}));
    EXPECT_EQ(row.bias().tensor().to_local().shape(), (Shape{8}));
    testing::CaseRng rng(5);
    const ShardTensor x = ShardTensor::distribute(
        testing::integer_tensor({2, 5, 8}, DType::f64, rng, -3, 3), mesh, {Placement::replicate()});
    const ShardTensor hidden = column.forward(x);
    EXPECT_EQ(hidden.placements()[0], Placement::shard(2));
    EXPECT_EQ(hidden.to_local().shape(), (Shape{2, 5, 3}));
    EXPECT_EQ(row.forward(hidden).placements()[0], Placement::replicate());
    EXPECT_EQ(row_sp.forward(hidden).placements()[0], Placement::shard(1));
  });
}

TEST(TensorParallel, MlpTrainsLikeOneRankOverTp2And4) {
  for (int world : {2, 4})
    expect_trains_like_one_rank(world, Block::mlp, tp_only(world), fmt::format("mlp tp {}", world));
}

TEST(TensorParallel, AttentionBlockTrainsLikeOneRankOverTp2And4) {
  for (int world : {2, 4})
    expect_trains_like_one_rank(world, Block::attention, tp_only(world),
                                fmt::format("attention tp {}", world));
}

// Sequence parallelism: x sharded along the sequence over tp (4 + 3 rows), the norms and residual
// adds on each rank's rows, all-gather / reduce-scatter at the region boundaries.
TEST(TensorParallel, SequenceParallelTransformerBlockTrainsLikeOneRank) {
  Layout layout{{2}, {"tp"}, {Placement::shard(1)}, {{4, 3}}, {.sequence_parallel = true}};
  expect_trains_like_one_rank(2, Block::transformer, layout, "transformer tp 2 sequence parallel");
}

// dp 2 x tp 2 (4 ranks, so mpiexec -n 4 runs it too): the batch over dp through the reducer,
// heads and features over tp, with and without sequence parallelism.
TEST(TensorParallel, DpTpTransformerBlockTrainsLikeOneRank) {
  Layout layout{{2, 2}, {"dp", "tp"}, {Placement::shard(0), Placement::replicate()}, {}, {}, true};
  expect_trains_like_one_rank(4, Block::transformer, layout, "transformer dp2 x tp2");
  // With sequence parallelism: the norms' gradients are Partial over dp and tp, reduced at once.
  Layout sequence{{2, 2},
                  {"dp", "tp"},
                  {Placement::shard(0), Placement::shard(1)},
                  {{}, {4, 3}},
                  {.sequence_parallel = true},
                  true};
  expect_trains_like_one_rank(4, Block::transformer, sequence,
                              "transformer dp2 x tp2 sequence parallel");
}

// dp 2 x tp 2 x domain 2: the batch over dp (the reducer averages), heads and features over tp,
// the sequence over domain (uneven 4 + 3; ring attention), on one mesh, with the model's code
// unchanged.
TEST(TensorParallel, DpTpDomainTransformerBlockTrainsLikeOneRank) {
  Layout layout{{2, 2, 2},
                {"dp", "tp", "domain"},
                {Placement::shard(0), Placement::replicate(), Placement::shard(1)},
                {{}, {}, {4, 3}},
                {},
                true};
  expect_trains_like_one_rank(8, Block::transformer, layout, "transformer dp2 x tp2 x domain2");
}

// Convolutions, tensor-parallel on tp 2 alone (channel-parallel taking x sharded on its
// channels) and with x also sharded in space over domain 2 (uneven rows 7 + 4): filter-parallel,
// channel-parallel, and the pair filter -> tanh -> channel (one all-reduce forward).
TEST(TensorParallel, ConvFilterAndChannelParallelTrainLikeOneRankAloneAndWithSpatialSharding) {
  const Layout tp2{{2}, {"tp"}, {Placement::replicate()}, {}, {}};
  const Layout channels{{2}, {"tp"}, {Placement::shard(1)}, {}, {}};
  const Layout tp2_domain2{
      {2, 2}, {"tp", "domain"}, {Placement::replicate(), Placement::shard(2)}, {{}, {7, 4}}, {}};
  const Layout channels_domain2{
      {2, 2}, {"tp", "domain"}, {Placement::shard(1), Placement::shard(2)}, {{}, {7, 4}}, {}};
  expect_trains_like_one_rank(2, Block::filter_conv, tp2, "filter-parallel conv tp 2");
  expect_trains_like_one_rank(2, Block::channel_conv, channels, "channel-parallel conv tp 2");
  expect_trains_like_one_rank(2, Block::conv_pair, tp2, "conv pair tp 2");
  expect_trains_like_one_rank(4, Block::filter_conv, tp2_domain2,
                              "filter-parallel conv tp 2 x domain 2");
  expect_trains_like_one_rank(4, Block::channel_conv, channels_domain2,
                              "channel-parallel conv tp 2 x domain 2");
  expect_trains_like_one_rank(4, Block::conv_pair, tp2_domain2, "conv pair tp 2 x domain 2");
}

// Transposed convolutions, tensor-parallel: a strided conv filter-parallel down, then a strided
// transposed conv channel-parallel up; and a transposed conv filter-parallel, then a conv
// channel-parallel; on tp 2 alone and with x sharded in space over domain 2 (uneven rows 7 + 4).
TEST(TensorParallel, ConvTransposePairsTrainLikeOneRankAloneAndWithSpatialSharding) {
  const Layout tp2{{2}, {"tp"}, {Placement::replicate()}, {}, {}};
  const Layout tp2_domain2{
      {2, 2}, {"tp", "domain"}, {Placement::replicate(), Placement::shard(2)}, {{}, {7, 4}}, {}};
  expect_trains_like_one_rank(2, Block::conv_transpose_pair, tp2, "conv -> conv_transpose tp 2");
  expect_trains_like_one_rank(2, Block::transpose_conv_pair, tp2, "conv_transpose -> conv tp 2");
  expect_trains_like_one_rank(4, Block::conv_transpose_pair, tp2_domain2,
                              "conv -> conv_transpose tp 2 x domain 2");
  expect_trains_like_one_rank(4, Block::transpose_conv_pair, tp2_domain2,
                              "conv_transpose -> conv tp 2 x domain 2");
}

// dp 2 x tp 2 x domain 2 for the conv pair: batch over dp, channels over tp, rows over domain.
TEST(TensorParallel, DpTpDomainConvPairTrainsLikeOneRank) {
  Layout layout{{2, 2, 2},
                {"dp", "tp", "domain"},
                {Placement::shard(0), Placement::replicate(), Placement::shard(2)},
                {{}, {}, {7, 4}},
                {},
                true};
  expect_trains_like_one_rank(8, Block::conv_pair, layout, "conv pair dp2 x tp2 x domain2");
}

/// The collectives (name, bytes) of one forward and backward of `block` on `layout`, x
/// requiring a gradient (as the output of an earlier layer does), loss sum(y * target); a first
/// step before counting creates the sub-communicators.
std::vector<std::pair<std::string, int64_t>> step_volume(std::shared_ptr<Comm> comm,
                                                         const Layout& layout, Block block) {
  auto ledger = std::make_shared<CountingComm::Ledger>();
  auto counting = std::make_shared<CountingComm>(comm, ledger);
  DeviceMesh mesh(counting, layout.shape, layout.names);
  auto model = make_block(mesh, block, layout.tp);
  auto [x, target] = data(mesh, layout, block);
  x.set_requires_grad();
  for (int step = 0; step < 2; ++step) {
    {
      std::lock_guard lock(ledger->mutex);
      ledger->calls.clear();
    }
    Tape tape;
    const ShardTensor y = model->forward(x);
    tape.backward(ops::sum(ops::mul(y, target)));
  }
  return ledger->calls;
}

// Per step on tp t, activations A = B x S x E f64: the MLP and the attention block all-reduce A
// once forward (after the row-parallel layer) and once backward (x's gradient, each rank's share
// of the column-parallel layers' contraction); nothing else moves. The conv pair likewise: its
// output forward (after the channel-parallel conv), x's gradient backward (filter-parallel).
TEST(TensorParallel, CommunicationPerStepEqualsTheAnalyticVolume) {
  for (int world : {2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      const int64_t activation = kBatch * kSequence * kEmbed * 8;
      const std::vector<std::pair<std::string, int64_t>> expected{{"all_reduce", activation},
                                                                  {"all_reduce", activation}};
      for (Block block : {Block::mlp, Block::attention})
        EXPECT_EQ(step_volume(comm, tp_only(world), block), expected)
            << "block " << static_cast<int>(block) << " tp " << world;
      if (world == 2) {  // the conv pair's 4 channels over tp 2: its output and x [4, 2, 11, 9]
        const int64_t field = 4 * 2 * 11 * 9 * 8;
        const std::vector<std::pair<std::string, int64_t>> conv_expected{{"all_reduce", field},
                                                                         {"all_reduce", field}};
        EXPECT_EQ(step_volume(comm, tp_only(world), Block::conv_pair), conv_expected);
        // With a transposed conv as either half: the same two all-reduces of the [4, 2, 11, 9]
        // output and input gradient (the narrow middle [4, 4, 6, 5] or [4, 4, 13, 11] never
        // moves).
        EXPECT_EQ(step_volume(comm, tp_only(world), Block::conv_transpose_pair), conv_expected);
        EXPECT_EQ(step_volume(comm, tp_only(world), Block::transpose_conv_pair), conv_expected);
      }
    });
  }
}

// Sequence parallelism replaces each all-reduce by an all-gather and a reduce-scatter of the
// same A (forward: gather x before the column-parallel layer, scatter after the row-parallel
// one; backward the adjoints in reverse order). The row-parallel bias is replicated but sees
// only this rank's sequence rows, so its gradient (E f64) is summed over tp once, as soon as it
// is final (right after the bias add's backward).
TEST(TensorParallel, SequenceParallelMovesAGatherAndAScatterInsteadOfEachAllReduce) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    const int64_t activation = kBatch * kSequence * kEmbed * 8;
    const Layout layout{{2}, {"tp"}, {Placement::shard(1)}, {{4, 3}}, {.sequence_parallel = true}};
    const std::vector<std::pair<std::string, int64_t>> expected{{"all_gather", activation},
                                                                {"reduce_scatter", activation},
                                                                {"all_reduce", kEmbed * 8},
                                                                {"all_gather", activation},
                                                                {"reduce_scatter", activation}};
    EXPECT_EQ(step_volume(comm, layout, Block::mlp), expected);
  });
}

// Bad input: one clear error naming the layer, the same on every rank.
TEST(TensorParallel, BadInputIsOneClearErrorOnEveryRank) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {4}, {"tp"});
    auto expect_error = [&](const std::function<void()>& body, const std::string& words) {
      std::string message;
      try {
        body();
      } catch (const Error& error) {
        message = error.what();
      }
      EXPECT_NE(message.find(words), std::string::npos) << message;
      const auto all = testing::all_gather_strings(*comm, message);
      EXPECT_EQ(all.front(), all.back()) << "ranks disagree";
    };
    expect_error([&] { nn::ParallelMlp(mesh, 8, 6, 1, DType::f64); },
                 "[column_parallel_linear] out features 6 do not divide over the 4 ranks of mesh "
                 "dim 'tp'");
    expect_error([&] { nn::RowParallelLinear(mesh, 10, 8, true, 1, DType::f64); },
                 "[row_parallel_linear] in features 10 do not divide over the 4 ranks");
    expect_error([&] { nn::ParallelAttention(mesh, 12, 6, 1, DType::f64); },
                 "[parallel_attention] heads 6 do not divide over the 4 ranks");
    expect_error(
        [&] {
          nn::FilterParallelConv(
              mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 6, .dtype = DType::f64}, 1);
        },
        "[filter_parallel_conv] out channels 6 do not divide over the 4 ranks");
    expect_error(
        [&] {
          nn::ChannelParallelConv(
              mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 4, .dtype = DType::f64}, 1);
        },
        "[channel_parallel_conv] in channels 2 do not divide over the 4 ranks");
    expect_error(
        [&] {
          nn::FilterParallelConvTranspose(
              mesh,
              nn::ConvTransposeConfig{.in_channels = 2, .out_channels = 6, .dtype = DType::f64}, 1);
        },
        "[filter_parallel_conv_transpose] out channels 6 do not divide over the 4 ranks");
    expect_error(
        [&] {
          nn::ChannelParallelConvTranspose(
              mesh,
              nn::ConvTransposeConfig{.in_channels = 6, .out_channels = 4, .dtype = DType::f64}, 1);
        },
        "[channel_parallel_conv_transpose] in channels 6 do not divide over the 4 ranks");
    expect_error(
        [&] {
          nn::FilterParallelConvTranspose(mesh,
                                          nn::ConvTransposeConfig{.in_channels = 4,
                                                                  .out_channels = 4,
                                                                  .dtype = DType::f64,
                                                                  .options = {.groups = 2}},
                                          1);
        },
        "[filter_parallel_conv_transpose] channels 4 -> 4, kernel 2, groups 2 (tensor "
        "parallelism needs groups 1)");
    expect_error(
        [&] { nn::ParallelMlp(mesh, 8, 16, 1, DType::f64, {.dim = "model"}); },
        "[column_parallel_linear] tensor-parallel dim 'model' is not a dim of the mesh (dims tp)");
  });
}

}  // namespace
}  // namespace tessera
