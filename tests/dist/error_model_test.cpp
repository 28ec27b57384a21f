// Distributed tests of the error model: a bad input on one rank raises the same AgreedError on
// every rank (instead of deadlocking the others) and leaves the communicator usable; a rank that
// never joins a collective turns into a CommTimeout naming the op, the rank and the missing peer
// (local backend only: MPI gives no way to recover from the abandoned collective).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <optional>

#include "tests/common/scoped_env.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;

/// Runs `action`; returns the message of the AgreedError it throws ("" when it does not throw).
template <typename Action>
std::string agreed_error_of(Action&& action) {
  try {
    action();
  } catch (const AgreedError& error) {
    return error.what();
  }
  return "";
}

/// Collective: every rank got a non-empty and identical message.
void expect_same_error_everywhere(Comm& comm, const std::string& message) {
  EXPECT_FALSE(message.empty()) << "rank " << comm.rank() << " did not throw AgreedError";
  for (const std::string& other : testing::all_gather_strings(comm, message))
    EXPECT_EQ(other, message) << "rank " << comm.rank();
  // The failed call left the communicator in step on every rank.
  EXPECT_TRUE(testing::all_ranks(comm, true));
}

TEST(ErrorModel, FromLocalWithAWrongShapeOnOneRankThrowsTheSameAgreedErrorEverywhere) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int world = comm->size();
    const int bad_rank = world - 1;
    for (const auto& shape : testing::mesh_factorizations(world)) {
      DeviceMesh mesh(comm, shape);
      std::vector<Placement> placements(mesh.ndim(), Placement::replicate());
      placements[0] = Placement::shard(0);
      const Shape global_shape{2 * world + 1, 3};
      const ShardSpec spec = ShardSpec::make(global_shape, mesh.shape(), placements);
      Shape local_shape = spec.local_shape(mesh.coord());
      if (comm->rank() == bad_rank) local_shape[1] = 4;
      const Tensor local = Tensor::zeros(local_shape, DType::f32);

      const std::string message =
          agreed_error_of([&] { ShardTensor::from_local(local, mesh, global_shape, placements); });
      EXPECT_THAT(message, HasSubstr("[from_local]"));
      EXPECT_THAT(message, HasSubstr(fmt::format("on rank {}", bad_rank)));
      expect_same_error_everywhere(*comm, message);
      if (world > 1) {  // with inferred extents, rank 0's shape defines the unsharded dims
        const std::string inferred =
            agreed_error_of([&] { ShardTensor::from_local(local, mesh, placements); });
        EXPECT_THAT(inferred, HasSubstr(fmt::format("on rank {}", bad_rank)));
        expect_same_error_everywhere(*comm, inferred);
      }
    }
  });
}

TEST(ErrorModel, DifferentDTypesOnRanksThrowTheSameAgreedErrorEverywhere) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    if (comm->size() < 2) return;
    DeviceMesh mesh(comm, {comm->size()});
    const DType dtype = comm->rank() == 0 ? DType::f64 : DType::f32;
    const Tensor local = Tensor::zeros({2}, dtype);
    const std::string message = agreed_error_of(
        [&] { ShardTensor::from_local(local, mesh, {2 * comm->size()}, {Placement::shard(0)}); });
    EXPECT_THAT(message, HasSubstr("disagree"));
    expect_same_error_everywhere(*comm, message);
  });
}

