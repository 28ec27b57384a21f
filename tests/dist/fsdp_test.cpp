// FSDP / ZeRO-3 and hybrid sharding (ops/nn/fsdp.hpp) and the nonblocking all-gather it
// prefetches with (Comm::start_all_gather_v): 10 steps of SGD with momentum and of AdamW on a
// seeded 2-d conv net (f64) give the losses and final parameters of the one-rank run (1e-10
// relative) with parameters and optimizer state sharded over dp (prefetch on and off), over dp x
// an uneven domain dim, over 4 ranks (empty shards included) and hybrid on a 3-d mesh; replicas
// of every shard stay bit-identical after every step; a run checkpointed at step 5 under FSDP
// resumes on DDP and on one rank (and a DDP checkpoint under FSDP) with the uninterrupted losses;
// the measured peak bytes stay within the sharded bound (and below DDP's); bad input is one error
// on every rank.
#include "ops/nn/fsdp.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>

#include "core/host_allocator.hpp"
#include "core/tessera.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/layers.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"
#include "tests/dist/training_support.hpp"
#ifdef TESSERA_TEST_HAVE_HDF5
#include "ops/nn/checkpoint.hpp"
#include "tests/dist/io_test_support.hpp"
#endif

namespace tessera {
namespace {

using testing::expect_close;
using testing::RunResult;
using testing::values_of;

// The nonblocking all-gather FSDP prefetches with: uneven counts (an empty block included), other
// collectives run while it is in flight, and the result equals the blocking all_gather_v.
TEST(CommStartAllGather, UnevenCountsMatchTheBlockingGatherWithWorkInFlight) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int size = comm->size(), rank = comm->rank();
    std::vector<size_t> counts;
    for (int r = 0; r < size; ++r) counts.push_back(static_cast<size_t>((r * 3 + 1) % 4));
    const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    std::vector<double> send(counts[rank]);
    for (size_t i = 0; i < send.size(); ++i) send[i] = 100.0 * rank + static_cast<double>(i);
    std::vector<double> started(total, -1), blocking(total, -2);
    auto pending =
        comm->start_all_gather_v(send.data(), send.size(), started.data(), counts, DType::f64);
    double sum = rank;  // a collective while the gather is in flight
    comm->all_reduce(&sum, &sum, 1, DType::f64, ReduceOp::sum);
    pending->wait();
    comm->all_gather_v(send.data(), send.size(), blocking.data(), counts, DType::f64);
    EXPECT_EQ(sum, size * (size - 1) / 2.0);
    EXPECT_EQ(started, blocking);
  });
}

/// conv(2 -> 5, k3) -> tanh -> conv(5 -> 2, k3), f64, padding same: 5 output channels shard
/// unevenly (3 + 2 over 2 ranks, 2 + 1 + 1 + 1 over 4; the 2-channel layer leaves shards empty).
std::shared_ptr<nn::Sequential> make_net(const DeviceMesh& mesh) {
  auto net = std::make_shared<nn::Sequential>();
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 5, .dtype = DType::f64}, 41));
  net->append(std::make_shared<nn::Activation>("tanh"));
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 5, .out_channels = 2, .dtype = DType::f64}, 42));
  return net;
}

/// A mesh and how the data lies on it; fsdp set: the model is sharded with these options.
struct Layout {
  std::vector<int> shape;
  std::vector<std::string> names;
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
  std::optional<nn::FsdpOptions> fsdp;
  bool ddp = false;  // gradients through the bucketed reducer instead
};

using testing::adamw;
using testing::MakeOptimizer;
using testing::sgd;

/// A model on a layout: the plain Sequential, or its FSDP wrapper, and a reducer for DDP.
struct Model {
  std::shared_ptr<nn::Sequential> net;
  std::unique_ptr<nn::FullyShardedDataParallel> fsdp;
  std::unique_ptr<nn::GradReducer> reducer;
  nn::Module& module() { return fsdp ? static_cast<nn::Module&>(*fsdp) : *net; }

  Model(const DeviceMesh& mesh, const Layout& layout) : net(make_net(mesh)) {
    if (layout.fsdp) fsdp = std::make_unique<nn::FullyShardedDataParallel>(mesh, net, *layout.fsdp);
    if (layout.ddp) reducer = std::make_unique<nn::GradReducer>(net->parameters());
  }
};

