// Tensor-parallel transposed convolution (the conv_transpose rule's filter-, channel- and
// group-parallel cases): for a seeded sweep of random cases (conv_transpose1d/2d/3d, kernels,
// strides below, equal to and above the kernel, padding, output_padding, dilation, groups, bias;
// even, uneven and empty channel splits) on tp 2 and tp 4 alone and tp 2 x domain 2 (x also
// sharded in space or batch, unevenly), the forward and every gradient (dx, dw, db through the
// autograd tape) equal the one-rank run within 1e-12 relative, and the layouts are the rule's
// (y Shard(1) or Partial(sum) over tp, dw keeping w's Shard); what cannot be split is one error
// naming the op, the same on every rank; the collectives of a step are the analytic ones.
#include <gtest/gtest.h>

#include "core/autograd.hpp"
#include "ops/op_helpers.hpp"
#include "ops/ops.hpp"
#include "tests/dist/conv_cases.hpp"
#include "tests/dist/counting_comm.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;

/// How the case splits w over the tp mesh dim (mesh dim 0).
enum class Split { filter, channel, group };

const char* split_name(Split split) {
  return split == Split::filter ? "filter" : split == Split::channel ? "channel" : "group";
}

struct TpCase {
  Shape x_shape, w_shape;
  bool bias = false;
  ops::ConvTransposeOptions options;
  std::vector<int64_t> w_extents;  ///< w's split over tp (on dim 1: filter, dim 0: the others)
  bool x_presplit = false;         ///< x arrives Shard(1) over tp (else the rule moves it)
  std::vector<Placement> x_placements;
  std::vector<std::vector<int64_t>> x_extents;

  std::string str() const {
    return fmt::format(
        "x {} w {} bias {} stride {} padding {} output_padding {} dilation {} groups {} w "
        "extents {} x presplit {} x extents {}",
        x_shape, w_shape, bias, options.stride, options.padding, options.output_padding,
        options.dilation, options.groups, w_extents, x_presplit, x_extents);
  }
};

/// `count` split over `parts`: evenly (the default split), or at random (uneven, zeros allowed);
/// with `unit` > 1 in whole units of it.
std::vector<int64_t> channel_split(int64_t count, int parts, int64_t unit, CaseRng& rng) {
  std::vector<int64_t> extents = rng.chance(0.5)
                                     ? default_split(count / unit, parts)
                                     : testing::random_extents(count / unit, parts, rng);
  for (int64_t& extent : extents) extent *= unit;
  return extents;
}