TEST(ErrorModel, RanksPassingDifferentExtentsToRedistributeAllThrowAgreedError) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int world = comm->size();
    DeviceMesh mesh(comm, {world});
    const int64_t n = 2 * world;
    testing::CaseRng rng(31);
    const Tensor full = testing::integer_tensor({n}, DType::i32, rng, -9, 9);
    const ShardTensor sharded = ShardTensor::distribute(full, mesh, {Placement::shard(0)});

    if (world > 1) {
      // Valid but different extents: rank 0 puts everything on itself.
      std::vector<int64_t> extents = default_split(n, world);
      if (comm->rank() == 0) {
        std::fill(extents.begin(), extents.end(), 0);
        extents[0] = n;
      }
      const std::string message =
          agreed_error_of([&] { sharded.redistribute({Placement::shard(0)}, {extents}); });
      EXPECT_THAT(message, HasSubstr("[redistribute]"));
      EXPECT_THAT(message, HasSubstr("ranks disagree about the layout"));
      expect_same_error_everywhere(*comm, message);
    }
    // Invalid extents on the last rank only: its problem is everybody's error.
    std::vector<int64_t> extents = default_split(n, world);
    if (comm->rank() == world - 1) extents.back() += 1;
    const std::string message =
        agreed_error_of([&] { sharded.redistribute({Placement::shard(0)}, {extents}); });
    EXPECT_THAT(message, HasSubstr(fmt::format("sum to {}", n + 1)));
    expect_same_error_everywhere(*comm, message);
    // The tensor is untouched and still works.
    EXPECT_TRUE(bitwise_equal(sharded.full_tensor(), full));
  });
}

using testing::ScopedEnv;

TEST(LocalBackendTimeout, MissingRankRaisesCommTimeoutNamingOpRankAndPeer) {
  if (testing::mpi_backend()) GTEST_SKIP() << "the local backend's watchdog only";
  const ScopedEnv timeout("TESSERA_COMM_TIMEOUT", "1");
  const auto start = std::chrono::steady_clock::now();
  std::optional<std::string> message;
  std::string op;
  try {
    run_local_ranks(4, [](std::shared_ptr<Comm> comm) {
      if (comm->rank() == 3) return;  // never joins the all_reduce
      CommOpScope scope("timeout_test");
      int32_t value = 1;
      comm->all_reduce(&value, &value, 1, DType::i32, ReduceOp::sum);
    });
  } catch (const CommTimeout& error) {
    message = error.what();
    op = error.op();
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(message.has_value()) << "run_local_ranks did not throw CommTimeout";
  EXPECT_EQ(op, "timeout_test");
  EXPECT_THAT(*message, HasSubstr("[timeout_test]"));
  EXPECT_THAT(*message, HasSubstr("all_reduce"));
  EXPECT_THAT(*message, ContainsRegex("on rank [0-2] of 4"));
  EXPECT_THAT(*message, HasSubstr("rank(s) [3]"));
  // An upper bound that proves the wait did not hang, not a performance requirement.
  EXPECT_LT(elapsed, 10.0);
}

TEST(LocalBackendErrors, RealErrorOfTheLastRankSurvivesConcurrentPeerFailures) {
  // Every other rank fails with PeerFailed at about the same time, each recording it from its
  // own thread; the error rethrown must be the last rank's own (a lost record would rethrow a
  // PeerFailed of a lower rank instead). ThreadSanitizer reports a race on those records here.
  if (testing::mpi_backend()) GTEST_SKIP() << "the local backend's launch only";
  constexpr int kRanks = 16;
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::optional<std::string> message;
    try {
      run_local_ranks(kRanks, [](std::shared_ptr<Comm> comm) {
        if (comm->rank() == kRanks - 1) throw InvalidArgument("real_failure", "the real error");
        comm->barrier();
      });
    } catch (const PeerFailed& error) {
      FAIL() << "a secondary PeerFailed replaced the real error: " << error.what();
    } catch (const InvalidArgument& error) {
      message = error.what();
    }
    ASSERT_TRUE(message.has_value());
    EXPECT_EQ(*message, "[real_failure] the real error");
  }
}

TEST(LocalBackendErrors, RanksOutsideOneToTheLimitAreRefused) {
  if (testing::mpi_backend()) GTEST_SKIP() << "the local backend's launch only";
  for (int ranks : {0, -3, kMaxLocalRanks + 1, 1000}) {
    try {
      run_local_ranks(ranks, [](std::shared_ptr<Comm>) { FAIL() << "a rank ran"; });
      ADD_FAILURE() << ranks << " local ranks were accepted";
    } catch (const InvalidArgument& error) {
      EXPECT_THAT(error.what(), HasSubstr(fmt::format("cannot launch {} local ranks", ranks)));
      EXPECT_THAT(error.what(), HasSubstr(fmt::format("expected 1 to {}", kMaxLocalRanks)));
    }
  }
}

}  // namespace
}  // namespace tessera