/// Every rank holding the same shard (the ranks that differ only off the shard dim) holds the
/// same bits of every parameter.
void expect_replicas_identical(const DeviceMesh& mesh, const Layout& layout, nn::Module& module,
                               int step) {
  std::vector<int> replica_dims;
  for (int m = 0; m < mesh.ndim(); ++m)
    if (!layout.fsdp || mesh.names()[m] != layout.fsdp->shard_dim) replica_dims.push_back(m);
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

/// The run's data: x and target [4, 2, 11, 9] laid out as `layout` says.
std::pair<ShardTensor, ShardTensor> data(const DeviceMesh& mesh, const Layout& layout) {
  testing::CaseRng rng(81);
  const Shape shape{4, 2, 11, 9};
  const Tensor x = testing::integer_tensor(shape, DType::f64, rng, -5, 5);
  const Tensor target = testing::integer_tensor(shape, DType::f64, rng, -5, 5);
  return {ShardTensor::distribute(x, mesh, layout.placements, layout.extents),
          ShardTensor::distribute(target, mesh, layout.placements, layout.extents)};
}

/// Steps [first, last) of training `model` on `layout`, appending losses; replicas checked.
void run_steps(const DeviceMesh& mesh, const Layout& layout, Model& model,
               optim::Optimizer& optimizer, int first, int last, RunResult& result) {
  const auto [x, target] = data(mesh, layout);
  for (int step = first; step < last; ++step) {
    optimizer.zero_grad();
    {
      Tape tape;
      const ShardTensor loss = ops::mse_loss(model.module().forward(x), target);
      result.losses.push_back(values_of(loss.full_tensor())[0]);
      tape.backward(loss);
    }
    if (model.reducer) model.reducer->finish();
    optimizer.step();
    expect_replicas_identical(mesh, layout, model.module(), step);
  }
}

RunResult train(std::shared_ptr<Comm> comm, const Layout& layout, const MakeOptimizer& make,
                int steps) {
  DeviceMesh mesh(comm, layout.shape, layout.names);
  Model model(mesh, layout);
  auto optimizer = make(model.module().parameters());
  RunResult result;
  run_steps(mesh, layout, model, *optimizer, 0, steps, result);
  for (const Parameter& parameter : model.module().parameters())
    result.parameters.push_back(values_of(parameter.tensor().full_tensor()));
  return result;
}

Layout one_rank() {
  return {{1}, {"dp_shard"}, {Placement::replicate()}, {}, std::nullopt};
}

/// The FSDP layouts of a world: dp_shard over the batch (with and without prefetch); with 4 ranks
/// also dp_shard x rows (uneven 7 + 4 rows) and dp_shard over 4 ranks; with 8 hybrid: dp_replicate
/// (batch) x dp_shard (uneven columns 5 + 4: parameters sharded over a dim that splits the domain)
/// x rows.
std::vector<Layout> fsdp_layouts(int world) {
  const nn::FsdpOptions over_dp{.shard_dim = "dp_shard"};
  if (world == 2)
    return {{{2}, {"dp_shard"}, {Placement::shard(0)}, {}, over_dp},
            {{2},
             {"dp_shard"},
             {Placement::shard(0)},
             {},
             nn::FsdpOptions{.shard_dim = "dp_shard", .prefetch = false}}};
  if (world == 4)
    return {{{2, 2},
             {"dp_shard", "rows"},
             {Placement::shard(0), Placement::shard(2)},
             {{}, {7, 4}},
             over_dp},
            {{4}, {"dp_shard"}, {Placement::shard(0)}, {}, over_dp, false}};
  return {{{2, 2, 2},
           {"dp_replicate", "dp_shard", "rows"},
           {Placement::shard(0), Placement::shard(3), Placement::shard(2)},
           {{}, {5, 4}, {7, 4}},
           nn::FsdpOptions{.shard_dim = "dp_shard",
                           .batch_dims = std::vector<std::string>{"dp_replicate"}}}};
}

TEST(Fsdp, SgdAndAdamWEqualOneRankOverDpDomainAndHybridMeshes) {
  for (int world : {2, 4, 8}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      auto alone = comm->split(comm->rank(), 0);
      const RunResult sgd_reference = train(alone, one_rank(), sgd, 10);
      const RunResult adamw_reference = train(alone, one_rank(), adamw, 10);
      EXPECT_LT(adamw_reference.losses.back(), adamw_reference.losses.front());
      for (const Layout& layout : fsdp_layouts(world)) {
        const std::string what = fmt::format("fsdp on mesh {}, prefetch {}",
                                             fmt::join(layout.shape, "x"), layout.fsdp->prefetch);
        expect_close(train(comm, layout, sgd, 10), sgd_reference, what + " sgd");
        expect_close(train(comm, layout, adamw, 10), adamw_reference, what + " adamw");
      }
    });
  }
}

