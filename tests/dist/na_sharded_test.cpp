// Sharded neighborhood attention: for a seeded sweep of random cases (na1d/2d/3d, kernels odd
// and even, dilation, causal flags per axis, relative positional bias, 1-d..3-d meshes of 1 to 4
// ranks, uneven, empty and one-element shards, batch sharding, heads sharded on input), the
// sharded forward (o, lse) and every gradient (dq, dk, dv, d rpb through the autograd tape,
// with gradients flowing into both o and lse) equal the same code run unsharded on one rank.
// Plus: the rule's key boxes at a global border, and agreed errors for bad arguments.
#include <gtest/gtest.h>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;

struct NaCase {
  Shape shape;  // [B, X.., heads, D]
  ops::NaOptions options;
  bool rpb = false;
  bool v_replicated = false;  // v arrives in another layout than q (the rule moves it)
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;

  std::string str() const {
    std::vector<std::string> names;
    for (const Placement& placement : placements) names.push_back(placement.str());
    return fmt::format("shape {} kernel {} dilation {} causal {} rpb {} placements [{}] extents {}",
                       shape, options.kernel_size, options.dilation, options.causal, rpb,
                       fmt::join(names, ", "), extents);
  }
};

/// Extents of n over `parts` made of empty and one-element shards, the rest on one part.
std::vector<int64_t> thin_extents(int64_t n, int parts, CaseRng& rng) {
  std::vector<int64_t> extents(parts, 0);
  int64_t left = n;
  for (int p = 0; p < parts && left > 0; ++p)
    if (rng.chance(0.6)) {
      extents[p] = 1;
      --left;
    }
  extents[rng.uniform(0, parts - 1)] += left;
  return extents;
}

NaCase random_na_case(const std::vector<int>& mesh_shape, CaseRng& rng) {
  NaCase c;
  const int spatial = static_cast<int>(rng.uniform(1, 3));
  const int64_t max_length = spatial == 1 ? 16 : spatial == 2 ? 9 : 6;
  c.shape.push_back(rng.uniform(1, 2));
  c.options.kernel_size.clear();
  c.options.dilation.clear();
  c.options.causal.clear();
  bool rpb_allowed = true;
  for (int a = 0; a < spatial; ++a) {
    const int64_t kernel = rng.uniform(1, spatial == 3 ? 3 : 5);
    const int64_t dilation = rng.chance(0.5) ? 1 : rng.uniform(2, 3);
    const int64_t causal = rng.chance(0.3) ? 1 : 0;
    c.shape.push_back(std::max(kernel * dilation, rng.uniform(1, max_length)));
    c.options.kernel_size.push_back(kernel);
    c.options.dilation.push_back(dilation);
    c.options.causal.push_back(causal);
    rpb_allowed = rpb_allowed && !causal && kernel % 2 == 1;
  }
  c.shape.push_back(rng.uniform(1, 2));  // heads
  c.shape.push_back(rng.uniform(1, 3));  // D
  c.rpb = rpb_allowed && rng.chance(0.5);
  if (rng.chance(0.2)) c.options.scale = 0.3 + 0.1 * static_cast<double>(rng.uniform(0, 5));
  c.v_replicated = rng.chance(0.15);
  // Mesh dims shard distinct spatial dims, sometimes the batch or the heads dim, or replicate.
  const int heads_dim = spatial + 1;
  std::vector<bool> used(c.shape.size(), false);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    const double pick = std::uniform_real_distribution<double>(0, 1)(rng.engine());
    const int dim = pick < 0.12  ? 0
                    : pick < 0.2 ? heads_dim
                                 : static_cast<int>(rng.uniform(1, spatial));
    if (used[dim] || rng.chance(0.1)) {
      c.placements.push_back(Placement::replicate());
      c.extents.emplace_back();
      continue;
    }
    used[dim] = true;
    c.placements.push_back(Placement::shard(dim));
    const double kind = std::uniform_real_distribution<double>(0, 1)(rng.engine());
    c.extents.push_back(kind < 0.3   ? default_split(c.shape[dim], mesh_shape[m])
                        : kind < 0.6 ? thin_extents(c.shape[dim], mesh_shape[m], rng)
                                     : testing::random_extents(c.shape[dim], mesh_shape[m], rng));
  }
  return c;
}