/// A random tensor-parallel case on `mesh_shape` (tp first, then an optional domain dim).
TpCase random_tp_case(const std::vector<int>& mesh_shape, Split split, CaseRng& rng) {
  TpCase c;
  const int tp = mesh_shape[0];
  const int spatial = static_cast<int>(rng.uniform(1, 3));
  // Groups a multiple of tp, or (uneven whole-group splits) one less, at least 2.
  c.options.groups =
      split == Split::group ? std::max<int64_t>(2, tp * rng.uniform(1, 2) - rng.uniform(0, 1)) : 1;
  const int64_t in_per_group = rng.uniform(1, 2);
  const int64_t in =
      split == Split::channel ? rng.uniform(1, 2 * tp + 1) : c.options.groups * in_per_group;
  const int64_t out_per_group =
      split == Split::filter ? rng.uniform(1, 2 * tp + 1) : rng.uniform(1, 2);
  c.x_shape = {rng.uniform(1, 2), split == Split::channel ? in : c.options.groups * in_per_group};
  c.w_shape = {c.x_shape[1], out_per_group};
  c.options.stride.clear();
  c.options.padding.clear();
  c.options.output_padding.clear();
  c.options.dilation.clear();
  for (int i = 0; i < spatial; ++i) {
    const int64_t kernel = rng.uniform(1, spatial == 3 ? 3 : 4);
    const int64_t stride = rng.uniform(1, 3);
    const int64_t dilation = rng.uniform(1, 2);
    const int64_t length = rng.uniform(1, spatial == 3 ? 5 : 9);
    const int64_t output_padding = rng.uniform(0, std::max(stride, dilation) - 1);
    const int64_t room = (length - 1) * stride + dilation * (kernel - 1) + output_padding;
    const int64_t padding = rng.uniform(0, std::min<int64_t>(3, room / 2));
    c.x_shape.push_back(length);
    c.w_shape.push_back(kernel);
    c.options.stride.push_back(stride);
    c.options.padding.push_back(padding);
    c.options.output_padding.push_back(output_padding);
    c.options.dilation.push_back(dilation);
  }
  // A group split must keep whole groups on a rank: a tp that does not divide the groups gets
  // uneven whole-group extents.
  if (split == Split::filter) c.w_extents = channel_split(c.w_shape[1], tp, 1, rng);
  if (split == Split::channel) c.w_extents = channel_split(c.w_shape[0], tp, 1, rng);
  if (split == Split::group) c.w_extents = channel_split(c.w_shape[0], tp, in_per_group, rng);
  c.bias = split != Split::channel && rng.chance(0.6);
  c.x_presplit = split != Split::filter && rng.chance(0.5);
  c.x_placements.push_back(c.x_presplit ? Placement::shard(1) : Placement::replicate());
  c.x_extents.push_back(c.x_presplit ? c.w_extents : std::vector<int64_t>{});
  if (mesh_shape.size() == 2) {  // domain: a spatial dim (or the batch), unevenly
    const int dim = rng.chance(0.2) ? 0 : static_cast<int>(rng.uniform(2, 1 + spatial));
    c.x_placements.push_back(Placement::shard(dim));
    c.x_extents.push_back(testing::random_extents(c.x_shape[dim], mesh_shape[1], rng));
  }
  return c;
}

Shape output_shape(const TpCase& c) {
  Shape shape{c.x_shape[0], c.w_shape[1] * c.options.groups};
  for (size_t i = 0; i + 2 < c.x_shape.size(); ++i)
    shape.push_back(ops::conv_transpose_extent(c.x_shape[2 + i], c.w_shape[2 + i],
                                               c.options.stride[i], c.options.padding[i],
                                               c.options.dilation[i], c.options.output_padding[i]));
  return shape;
}

/// Forward and gradients: y, dx, dw[, db] (full tensors). Sharded: w (and b) split over tp as
/// the case says and x laid out as it says; the layouts the rule gives are checked on the way.
std::vector<Tensor> run_case(const TpCase& c, Split split, const DeviceMesh& mesh, const Tensor& x,
                             const Tensor& w, const Tensor& b, const Tensor& gy, bool sharded) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  std::vector<Placement> w_placements = replicated, b_placements = replicated;
  std::vector<std::vector<int64_t>> w_extents(mesh.ndim()), b_extents(mesh.ndim());
  if (sharded) {
    w_placements[0] = Placement::shard(split == Split::filter ? 1 : 0);
    w_extents[0] = c.w_extents;
    b_placements[0] = Placement::shard(0);
    for (const int64_t extent : c.w_extents)
      b_extents[0].push_back(split == Split::filter
                                 ? extent
                                 : extent / (c.w_shape[0] / c.options.groups) * c.w_shape[1]);
  }
  Tape tape;
  ShardTensor xs = sharded ? ShardTensor::distribute(x, mesh, c.x_placements, c.x_extents)
                           : ShardTensor::distribute(x, mesh, replicated);
  xs.set_requires_grad();
  ShardTensor ws = ShardTensor::distribute(w, mesh, w_placements, w_extents);
  ws.set_requires_grad();
  std::optional<ShardTensor> bs;
  if (c.bias) bs = ShardTensor::distribute(b, mesh, b_placements, b_extents).set_requires_grad();
  ShardTensor y = ops::conv_transpose(xs, ws, bs, c.options);
  if (sharded) {
    const Placement expected =
        split == Split::channel ? Placement::partial(ReduceOp::sum) : Placement::shard(1);
    EXPECT_EQ(y.placements()[0], expected) << "y over tp";
  }
  // The channel-parallel sum reduced once, as a layer does.
  const ShardSpec reduced = ops::without_partial(y.spec());
  if (reduced != y.spec()) y = y.redistribute(reduced.placements, reduced.extents);
  // loss = sum(y * gy), so d loss / dy = gy.
  const ShardTensor gys = ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents);
  tape.backward(ops::sum(ops::mul(y, gys)));
  std::vector<Tensor> results{y.full_tensor(), tape.grad(xs)->full_tensor(),
                              tape.grad(ws)->full_tensor()};
  if (sharded) {
    EXPECT_EQ(tape.grad(xs)->spec(), xs.spec()) << "dx comes back in x's layout";
    EXPECT_EQ(tape.grad(ws)->placements()[0], w_placements[0]) << "dw keeps w's split";
    EXPECT_EQ(tape.grad(ws)->spec().extents[0], w_extents[0]) << "dw keeps w's extents";
  }
  if (c.bias) results.push_back(tape.grad(*bs)->full_tensor());
  return results;
}

