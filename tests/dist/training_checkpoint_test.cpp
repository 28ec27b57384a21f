// Training checkpoints (ops/nn/checkpoint.hpp): a run saved after 5 steps on a 2x2 mesh and
// resumed on another decomposition (4x1 ranks, other extents) or on one rank gives steps 6..10
// with the losses of the uninterrupted one-rank run; the counters come back; a checkpoint missing
// a parameter is refused with one error on every rank, leaving the module untouched.
#include <gtest/gtest.h>

#include <cmath>

#include "core/tessera.hpp"
#include "io/hdf5/checkpoint.hpp"
#include "ops/nn/checkpoint.hpp"
#include "ops/nn/layers.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/io_test_support.hpp"
#include "tests/dist/shard_cases.hpp"
#include "tests/dist/training_support.hpp"

namespace tessera {
namespace {

std::shared_ptr<nn::Sequential> make_net(const DeviceMesh& mesh) {
  auto net = std::make_shared<nn::Sequential>();
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 4, .dtype = DType::f64}, 21));
  net->append(std::make_shared<nn::Activation>("tanh"));
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 4, .out_channels = 2, .dtype = DType::f64}, 22));
  return net;
}

/// Losses of `count` steps of `optimizer` on the test data laid out as given.
std::vector<double> steps(nn::Module& net, optim::Optimizer& optimizer, const DeviceMesh& mesh,
                          const std::vector<Placement>& placements,
                          const std::vector<std::vector<int64_t>>& extents, int count) {
  testing::CaseRng rng(31);
  const Shape shape{2, 2, 12, 8};
  const ShardTensor x = ShardTensor::distribute(
      testing::integer_tensor(shape, DType::f64, rng, -4, 4), mesh, placements, extents);
  const ShardTensor target = ShardTensor::distribute(
      testing::integer_tensor(shape, DType::f64, rng, -4, 4), mesh, placements, extents);
  return testing::train_steps(net, optimizer, x, target, count);
}

TEST(TrainingCheckpoint, ResumesOnAnotherLayoutWithTheSameLosses) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    const std::string dir = testing::make_test_dir(*comm, "training_checkpoint", "resume");
    const std::string file = dir + "/run.h5";
    DeviceMesh single(comm->split(comm->rank(), 0), {1, 1});
    const std::vector<Placement> whole{Placement::replicate(), Placement::replicate()};
    auto reference_net = make_net(single);
    optim::AdamW reference_adam(reference_net->parameters(), {.lr = 0.02});
    const std::vector<double> reference =
        steps(*reference_net, reference_adam, single, whole, {}, 10);

    // Steps 1..5 on 2x2 (uneven), saved.
    DeviceMesh grid(comm, {2, 2});
    auto net = make_net(grid);
    optim::AdamW adam(net->parameters(), {.lr = 0.02});
    const std::vector<double> first =
        steps(*net, adam, grid, {Placement::shard(2), Placement::shard(3)}, {{7, 5}, {3, 5}}, 5);
    nn::save_training_checkpoint(file, *net, adam, {{"step", 5}, {"data_epoch", 1}});

    // Steps 6..10 on 4x1 ranks with other extents, and on one rank alone.
    DeviceMesh column(comm, {4, 1});
    auto resumed = make_net(column);
    optim::AdamW resumed_adam(resumed->parameters(), {.lr = 0.02});
    const auto counters = nn::load_training_checkpoint(file, *resumed, resumed_adam);
    EXPECT_EQ(counters.at("step"), 5);
    EXPECT_EQ(counters.at("data_epoch"), 1);
    EXPECT_EQ(resumed_adam.steps(), 5);
    const std::vector<double> second =
        steps(*resumed, resumed_adam, column, {Placement::shard(2), Placement::replicate()},
              {{2, 4, 1, 5}, {}}, 5);
    auto alone = make_net(single);
    optim::AdamW alone_adam(alone->parameters(), {.lr = 0.02});
    nn::load_training_checkpoint(file, *alone, alone_adam);
    const std::vector<double> alone_losses = steps(*alone, alone_adam, single, whole, {}, 5);
    for (int i = 0; i < 5; ++i) {
      EXPECT_NEAR(first[i], reference[i], 1e-10 * std::fabs(reference[i])) << "step " << i;
      EXPECT_NEAR(second[i], reference[5 + i], 1e-10 * std::fabs(reference[5 + i]))
          << "resumed on 4x1, step " << 5 + i;
      EXPECT_NEAR(alone_losses[i], reference[5 + i], 1e-10 * std::fabs(reference[5 + i]))
          << "resumed on one rank, step " << 5 + i;
    }

    // A checkpoint without one of the parameters: refused everywhere, nothing written.
    const std::string partial = dir + "/partial.h5";
    std::vector<std::pair<std::string, ShardTensor>> tensors;
    for (const auto& [name, value] : net->state_dict())
      if (name != "2.bias") tensors.emplace_back("model/" + name, value);
    for (const auto& [key, value] : adam.state_dict()) tensors.emplace_back("optim/" + key, value);
    io::save_checkpoint(partial, tensors);
    auto untouched = make_net(grid);
    optim::AdamW untouched_adam(untouched->parameters(), {.lr = 0.02});
    const Tensor before = untouched->parameters()[0].tensor().full_tensor();
    EXPECT_THROW(nn::load_training_checkpoint(partial, *untouched, untouched_adam), Error);
    EXPECT_TRUE(bitwise_equal(untouched->parameters()[0].tensor().full_tensor(), before));
    testing::remove_test_dir(*comm, dir);
  });
}

