// Sharded neighborhood attention: for a seeded sweep of random cases (na1d/2d/3d, kernels odd
// and even, dilation, causal flags per axis, relative positional bias, 1-d..3-d meshes of 1 to 4
// ranks, uneven, empty and one-element shards, batch sharding, heads sharded on input), the
// sharded forward (o, lse) and every gradient (dq, dk, dv, d rpb through the autograd tape,
// with gradients flowing into both o and lse) equal the same code run unsharded on one rank.
// Plus: that loss in f32, f16 and bf16 (lse in f32 for the half types), sharded against one rank
// within the dtype's roundoff; the rule's key boxes at a global border; agreed errors for bad
// arguments; the cpu forward split around the halo exchange (interior queries while the k/v
// halos travel, the rest after) gives the same results as without the split.
#include <gtest/gtest.h>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/na_cases.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;
using testing::NaCase;
using testing::NaData;

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
          const NaCase c = testing::random_na_case(mesh.shape(), rng);
          const NaData data = testing::random_na_data(c, rng);
          const auto expected = testing::run_na_case(c, single, data, false);
          const auto actual = testing::run_na_case(c, mesh, data, true);
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

// With halo overlap on, the cpu forward computes the queries whose windows hold only the rank's
// own keys while the k/v halos travel, and the rest once they have landed (OverlapKernel). The
// cpu kernels tile the queries of each piece they are given, so a query may take another path
// (a full tile or an edge) than without the split and round differently: o, lse and every
// gradient equal the plain kernel's on the complete haloed tile within 1e-12 in f64, as the
// sharded results equal one rank's.
TEST(NaSharded, HaloOverlapGivesTheSameResultsAsNoOverlap) {
  int compared = 0;
  for (int world = 1; world <= 4; ++world) {
    const auto meshes = testing::mesh_factorizations(world);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      for (int index = 0; index < 12; ++index) {
        const auto results =
            testing::with_and_without_cpu_overlap(world, [&](std::shared_ptr<Comm> comm) {
              DeviceMesh mesh(comm, meshes[mesh_index]);
              CaseRng rng(testing::case_seed(59, world, static_cast<int>(mesh_index), index));
              const NaCase c = testing::random_na_case(mesh.shape(), rng);
              const NaData data = testing::random_na_data(c, rng);
              return testing::run_na_case(c, mesh, data, true);
            });
        if (results[0].empty()) continue;  // under mpiexec only the launcher's world size runs
        ASSERT_EQ(results[0].size(), results[1].size());
        const char* names[] = {"o", "lse", "dq", "dk", "dv", "drpb"};
        for (size_t i = 0; i < results[0].size(); ++i)
          EXPECT_LE(testing::relative_error(results[0][i], results[1][i]), 1e-12)
              << names[i] << " world " << world << " mesh "
              << testing::shape_str(meshes[mesh_index]) << " case " << index;
        ++compared;
      }
    }
  }
  if (!testing::mpi_backend()) {
    EXPECT_GT(compared, 80);
  }
}

// The loss of run_na_case (the cuda sweep's too) in every dtype: for f16/bf16 the lse is f32 and
// o is not, and the sharded result equals one rank within the dtype's roundoff.
TEST(NaSharded, LossOfBothOutputsRunsInEveryDtypeAndMatchesOneRank) {
  int total_cases = 0;
  for (int world : {1, 2}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      DeviceMesh mesh(comm, {comm->size()});
      int cases = 0;
      for (int index = 0; index < 6; ++index, ++cases) {
        CaseRng rng(testing::case_seed(59, comm->size(), 0, index));
        const NaCase c = testing::random_na_case(mesh.shape(), rng);
        const NaData data = testing::random_na_data(c, rng);
        for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
          const double bound = dtype == DType::f32 ? 1e-5 : dtype == DType::f16 ? 1e-2 : 5e-2;
          const auto expected = testing::run_na_case(c, single, data, false, dtype);
          const auto actual = testing::run_na_case(c, mesh, data, true, dtype);
          ASSERT_EQ(actual.size(), expected.size());
          const char* names[] = {"o", "lse", "dq", "dk", "dv", "drpb"};
          for (size_t i = 0; i < expected.size(); ++i)
            EXPECT_LE(testing::relative_error(actual[i], expected[i]), bound)
                << names[i] << " " << dtype_name(dtype) << " case " << index << " " << c.str();
        }
      }
      if (comm->rank() == 0) total_cases += cases;
    });
  }
  if (!testing::mpi_backend()) {
    EXPECT_EQ(total_cases, 12);
  }
}