void sweep(int world, const std::vector<int>& mesh_shape, const std::vector<std::string>& names,
           int test_id, int cases_per_split) {
  testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, mesh_shape, names);
    auto self = comm->split(comm->rank(), 0);
    DeviceMesh single(self, {1});
    for (Split split : {Split::filter, Split::channel, Split::group}) {
      for (int index = 0; index < cases_per_split; ++index) {
        CaseRng rng(testing::case_seed(test_id, world, static_cast<int>(split), index));
        const TpCase c = random_tp_case(mesh_shape, split, rng);
        const Tensor x = testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
        const Tensor w = testing::integer_tensor(c.w_shape, DType::f64, rng, -3, 3);
        const Tensor b =
            testing::integer_tensor({c.w_shape[1] * c.options.groups}, DType::f64, rng, -3, 3);
        const Tensor gy = testing::integer_tensor(output_shape(c), DType::f64, rng, -3, 3);
        const auto expected = run_case(c, split, single, x, w, b, gy, false);
        const auto actual = run_case(c, split, mesh, x, w, b, gy, true);
        const char* what[] = {"y", "dx", "dw", "db"};
        for (size_t i = 0; i < expected.size(); ++i)
          EXPECT_LE(testing::relative_error(actual[i], expected[i]), 1e-12)
              << what[i] << " " << split_name(split) << "-parallel case " << index << " mesh "
              << testing::shape_str(mesh_shape) << " " << c.str();
      }
    }
  });
}

TEST(ConvTransposeTensorParallel, Tp2MatchesOneRankForwardAndBackward) {
  sweep(2, {2}, {"tp"}, 81, 60);
}

TEST(ConvTransposeTensorParallel, Tp4MatchesOneRankForwardAndBackward) {
  sweep(4, {4}, {"tp"}, 82, 40);
}

TEST(ConvTransposeTensorParallel, Tp2Domain2UnevenMatchesOneRankForwardAndBackward) {
  sweep(4, {2, 2}, {"tp", "domain"}, 83, 60);
}

/// The collectives (name, bytes) of one forward and backward of conv_transpose (stride 2) on tp 2
/// with w split evenly on `w_dim`, x laid out over tp as `x_placement`, loss sum(y * y) (y reduced
/// first if Partial): the second of two steps (the first creates the sub-communicators).
std::vector<std::pair<std::string, int64_t>> step_volume(std::shared_ptr<Comm> comm,
                                                         const Shape& x_shape, const Shape& w_shape,
                                                         int w_dim, int64_t groups,
                                                         Placement x_placement) {
  auto ledger = std::make_shared<testing::CountingComm::Ledger>();
  auto counting = std::make_shared<testing::CountingComm>(comm, ledger);
  DeviceMesh mesh(counting, {2}, {"tp"});
  CaseRng rng(5);
  ShardTensor x = ShardTensor::distribute(testing::integer_tensor(x_shape, DType::f64, rng, -3, 3),
                                          mesh, {x_placement});
  x.set_requires_grad();
  ShardTensor w = ShardTensor::distribute(testing::integer_tensor(w_shape, DType::f64, rng, -3, 3),
                                          mesh, {Placement::shard(w_dim)});
  w.set_requires_grad();
  for (int step = 0; step < 2; ++step) {
    {
      std::lock_guard lock(ledger->mutex);
      ledger->calls.clear();
    }
    Tape tape;
    const ShardTensor y =
        ops::conv_transpose(x, w, std::nullopt, {.stride = {2}, .groups = groups});
    // The channel-parallel sum reduced once, as a layer does, before anything reads it.
    const ShardSpec whole = ops::without_partial(y.spec());
    const ShardTensor z = y.spec() == whole ? y : y.redistribute(whole.placements, whole.extents);
    tape.backward(ops::sum(ops::mul(z, z)));
  }
  return ledger->calls;
}