/// make_net with a Dropout after the first conv: its masks depend on its call counter.
std::shared_ptr<nn::Sequential> make_dropout_net(const DeviceMesh& mesh) {
  auto net = std::make_shared<nn::Sequential>();
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 4, .dtype = DType::f64}, 21));
  net->append(std::make_shared<nn::Dropout>(0.3, 77));
  net->append(std::make_shared<nn::Activation>("tanh"));
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 4, .out_channels = 2, .dtype = DType::f64}, 22));
  return net;
}

TEST(TrainingCheckpoint, DropoutMasksContinueAfterResuming) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    const std::string dir = testing::make_test_dir(*comm, "training_checkpoint", "dropout");
    const std::string file = dir + "/run.h5";
    DeviceMesh single(comm->split(comm->rank(), 0), {1, 1});
    const std::vector<Placement> whole{Placement::replicate(), Placement::replicate()};
    auto reference_net = make_dropout_net(single);
    optim::Sgd reference_sgd(reference_net->parameters(), {.lr = 0.05, .momentum = 0.9});
    const std::vector<double> reference =
        steps(*reference_net, reference_sgd, single, whole, {}, 10);

    DeviceMesh grid(comm, {2, 2});
    auto net = make_dropout_net(grid);
    optim::Sgd sgd(net->parameters(), {.lr = 0.05, .momentum = 0.9});
    steps(*net, sgd, grid, {Placement::shard(2), Placement::shard(3)}, {{7, 5}, {3, 5}}, 5);
    ASSERT_EQ(net->named_counters(),
              (std::vector<std::pair<std::string, int64_t>>{{"1.calls", 5}}));
    nn::save_training_checkpoint(file, *net, sgd, {{"step", 5}});

    auto resumed = make_dropout_net(single);
    optim::Sgd resumed_sgd(resumed->parameters(), {.lr = 0.05, .momentum = 0.9});
    nn::load_training_checkpoint(file, *resumed, resumed_sgd);
    EXPECT_EQ(resumed->named_counters().at(0).second, 5);
    const std::vector<double> second = steps(*resumed, resumed_sgd, single, whole, {}, 5);
    for (int i = 0; i < 5; ++i)
      EXPECT_NEAR(second[i], reference[5 + i], 1e-10 * std::fabs(reference[5 + i]))
          << "resumed, step " << 5 + i;
    // The masks differ from step to step: a run restarted at call 0 would not match.
    EXPECT_NE(reference[5], reference[6]);

    // A model without the counter (no dropout) refuses the file; nothing is written.
    auto other = make_net(single);
    optim::Sgd other_sgd(other->parameters(), {.lr = 0.05, .momentum = 0.9});
    const Tensor before = other->parameters()[0].tensor().full_tensor();
    EXPECT_THROW(nn::load_training_checkpoint(file, *other, other_sgd), Error);
    EXPECT_TRUE(bitwise_equal(other->parameters()[0].tensor().full_tensor(), before));
    testing::remove_test_dir(*comm, dir);
  });
}

}  // namespace
}  // namespace tessera