struct NaData {
  Tensor q, k, v, rpb, go, glse;
};

/// Forward and gradients on `mesh`: o, lse, dq, dk, dv (and d rpb), full tensors.
std::vector<Tensor> run_case(const NaCase& c, const DeviceMesh& mesh, const NaData& data,
                             bool sharded) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  auto layout = [&](const Tensor& t, bool keep_replicated) {
    return sharded && !keep_replicated ? ShardTensor::distribute(t, mesh, c.placements, c.extents)
                                       : ShardTensor::distribute(t, mesh, replicated);
  };
  Tape tape;
  ShardTensor q = layout(data.q, false).set_requires_grad();
  ShardTensor k = layout(data.k, false).set_requires_grad();
  ShardTensor v = layout(data.v, c.v_replicated).set_requires_grad();
  ops::NaOptions options = c.options;
  if (c.rpb) options.rpb = ShardTensor::distribute(data.rpb, mesh, replicated).set_requires_grad();
  const ops::NaResult result = ops::neighborhood_attention(q, k, v, options);
  // loss = sum(o * go) + sum(lse * glse): gradients reach both outputs.
  const ShardTensor go = ShardTensor::distribute(data.go, mesh, result.output.placements(),
                                                 result.output.spec().extents);
  const ShardTensor glse =
      ShardTensor::distribute(data.glse, mesh, result.lse.placements(), result.lse.spec().extents);
  tape.backward(
      ops::add(ops::sum(ops::mul(result.output, go)), ops::sum(ops::mul(result.lse, glse))));
  std::vector<Tensor> results{result.output.full_tensor(), result.lse.full_tensor(),
                              tape.grad(q)->full_tensor(), tape.grad(k)->full_tensor(),
                              tape.grad(v)->full_tensor()};
  EXPECT_EQ(tape.grad(k)->spec(), k.spec()) << "dk comes back in k's layout";
  if (c.rpb) {
    EXPECT_EQ(tape.grad(*options.rpb)->placements(), replicated)
        << "d rpb is reduced to replicated exactly once";
    results.push_back(tape.grad(*options.rpb)->full_tensor());
  }
  return results;
}

Tensor random_tensor(const Shape& shape, CaseRng& rng) {
  std::normal_distribution<double> normal;
  Tensor tensor = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.data<double>()[i] = normal(rng.engine());
  return tensor;
}

TEST(NaSharded, RandomCasesMatchUnshardedForwardAndGradients) {
  int total_cases = 0;
  for (int world = 1; world <= 4; ++world) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      const auto meshes = testing::mesh_factorizations(comm->size());
      auto self = comm->split(comm->rank(), 0);
      DeviceMesh single(self, {1});
      int cases = 0;
      for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
        DeviceMesh mesh(comm, meshes[mesh_index]);
        for (int index = 0; index < testing::cases_per_mesh(comm->size(), 100); ++index, ++cases) {
          CaseRng rng(testing::case_seed(53, comm->size(), static_cast<int>(mesh_index), index));
          const NaCase c = random_na_case(mesh.shape(), rng);
          Shape lse_shape = c.shape;
          lse_shape.pop_back();
          Shape rpb_shape{c.shape[c.shape.size() - 2]};
          for (int64_t kernel : c.options.kernel_size) rpb_shape.push_back(2 * kernel - 1);
          const NaData data{random_tensor(c.shape, rng), random_tensor(c.shape, rng),
                            random_tensor(c.shape, rng), random_tensor(rpb_shape, rng),
                            random_tensor(c.shape, rng), random_tensor(lse_shape, rng)};
          const auto expected = run_case(c, single, data, false);
          const auto actual = run_case(c, mesh, data, true);
          const char* names[] = {"o", "lse", "dq", "dk", "dv", "drpb"};
          for (size_t i = 0; i < expected.size(); ++i)
            EXPECT_LE(testing::relative_error(actual[i], expected[i]), 1e-12)
                << names[i] << " case " << index << " mesh " << testing::shape_str(mesh.shape())
                << " " << c.str();
        }
      }
      if (comm->rank() == 0) total_cases += cases;
    });
  }
  if (!testing::mpi_backend()) {
    EXPECT_GE(total_cases, 400);
  }
}