// The f32 lane forward reads each rank's own keys where they lie (the op's owned_in_place: the
// halo exchange fills only the halo rows of the k/v tile). o, lse and every gradient equal one
// rank's, with and without the tape (which gets the tile filled for the backward) and the
// overlap split; uneven and empty pieces, and pieces cut on the innermost axis (the kernel fills
// the tile first).
TEST(NaSharded, LaneForwardReadingOwnedKeysInPlaceMatchesOneRank) {
  struct Layout {
    std::vector<int> mesh;
    std::vector<Placement> placements;
    std::vector<std::vector<int64_t>> extents;
  };
  std::vector<NaCase> cases(2);
  cases[0].shape = {2, 26, 19, 2, 32};
  cases[0].options.kernel_size = {7, 5};
  cases[0].options.dilation = {1, 1};
  cases[0].options.causal = {0, 0};
  cases[0].rpb = true;
  cases[1].shape = {1, 30, 22, 1, 64};
  cases[1].options.kernel_size = {5, 7};
  cases[1].options.dilation = {2, 1};
  cases[1].options.causal = {1, 0};
  int compared = 0;
  for (size_t index = 0; index < cases.size(); ++index) {
    const int64_t x = cases[index].shape[1], y = cases[index].shape[2];
    const std::vector<Layout> layouts{
        {{3}, {Placement::shard(1)}, {{10, 7, x - 17}}},
        {{4}, {Placement::shard(1)}, {{0, 5, 12, x - 17}}},
        {{2, 2}, {Placement::shard(1), Placement::shard(2)}, {{13, x - 13}, {11, y - 11}}},
    };
    for (const Layout& layout : layouts) {
      NaCase c = cases[index];
      c.placements = layout.placements;
      c.extents = layout.extents;
      CaseRng rng(
          testing::case_seed(61, static_cast<int>(layout.mesh.size()), static_cast<int>(index), 0));
      const NaData data = testing::random_na_data(c, rng);
      const int world = mesh_size(layout.mesh);
      testing::with_and_without_cpu_overlap(world, [&](std::shared_ptr<Comm> comm) {
        DeviceMesh single(comm->split(comm->rank(), 0), {1});
        DeviceMesh mesh(comm, layout.mesh);
        const auto expected = testing::run_na_case(c, single, data, false, DType::f32);
        const auto actual = testing::run_na_case(c, mesh, data, true, DType::f32);
        const char* names[] = {"o", "lse", "dq", "dk", "dv", "drpb"};
        EXPECT_EQ(actual.size(), expected.size());
        for (size_t i = 0; i < expected.size() && i < actual.size(); ++i)
          EXPECT_LE(testing::relative_error(actual[i], expected[i]), 1e-5)
              << names[i] << " " << c.str() << " overlap " << halo_overlap();
        // Without a tape: only the forward, the tile's interior never filled for the lanes.
        auto input = [&](const Tensor& t) {
          return ShardTensor::distribute(t.to_dtype(DType::f32), mesh, c.placements, c.extents);
        };
        ops::NaOptions options = c.options;
        if (c.rpb)
          options.rpb = ShardTensor::distribute(
              data.rpb.to_dtype(DType::f32), mesh,
              std::vector<Placement>(layout.mesh.size(), Placement::replicate()));
        const ops::NaResult result =
            ops::neighborhood_attention(input(data.q), input(data.k), input(data.v), options);
        EXPECT_LE(
            testing::relative_error(result.output.full_tensor().to_dtype(DType::f64), expected[0]),
            1e-5)
            << "o without a tape, " << c.str();
        EXPECT_LE(
            testing::relative_error(result.lse.full_tensor().to_dtype(DType::f64), expected[1]),
            1e-5)
            << "lse without a tape, " << c.str();
        if (comm->rank() == 0) ++compared;
        return std::vector<Tensor>{};
      });
    }
  }
  if (!testing::mpi_backend()) {
    EXPECT_EQ(compared, 12);
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