// Parameters, gradients and optimizer state are sharded: each rank holds its Shard(0) piece;
// one gather per unit in forward and again in backward, one reduction per parameter.
TEST(Fsdp, ParametersGradientsAndStateAreShardedAndGatheredPerUnit) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"dp_shard"});
    auto net = make_net(mesh);
    nn::FullyShardedDataParallel fsdp(mesh, net);
    const auto named = fsdp.named_parameters();
    ASSERT_EQ(named.size(), 4u);
    EXPECT_EQ(named[0].first, "0.weight");
    EXPECT_EQ(named[3].first, "2.bias");
    // 0.weight [5, 2, 3, 3]: rows 3 + 2.
    EXPECT_EQ(named[0].second.tensor().to_local().shape()[0], comm->rank() == 0 ? 3 : 2);
    optim::AdamW adam(fsdp.parameters(), {.lr = 0.01});
    const Layout layout{{2}, {"dp_shard"}, {Placement::shard(0)}, {}, nn::FsdpOptions{}};
    const auto [x, target] = data(mesh, layout);
    {
      Tape tape;
      tape.backward(ops::mse_loss(fsdp.forward(x), target));
    }
    for (const Parameter& parameter : fsdp.parameters()) {
      ASSERT_TRUE(parameter.grad());
      EXPECT_EQ(parameter.grad()->spec(), parameter.tensor().spec()) << parameter.name();
    }
    adam.step();
    for (const auto& [key, value] : adam.state_dict())
      if (key != "step") {
        const size_t index = std::stoul(key.substr(0, key.find('.')));
        EXPECT_EQ(value.spec(), fsdp.parameters()[index].tensor().spec()) << key;
      }
    const nn::FsdpStats stats = fsdp.stats();
    EXPECT_EQ(stats.gathers, 4);  // two units, forward and backward
    EXPECT_EQ(stats.gradient_reductions, 4);
    EXPECT_LE(stats.max_gathered_bytes, fsdp.gathered_bytes_bound());
  });
}

