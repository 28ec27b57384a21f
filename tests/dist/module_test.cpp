// Modules (ops/nn): dotted parameter paths in registration order, state_dict round trips across
// layouts, refused state with one error naming the key, seeded initialization identical on every
// mesh (so a model's forward equals one rank's), PyTorch's default init range, and a few steps of
// training a Sequential conv net (with and without pooling layers) on a 2x2 mesh equal to one rank.
#include <gtest/gtest.h>

#include <cmath>

#include "core/tessera.hpp"
#include "ops/nn/layers.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"
#include "tests/dist/training_support.hpp"

namespace tessera {
namespace {

std::shared_ptr<nn::Sequential> make_net(const DeviceMesh& mesh, uint64_t seed) {
  auto net = std::make_shared<nn::Sequential>();
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 6, .dtype = DType::f64}, seed));
  net->append(std::make_shared<nn::Activation>("gelu"));
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 6, .out_channels = 2, .dtype = DType::f64}, seed + 1));
  return net;
}

using testing::train_steps;

/// conv, MaxPool (2x2, stride 2), conv, AvgPool (3x3, stride 1, padding 1, count_include_pad off).
std::shared_ptr<nn::Sequential> make_pool_net(const DeviceMesh& mesh, uint64_t seed) {
  auto net = std::make_shared<nn::Sequential>();
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 4, .dtype = DType::f64}, seed));
  net->append(std::make_shared<nn::MaxPool>(ops::PoolOptions{.kernel_size = {2}}));
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 4, .out_channels = 2, .dtype = DType::f64}, seed + 1));
  net->append(std::make_shared<nn::AvgPool>(ops::PoolOptions{
      .kernel_size = {3}, .stride = {1}, .padding = {1}, .count_include_pad = false}));
  return net;
}

TEST(Modules, NamedParametersStateDictAndErrors) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    auto net = make_net(mesh, 7);
    std::vector<std::string> names;
    for (const auto& [name, parameter] : net->named_parameters()) {
      names.push_back(name);
      EXPECT_EQ(parameter.name(), name.substr(name.rfind('.') + 1));
    }
    EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
    // PyTorch's default range: |w| < 1/sqrt(fan_in) with fan_in = 2 * 3 * 3.
    const Tensor w = net->named_parameters()[0].second.tensor().full_tensor();
    for (int64_t i = 0; i < w.numel(); ++i)
      EXPECT_LE(std::fabs(w.data<double>()[i]), 1 / std::sqrt(18.0));
    // A state saved from another net (other seed) and loaded: the values move over.
    auto other = make_net(mesh, 99);
    auto state = other->state_dict();
    net->load_state_dict(state);
    for (const auto& [name, value] : net->state_dict())
      EXPECT_TRUE(bitwise_equal(value.full_tensor(), state.at(name).full_tensor())) << name;
    auto missing = state;
    missing.erase("2.bias");
    EXPECT_THROW(net->load_state_dict(missing), Error);
    auto extra = state;
    extra.emplace("3.weight", state.at("0.bias"));
    EXPECT_THROW(net->load_state_dict(extra), Error);
    auto wrong = state;
    wrong.insert_or_assign("0.bias", state.at("2.bias"));
    EXPECT_THROW(net->load_state_dict(wrong), Error);
    net->eval();
    EXPECT_FALSE(net->training());
  });
}

