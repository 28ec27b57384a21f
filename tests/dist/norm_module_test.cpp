// The normalization modules (ops/nn/layers.hpp): PyTorch's default init (weight 1, bias 0,
// running statistics 0 and 1), BatchNorm's buffers updated by training forwards exactly as
// ops::batch_norm updates them and used in eval mode, saved and restored through state_dict, the
// same on 2 ranks sharded as on one; GroupNorm, InstanceNorm and LayerNorm equal their ops.
#include <gtest/gtest.h>

#include "core/autograd.hpp"
#include "ops/nn/layers.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

Tensor random_x(const Shape& shape, uint64_t seed) {
  testing::CaseRng rng(seed);
  Tensor x = testing::integer_tensor(shape, DType::f64, rng, -100, 100);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<double>()[i] = x.data<double>()[i] / 32.0 + 2.0;
  return x;
}

/// Two training forwards and one eval forward of a BatchNorm on `mesh` (x sharded along the last
/// dim as `extents` say): the eval output and the running statistics after.
std::vector<Tensor> batch_norm_steps(const DeviceMesh& mesh, const std::vector<int64_t>& extents) {
  nn::BatchNorm bn(mesh, 3, 1e-5, 0.2, true, DType::f64);
  const Shape shape{4, 3, 6};
  std::vector<Tensor> results;
  for (int step = 0; step < 3; ++step) {
    if (step == 2) bn.eval();
    const ShardTensor x =
        ShardTensor::distribute(random_x(shape, 10 + step), mesh, {Placement::shard(2)}, {extents});
    const ShardTensor y = bn.forward(x);
    if (step == 2) results.push_back(y.full_tensor());
  }
  results.push_back(bn.state_dict().at("running_mean").full_tensor());
  results.push_back(bn.state_dict().at("running_var").full_tensor());
  return results;
}

TEST(NormModules, BatchNormUpdatesItsBuffersLikeTheOpAndUsesThemInEval) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    auto self = comm->split(comm->rank(), 0);
    DeviceMesh single(self, {1});
    const std::vector<Placement> replicated{Placement::replicate()};
    // Defaults: weight 1, bias 0, running_mean 0, running_var 1.
    nn::BatchNorm fresh(mesh, 3, 1e-5, 0.2, true, DType::f64);
    const auto state = fresh.state_dict();
    ASSERT_EQ(state.size(), 4u);
    for (const auto& [name, value] : std::vector<std::pair<std::string, double>>{
             {"weight", 1.0}, {"bias", 0.0}, {"running_mean", 0.0}, {"running_var", 1.0}}) {
      const Tensor full = state.at(name).full_tensor();
      for (int64_t i = 0; i < full.numel(); ++i) EXPECT_EQ(full.data<double>()[i], value) << name;
    }
    // The module's three forwards equal the op's, step by step, on one rank.
    const Shape shape{4, 3, 6};
    Tensor mean = Tensor::zeros({3}, DType::f64), var = Tensor::zeros({3}, DType::f64);
    var.fill(1.0);
    Tensor y_eval;
    for (int step = 0; step < 3; ++step) {
      const auto replicate = [&](const Tensor& t) {
        return ShardTensor::distribute(t, single, replicated);
      };
      const ops::BatchNormResult result = ops::batch_norm(
          replicate(random_x(shape, 10 + step)), replicate(mean), replicate(var), std::nullopt,
          std::nullopt, {.training = step < 2, .momentum = 0.2, .eps = 1e-5});
      if (step == 2) y_eval = result.y.full_tensor();
      mean = result.running_mean->full_tensor();
      var = result.running_var->full_tensor();
    }
    const auto on_one = batch_norm_steps(single, {6});
    const auto on_two = batch_norm_steps(mesh, {4, 2});
    EXPECT_LE(max_abs_diff(on_one[0], y_eval), 1e-12) << "eval output uses the buffers";
    EXPECT_LE(max_abs_diff(on_one[1], mean), 1e-12) << "running_mean";
    EXPECT_LE(max_abs_diff(on_one[2], var), 1e-12) << "running_var";
    for (size_t i = 0; i < on_one.size(); ++i)
      EXPECT_LE(testing::relative_error(on_two[i], on_one[i]), 1e-12) << "2 ranks, result " << i;
    // state_dict carries the buffers; load_state_dict restores them.
    nn::BatchNorm trained(mesh, 3, 1e-5, 0.2, true, DType::f64);
    trained.forward(ShardTensor::distribute(random_x(shape, 10), mesh, replicated));
    fresh.load_state_dict(trained.state_dict());
    EXPECT_TRUE(bitwise_equal(fresh.state_dict().at("running_var").full_tensor(),
                              trained.state_dict().at("running_var").full_tensor()));
  });
}

TEST(NormModules, GroupInstanceAndLayerNormEqualTheirOps) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    const ShardTensor x =
        ShardTensor::distribute(random_x({2, 4, 5, 6}, 3), mesh, {Placement::shard(3)}, {{5, 1}});
    nn::GroupNorm group(mesh, 2, 4, 1e-5, true, DType::f64);
    nn::InstanceNorm instance(mesh, 4, 1e-5, false, DType::f64);
    nn::LayerNorm layer(mesh, {5, 6}, 1e-5, true, DType::f64);
    EXPECT_EQ(group.parameters().size(), 2u);
    EXPECT_EQ(instance.parameters().size(), 0u);
    EXPECT_EQ(layer.named_parameters()[0].second.tensor().global_shape(), (Shape{5, 6}));
    EXPECT_LE(max_abs_diff(group.forward(x).full_tensor(), ops::group_norm(x, 2).full_tensor()),
              1e-14);
    EXPECT_LE(max_abs_diff(instance.forward(x).full_tensor(), ops::instance_norm(x).full_tensor()),
              1e-14);
    EXPECT_LE(max_abs_diff(layer.forward(x).full_tensor(), ops::layer_norm(x, 2).full_tensor()),
              1e-14);
    nn::LayerNorm wrong(mesh, {6, 5}, 1e-5, true, DType::f64);
    EXPECT_THROW(wrong.forward(x), InvalidArgument);
  });
}

}  // namespace
}  // namespace tessera