// Peak host bytes of a step: at most (parameters + gradients + AdamW state) / P, plus the
// gathered parameters of two consecutive units three times over (the full copy, its unreduced
// gradient and the reduce-scatter's packed send buffer), plus the activations; and below what DDP
// (every rank holding everything) needs. Local ranks share the allocator's counters, so the
// process's figure is checked against the sum of the ranks' bounds (it is at most the sum of the
// ranks' peaks); under mpiexec each rank is its own process and the check is per rank.
TEST(Fsdp, PeakBytesPerRankWithinTheShardedBound) {
  const int world = 4;
  testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
    const int local_ranks = comm->backend() == "local" ? world : 1;
    DeviceMesh mesh(comm, {world}, {"dp_shard"});
    // Six convs of 24 channels, k5: parameters dominate the activations of an 8x8 grid.
    auto make_deep = [&] {
      auto net = std::make_shared<nn::Sequential>();
      const std::vector<int64_t> channels{2, 24, 24, 24, 24, 24, 2};
      for (size_t k = 0; k + 1 < channels.size(); ++k) {
        net->append(std::make_shared<nn::Conv>(mesh,
                                               nn::ConvConfig{.in_channels = channels[k],
                                                              .out_channels = channels[k + 1],
                                                              .kernel = 5,
                                                              .dtype = DType::f64},
                                               300 + k));
        if (k + 2 < channels.size()) net->append(std::make_shared<nn::Activation>("tanh"));
      }
      return net;
    };
    testing::CaseRng rng(5);
    const Shape shape{4, 2, 8, 8};
    const std::vector<Placement> batch{Placement::shard(0)};
    const ShardTensor x = ShardTensor::distribute(
        testing::integer_tensor(shape, DType::f64, rng, -3, 3), mesh, batch);
    const ShardTensor target = ShardTensor::distribute(
        testing::integer_tensor(shape, DType::f64, rng, -3, 3), mesh, batch);
    // Bytes of the peak of one step over the bytes in use before the model was made.
    auto step_peak = [&](bool sharded, int64_t& full_state, int64_t& gathered, int64_t& mine) {
      comm->barrier();
      const int64_t before = static_cast<int64_t>(host_allocator_stats().in_use);
      comm->barrier();
      auto net = make_deep();
      full_state = 0;
      for (const Parameter& parameter : net->parameters())
        full_state += 4 * static_cast<int64_t>(parameter.tensor().to_local().nbytes());
      std::unique_ptr<nn::FullyShardedDataParallel> fsdp;
      std::unique_ptr<nn::GradReducer> reducer;
      if (sharded)
        fsdp = std::make_unique<nn::FullyShardedDataParallel>(mesh, net);
      else
        reducer = std::make_unique<nn::GradReducer>(net->parameters());
      nn::Module& module = sharded ? static_cast<nn::Module&>(*fsdp) : *net;
      optim::AdamW adam(module.parameters(), {.lr = 0.01});
      mine = 0;  // this rank's parameters, gradients and optimizer state
      for (const Parameter& parameter : module.parameters())
        mine += 4 * static_cast<int64_t>(parameter.tensor().to_local().nbytes());
      gathered = fsdp ? fsdp->gathered_bytes_bound() : 0;
      auto step = [&] {
        adam.zero_grad();
        {
          Tape tape;
          tape.backward(ops::mse_loss(module.forward(x), target));
        }
        if (reducer) reducer->finish();
        adam.step();
      };
      step();  // the optimizer's state exists from here on
      comm->barrier();
      if (comm->rank() == 0 || local_ranks == 1) host_allocator_reset_peak();
      comm->barrier();
      step();
      comm->barrier();
      const int64_t peak = static_cast<int64_t>(host_allocator_stats().peak_in_use) - before;
      comm->barrier();
      return peak;
    };
    int64_t full_state = 0, gathered = 0, mine = 0;
    const int64_t ddp_peak = step_peak(false, full_state, gathered, mine);
    const int64_t fsdp_peak = step_peak(true, full_state, gathered, mine);
    int64_t mine_max = mine;
    comm->all_reduce(&mine_max, &mine_max, 1, DType::i64, ReduceOp::max);
    // Activations: x and target (local), the units' saved inputs and, while one unit recomputes,
    // its haloed input, output and their gradients: 16 local activations of 24 channels with a
    // 2-cell halo of 8x8 (12x12), a generous count.
    const int64_t activation = 24 * 12 * 12 * 8;
    const int64_t bound = mine_max + 3 * gathered + 16 * activation;
    if (comm->rank() == 0) {
      ::testing::Test::RecordProperty("fsdp_peak_bytes_per_rank", fsdp_peak / local_ranks);
      ::testing::Test::RecordProperty("ddp_peak_bytes_per_rank", ddp_peak / local_ranks);
      ::testing::Test::RecordProperty("bound_bytes_per_rank", bound);
    }
    EXPECT_LT(bound, full_state) << "the test would not tell sharded from replicated state";
    EXPECT_LE(fsdp_peak, local_ranks * bound)
        << "fsdp peak " << fsdp_peak << " bytes for " << local_ranks << " rank(s), bound " << bound
        << " per rank (sharded state " << mine_max << ", gathered " << gathered << ")";
    EXPECT_LT(fsdp_peak, ddp_peak) << "fsdp " << fsdp_peak << " vs ddp " << ddp_peak;
  });
}