TEST(Modules, SeededModelsTrainTheSameOnOneRankAndOnA2x2Mesh) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    testing::CaseRng rng(12);
    const Shape shape{1, 2, 10, 7};
    const Tensor x_full = testing::integer_tensor(shape, DType::f64, rng, -4, 4);
    const Tensor target_full = testing::integer_tensor(shape, DType::f64, rng, -4, 4);
    auto run = [&](const DeviceMesh& mesh, const std::vector<Placement>& placements,
                   const std::vector<std::vector<int64_t>>& extents) {
      auto net = make_net(mesh, 3);
      optim::Sgd sgd(net->parameters(), {.lr = 0.05, .momentum = 0.9});
      return train_steps(*net, sgd, ShardTensor::distribute(x_full, mesh, placements, extents),
                         ShardTensor::distribute(target_full, mesh, placements, extents), 5);
    };
    DeviceMesh single(comm->split(comm->rank(), 0), {1, 1});
    const std::vector<double> reference =
        run(single, {Placement::replicate(), Placement::replicate()}, {});
    DeviceMesh mesh(comm, {2, 2});
    const std::vector<double> sharded =
        run(mesh, {Placement::shard(2), Placement::shard(3)}, {{6, 4}, {2, 5}});
    ASSERT_EQ(sharded.size(), reference.size());
    for (size_t i = 0; i < reference.size(); ++i)
      EXPECT_NEAR(sharded[i], reference[i], 1e-10 * std::fabs(reference[i])) << "step " << i;
    EXPECT_LT(reference.back(), reference.front());
    // Data parallel x domain: the batch split over "dp" (uneven: 3 + 1 samples), space over
    // "domain". The loss is a mean over the global batch and grid, so the parameter gradients'
    // partial sums over both mesh dims reduce to the one-rank gradient.
    const Shape batch_shape{4, 2, 10, 7};
    testing::CaseRng batch_rng(13);
    const Tensor xb = testing::integer_tensor(batch_shape, DType::f64, batch_rng, -4, 4);
    const Tensor tb = testing::integer_tensor(batch_shape, DType::f64, batch_rng, -4, 4);
    auto run_batch = [&](const DeviceMesh& on, const std::vector<Placement>& placements,
                         const std::vector<std::vector<int64_t>>& extents) {
      auto net = make_net(on, 5);
      optim::AdamW adam(net->parameters(), {.lr = 0.01});
      return train_steps(*net, adam, ShardTensor::distribute(xb, on, placements, extents),
                         ShardTensor::distribute(tb, on, placements, extents), 5);
    };
    const std::vector<double> one =
        run_batch(single, {Placement::replicate(), Placement::replicate()}, {});
    DeviceMesh dp_domain(comm, {2, 2}, {"dp", "domain"});
    const std::vector<double> both =
        run_batch(dp_domain, {Placement::shard(0), Placement::shard(2)}, {{3, 1}, {4, 6}});
    for (size_t i = 0; i < one.size(); ++i)
      EXPECT_NEAR(both[i], one[i], 1e-10 * std::fabs(one[i])) << "dp x domain, step " << i;
  });
}

/// Trains the net `make(mesh)` for 5 SGD steps on x_full -> target_full on one rank and on a
/// 2x2 mesh (x laid out as given): the losses agree within 1e-10 and decrease.
void expect_trains_like_one_rank(
    std::shared_ptr<Comm> comm,
    const std::function<std::shared_ptr<nn::Sequential>(const DeviceMesh&)>& make,
    const Tensor& x_full, const Tensor& target_full, const std::vector<Placement>& placements,
    const std::vector<std::vector<int64_t>>& extents, double lr) {
  auto run = [&](const DeviceMesh& mesh, const std::vector<Placement>& layout,
                 const std::vector<std::vector<int64_t>>& layout_extents) {
    auto net = make(mesh);
    const ShardTensor x = ShardTensor::distribute(x_full, mesh, layout, layout_extents);
    const ShardTensor probe = net->forward(x);
    EXPECT_EQ(probe.global_shape(), target_full.shape());
    optim::Sgd sgd(net->parameters(), {.lr = lr, .momentum = 0.9});
    return train_steps(
        *net, sgd, x,
        ShardTensor::distribute(target_full, mesh, probe.placements(), probe.spec().extents), 5);
  };
  DeviceMesh single(comm->split(comm->rank(), 0), {1, 1});
  const std::vector<double> reference =
      run(single, {Placement::replicate(), Placement::replicate()}, {});
  DeviceMesh mesh(comm, {2, 2});
  const std::vector<double> sharded = run(mesh, placements, extents);
  ASSERT_EQ(sharded.size(), reference.size());
  for (size_t i = 0; i < reference.size(); ++i)
    EXPECT_NEAR(sharded[i], reference[i], 1e-10 * std::fabs(reference[i])) << "step " << i;
  EXPECT_LT(reference.back(), reference.front());
}

TEST(Modules, PoolingNetTrainsTheSameOnOneRankAndOnA2x2Mesh) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    testing::CaseRng rng(14);
    const Tensor x_full = testing::integer_tensor({1, 2, 11, 8}, DType::f64, rng, -4, 4);
    const Tensor target_full = testing::integer_tensor({1, 2, 5, 4}, DType::f64, rng, -4, 4);
    auto make = [](const DeviceMesh& mesh) {
      auto net = make_pool_net(mesh, 3);
      EXPECT_EQ(net->parameters().size(), 4u) << "pooling layers have no parameters";
      return net;
    };
    expect_trains_like_one_rank(comm, make, x_full, target_full,
                                {Placement::shard(2), Placement::shard(3)}, {{6, 5}, {1, 7}}, 0.05);
  });
}