TEST(NaSharded, BorderWindowsNeedMoreThanThePlainHalo) {
  // L = 20, k = 7, d = 1: the plain halo of a shard [0, 2) would be keys [0, 5), but query 0's
  // window is shifted to [0, 7) at the global border. The rule names exactly that box.
  const auto op = find_op("na");
  const ShardSpec q = ShardSpec::make({1, 20, 1, 2}, {4}, {Placement::shard(1)}, {{2, 0, 1, 17}});
  OpAttrs attrs;
  attrs.set("kernel_size", std::vector<int64_t>{7})
      .set("dilation", std::vector<int64_t>{1})
      .set("causal", std::vector<int64_t>{0})
      .set("scale", 1.0);
  const OpRule rule = op->rule({q, q, q}, attrs);
  ASSERT_TRUE(rule.halos[1].has_value());
  const std::vector<Box>& needed = rule.halos[1]->needed;
  EXPECT_EQ(needed[0].lo[1], 0);
  EXPECT_EQ(needed[0].hi[1], 7);
  EXPECT_EQ(needed[1].lo[1], needed[1].hi[1]) << "an empty shard needs no keys";
  EXPECT_EQ(needed[2].lo[1], 0);  // query 2: window [0, 7)
  EXPECT_EQ(needed[2].hi[1], 7);
  EXPECT_EQ(needed[3].lo[1], 0);  // query 3: [0, 7); query 19: [13, 20)
  EXPECT_EQ(needed[3].hi[1], 20);
  // Causal with dilation 2: a shard [6, 8) needs (k-1)*d to the left and nothing to the right.
  attrs.set("causal", std::vector<int64_t>{1}).set("dilation", std::vector<int64_t>{2});
  const ShardSpec causal = ShardSpec::make({1, 20, 1, 2}, {3}, {Placement::shard(1)}, {{6, 2, 12}});
  const OpRule causal_rule = op->rule({causal, causal, causal}, attrs);
  EXPECT_EQ(causal_rule.halos[1]->needed[1].lo[1], 0);  // query 6: keys 0, 2, 4, 6
  EXPECT_EQ(causal_rule.halos[1]->needed[1].hi[1], 8);
}

TEST(NaSharded, BadArgumentsRaiseTheSameErrorOnEveryRank) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    const Tensor full = Tensor::zeros({1, 10, 1, 2}, DType::f64);
    const ShardTensor q = ShardTensor::distribute(full, mesh, {Placement::shard(1)}, {{9, 1}});
    auto message_of = [&](const ops::NaOptions& options) {
      try {
        ops::neighborhood_attention(q, q, q, options);
      } catch (const AgreedError& error) {
        return std::string(error.what());
      }
      return std::string("no agreed error");
    };
    ops::NaOptions causal_rpb;
    causal_rpb.kernel_size = {3};
    causal_rpb.causal = {1};
    causal_rpb.rpb =
        ShardTensor::distribute(Tensor::zeros({1, 5}, DType::f64), mesh, {Placement::replicate()});
    EXPECT_NE(message_of(causal_rpb).find("non-causal odd kernel"), std::string::npos);
    ops::NaOptions too_big;
    too_big.kernel_size = {4};
    too_big.dilation = {3};
    EXPECT_NE(message_of(too_big).find("kernel size 4 with dilation 3"), std::string::npos)
        << message_of(too_big);
  });
}

}  // namespace
}  // namespace tessera