#ifdef TESSERA_TEST_HAVE_HDF5
// A run checkpointed after step 5 under FSDP (dp_shard x uneven rows) resumes under DDP and on
// one rank, and a DDP checkpoint resumes under FSDP, with the losses of the uninterrupted run.
TEST(Fsdp, CheckpointResumesOnDdpOneRankAndBack) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    const std::string dir = testing::make_test_dir(*comm, "fsdp", "resume");
    auto alone = comm->split(comm->rank(), 0);
    const RunResult reference = train(alone, one_rank(), adamw, 10);
    const Layout sharded{{2, 2},
                         {"dp_shard", "rows"},
                         {Placement::shard(0), Placement::shard(2)},
                         {{}, {7, 4}},
                         nn::FsdpOptions{}};
    Layout ddp = sharded;
    ddp.fsdp.reset();
    ddp.ddp = true;
    ddp.extents = {{}, {5, 6}};
    auto first_half = [&](const Layout& layout, const std::string& file) {
      DeviceMesh mesh(comm, layout.shape, layout.names);
      Model model(mesh, layout);
      auto optimizer = adamw(model.module().parameters());
      RunResult result;
      run_steps(mesh, layout, model, *optimizer, 0, 5, result);
      nn::save_training_checkpoint(file, model.module(), *optimizer, {{"step", 5}});
      return result;
    };
    auto second_half = [&](std::shared_ptr<Comm> on, const Layout& layout,
                           const std::string& file) {
      DeviceMesh mesh(on, layout.shape, layout.names);
      Model model(mesh, layout);
      auto optimizer = adamw(model.module().parameters());
      EXPECT_EQ(nn::load_training_checkpoint(file, model.module(), *optimizer).at("step"), 5);
      RunResult result;
      run_steps(mesh, layout, model, *optimizer, 5, 10, result);
      return result;
    };
    const std::string from_fsdp = dir + "/fsdp.h5", from_ddp = dir + "/ddp.h5";
    const RunResult fsdp_first = first_half(sharded, from_fsdp);
    const RunResult ddp_first = first_half(ddp, from_ddp);
    const RunResult on_ddp = second_half(comm, ddp, from_fsdp);
    const RunResult on_one = second_half(alone, one_rank(), from_fsdp);
    const RunResult on_fsdp = second_half(comm, sharded, from_ddp);
    for (int i = 0; i < 5; ++i) {
      const double first = reference.losses[i], second = reference.losses[5 + i];
      EXPECT_NEAR(fsdp_first.losses[i], first, 1e-10 * std::fabs(first)) << "fsdp step " << i;
      EXPECT_NEAR(ddp_first.losses[i], first, 1e-10 * std::fabs(first)) << "ddp step " << i;
      EXPECT_NEAR(on_ddp.losses[i], second, 1e-10 * std::fabs(second)) << "on ddp " << 5 + i;
      EXPECT_NEAR(on_one.losses[i], second, 1e-10 * std::fabs(second)) << "on one " << 5 + i;
      EXPECT_NEAR(on_fsdp.losses[i], second, 1e-10 * std::fabs(second)) << "on fsdp " << 5 + i;
    }
    testing::remove_test_dir(*comm, dir);
  });
}
#endif

// Bad input: one clear error, the same on every rank, before anything moves.
TEST(Fsdp, BadInputIsOneClearErrorOnEveryRank) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"dp_shard"});
    auto expect_error = [&](const std::function<void()>& body, const std::string& words) {
      std::string message;
      try {
        body();
      } catch (const Error& error) {
        message = error.what();
      }
      EXPECT_NE(message.find("[fsdp]"), std::string::npos) << message;
      EXPECT_NE(message.find(words), std::string::npos) << message;
      const auto all = testing::all_gather_strings(*comm, message);
      EXPECT_EQ(all.front(), all.back()) << "ranks disagree";
    };
    // A shard dim that is not in the mesh.
    expect_error([&] { nn::FullyShardedDataParallel(mesh, make_net(mesh), {.shard_dim = "dp"}); },
                 "shard dim 'dp' is not a dim of the mesh");
    // A parameter on another mesh (this rank alone).
    DeviceMesh single(comm->split(comm->rank(), 0), {1}, {"dp_shard"});
    expect_error([&] { nn::FullyShardedDataParallel(mesh, make_net(single)); },
                 "not on the sharding mesh");
    // A layer recomputed in backward that keeps buffers.
    auto with_norm = make_net(mesh);
    with_norm->append(std::make_shared<nn::BatchNorm>(mesh, 2, 1e-5, 0.1, true, DType::f64));
    expect_error([&] { nn::FullyShardedDataParallel(mesh, with_norm); }, "keeps buffers");
    // A batch of 3 samples over 2 ranks.
    nn::FullyShardedDataParallel fsdp(mesh, make_net(mesh));
    testing::CaseRng rng(3);
    const ShardTensor odd = ShardTensor::distribute(
        testing::integer_tensor({3, 2, 6, 6}, DType::f64, rng, -2, 2), mesh, {Placement::shard(0)});
    expect_error([&] { fsdp.forward(odd); }, "not split evenly");
    // A batch not split over the batch dim at all.
    const ShardTensor rows = ShardTensor::distribute(
        testing::integer_tensor({2, 2, 6, 6}, DType::f64, rng, -2, 2), mesh, {Placement::shard(2)});
    expect_error([&] { fsdp.forward(rows); }, "not split along its batch");
  });
}

}  // namespace
}  // namespace tessera