/// A channels-last MLP: Linear(4, 8), gelu, Linear(8, 3) on x [N, X, Y, 4].
TEST(Modules, LinearMlpTrainsTheSameOnOneRankAndOnA2x2Mesh) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    testing::CaseRng rng(15);
    const Tensor x_full = testing::integer_tensor({2, 5, 6, 4}, DType::f64, rng, -4, 4);
    const Tensor target_full = testing::integer_tensor({2, 5, 6, 3}, DType::f64, rng, -4, 4);
    auto make = [](const DeviceMesh& mesh) {
      auto net = std::make_shared<nn::Sequential>();
      net->append(std::make_shared<nn::Linear>(mesh, 4, 8, true, 21, DType::f64));
      net->append(std::make_shared<nn::Activation>("gelu"));
      net->append(std::make_shared<nn::Linear>(mesh, 8, 3, false, 22, DType::f64));
      EXPECT_EQ(net->parameters().size(), 3u);
      return net;
    };
    expect_trains_like_one_rank(comm, make, x_full, target_full,
                                {Placement::shard(1), Placement::shard(2)}, {{4, 1}, {0, 6}}, 0.01);
  });
}

/// Dropout: a new mask every call, the same on a 2x2 mesh as on one rank; the identity in eval.
TEST(Modules, DropoutMasksChangePerCallAgreeAcrossLayoutsAndVanishInEval) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    testing::CaseRng rng(16);
    const Tensor x_full = testing::integer_tensor({2, 3, 9, 7}, DType::f64, rng, 1, 4);
    DeviceMesh single(comm->split(comm->rank(), 0), {1, 1});
    DeviceMesh mesh(comm, {2, 2});
    nn::Dropout one(0.4, 9), many(0.4, 9);
    const ShardTensor x1 =
        ShardTensor::distribute(x_full, single, {Placement::replicate(), Placement::replicate()});
    const ShardTensor x4 = ShardTensor::distribute(
        x_full, mesh, {Placement::shard(2), Placement::shard(3)}, {{7, 2}, {0, 7}});
    const Tensor first = one.forward(x1).full_tensor();
    EXPECT_EQ(max_abs_diff(many.forward(x4).full_tensor(), first), 0.0);
    const Tensor second = one.forward(x1).full_tensor();
    EXPECT_EQ(max_abs_diff(many.forward(x4).full_tensor(), second), 0.0);
    EXPECT_GT(max_abs_diff(first, second), 0.0) << "a new mask every call";
    one.eval();
    EXPECT_EQ(max_abs_diff(one.forward(x1).full_tensor(), x_full), 0.0);
    EXPECT_THROW(nn::Dropout(1.5, 0), InvalidArgument);
  });
}

// A conv / transposed-conv encoder-decoder (downsample by 2, upsample back): PyTorch's init range
// for ConvTranspose (fan_in from the weight's dim 1 and kernel), and training on a 2x2 mesh with
// uneven shards equals one rank.
TEST(Modules, ConvTransposeInitAndTrainingOnA2x2MeshEqualOneRank) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    testing::CaseRng rng(16);
    const Tensor x_full = testing::integer_tensor({2, 2, 9, 8}, DType::f64, rng, -4, 4);
    const Tensor target_full = testing::integer_tensor({2, 2, 9, 8}, DType::f64, rng, -4, 4);
    auto make = [](const DeviceMesh& mesh) {
      nn::ConvConfig down{
          .spatial_dims = 2, .in_channels = 2, .out_channels = 4, .kernel = 3, .dtype = DType::f64};
      down.options.stride = {2};
      down.options.padding = {1};
      down.options.padding_name = "";
      nn::ConvTransposeConfig up{
          .spatial_dims = 2, .in_channels = 4, .out_channels = 2, .kernel = 3, .dtype = DType::f64};
      up.options.stride = {2};
      up.options.padding = {1};
      up.options.output_padding = {0, 1};  // 5 -> 9 rows, 4 -> 8 columns
      auto decoder = std::make_shared<nn::ConvTranspose>(mesh, up, 32);
      EXPECT_EQ(decoder->weight().tensor().global_shape(), (Shape{4, 2, 3, 3}));
      const double bound = 1.0 / std::sqrt(2.0 * 9.0);  // fan_in = out/groups * k*k
      const Tensor w = decoder->weight().tensor().full_tensor();
      double largest = 0.0;
      for (int64_t i = 0; i < w.numel(); ++i)
        largest = std::max(largest, std::fabs(w.data<double>()[i]));
      EXPECT_LE(largest, bound);
      EXPECT_GT(largest, 0.5 * bound);
      auto net = std::make_shared<nn::Sequential>();
      net->append(std::make_shared<nn::Conv>(mesh, down, 31));
      net->append(std::make_shared<nn::Activation>("gelu"));
      net->append(decoder);
      return net;
    };
    expect_trains_like_one_rank(comm, make, x_full, target_full,
                                {Placement::shard(2), Placement::shard(3)}, {{6, 3}, {1, 7}}, 0.01);
  });
}

}  // namespace
}  // namespace tessera