// Per forward and backward on tp 2, f64: group-parallel with x already split by group moves
// nothing (each rank convolves its own groups); filter-parallel with x replicated moves nothing
// forward and all-reduces x's gradient [2, 4, 6] once backward (each rank's share of the sum over
// the output channels; x is replicated there); channel-parallel all-reduces its Partial output y
// [2, 4, 13] once forward and nothing backward (y's gradient is the same on every rank of the
// sum; dx stays split like x).
TEST(ConvTransposeTensorParallel, CommunicationPerStepEqualsTheAnalyticVolume) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    const std::vector<std::pair<std::string, int64_t>> nothing;
    EXPECT_EQ(step_volume(comm, {2, 4, 6}, {4, 2, 3}, 0, 2, Placement::shard(1)), nothing)
        << "group-parallel";
    const std::vector<std::pair<std::string, int64_t>> dx_once{{"all_reduce", 2 * 4 * 6 * 8}};
    EXPECT_EQ(step_volume(comm, {2, 4, 6}, {4, 4, 3}, 1, 1, Placement::replicate()), dx_once)
        << "filter-parallel";
    const std::vector<std::pair<std::string, int64_t>> y_once{{"all_reduce", 2 * 4 * 13 * 8}};
    EXPECT_EQ(step_volume(comm, {2, 4, 6}, {4, 4, 3}, 0, 1, Placement::shard(1)), y_once)
        << "channel-parallel";
  });
}

// What cannot be split is refused by the rule before any data moves, with one message naming the
// op on every rank.
TEST(ConvTransposeTensorParallel, WhatCannotBeSplitIsOneClearErrorOnEveryRank) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"tp"});
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
    const std::vector<Placement> replicated{Placement::replicate()};
    auto tensor = [&](const Shape& shape, std::vector<Placement> placements,
                      std::vector<std::vector<int64_t>> extents = {}) {
      return ShardTensor::distribute(Tensor::zeros(shape, DType::f64), mesh, placements, extents);
    };
    const ShardTensor x = tensor({1, 6, 5}, replicated);
    ops::ConvTransposeOptions grouped{.groups = 3};
    // groups 3 over tp 2: a part would hold a group and a half.
    expect_error(
        [&] {
          ops::conv_transpose(x, tensor({6, 1, 3}, {Placement::shard(0)}), std::nullopt, grouped);
        },
        "[conv_transpose] w's input channels 6 are split [3, 3] over mesh dim 0: with groups 3 "
        "every part must hold whole groups of 2 channels");
    // A split of the output channels within each group.
    expect_error(
        [&] {
          ops::conv_transpose(x, tensor({6, 2, 3}, {Placement::shard(1)}), std::nullopt, grouped);
        },
        "[conv_transpose] w is sharded on its output channels (dim 1) over mesh dim 0 with "
        "groups 3");
    // Channel-parallel with a bias: the bias would be summed once per rank.
    expect_error(
        [&] {
          ops::conv_transpose(x, tensor({6, 2, 3}, {Placement::shard(0)}), tensor({2}, replicated),
                              {});
        },
        "[conv_transpose] w is sharded on its input channels (channel-parallel) over mesh dim 0");
  });
}

}  // namespace
}  // namespace tessera
