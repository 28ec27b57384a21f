// Mixed precision on cuda (skipped, with the reason printed, when no GPU is visible): the cast
// op's cuda path (the backend's convert kernel) equals the cpu cast for every pair of floating
// dtypes, forward and backward, and a conv net with f32 master weights computing in bf16 and in
// f16 (with the GradScaler) trains on the GPU with the cpu run's losses (1e-2 relative: the cuda
// and cpu convolutions round differently in bf16) and f32 parameters and gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/tessera.hpp"
#include "ops/cast/cast_op.hpp"
#include "ops/nn/layers.hpp"
#include "ops/nn/mixed_precision.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

#define SKIP_WITHOUT_GPU()                                                                    \
  if (gpu::device_count() == 0)                                                               \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the cast op's cuda " \
                  "path and mixed-precision training on cuda need a GPU"

std::vector<double> values_of(const Tensor& tensor) {
  const Tensor host = tensor.to(Device::cpu()).to_dtype(DType::f64).contiguous();
  return {host.data<double>(), host.data<double>() + host.numel()};
}

TEST(CastOnGpu, EqualsTheCpuCastForEveryFloatingPair) {
  SKIP_WITHOUT_GPU();
  const std::vector<DType> dtypes{DType::f32, DType::f64, DType::f16, DType::bf16};
  std::vector<double> values;  // k / 7 and a value past f16's range
  for (int k = 0; k < 23; ++k) values.push_back((k - 11) / 7.0);
  values.push_back(1e5);
  const Tensor start = Tensor::from_values<double>({24}, values);
  for (DType from : dtypes)
    for (DType to : dtypes) {
      std::vector<std::vector<double>> results;
      for (Device device : {Device::cpu(), Device::cuda(0)})
        testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
          RankContextScope context(std::make_shared<RankContext>(device));
          DeviceMesh mesh(comm, {1});
          Parameter x(ShardTensor::distribute(start.to_dtype(from).to(device), mesh,
                                              {Placement::replicate()}),
                      "x");
          Tape tape;
          const ShardTensor y = ops::cast(x, to);
          EXPECT_EQ(y.dtype(), to);
          tape.backward(ops::sum(ops::cast(y, DType::f64)));
          EXPECT_EQ(x.grad()->dtype(), from);
          synchronize(current_rank_context().compute());
          results.push_back(values_of(y.to_local()));
        });
      ASSERT_EQ(results.size(), 2u);
      for (size_t i = 0; i < values.size(); ++i)
        EXPECT_TRUE(results[0][i] == results[1][i] ||
                    (std::isinf(results[0][i]) && std::isinf(results[1][i])))
            << dtype_name(from) << " -> " << dtype_name(to) << " element " << i;
    }
}

/// Losses of 5 steps of a conv net (f32 master weights computing in `compute`) on `device`.
std::vector<double> train(Device device, DType compute) {
  std::vector<double> losses;
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    RankContextScope context(std::make_shared<RankContext>(device));
    DeviceMesh mesh(comm, {1});
    auto net = std::make_shared<nn::Sequential>();
    net->append(
        std::make_shared<nn::Conv>(mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 8}, 3));
    net->append(std::make_shared<nn::Activation>("tanh"));
    net->append(
        std::make_shared<nn::Conv>(mesh, nn::ConvConfig{.in_channels = 8, .out_channels = 2}, 4));
    nn::apply_mixed_precision(*net, {.compute = compute});
    optim::Sgd sgd(net->parameters(), {.lr = 0.05, .momentum = 0.9});
    nn::GradScaler scaler(net->parameters(), {.init_scale = 1024});
    testing::CaseRng rng(9);
    const Tensor x = testing::integer_tensor({2, 2, 12, 10}, DType::f32, rng, -3, 3).to(device);
    const Tensor t = testing::integer_tensor({2, 2, 12, 10}, DType::f32, rng, -3, 3).to(device);
    const ShardTensor xs = ShardTensor::distribute(x, mesh, {Placement::replicate()});
    const ShardTensor ts = ShardTensor::distribute(t, mesh, {Placement::replicate()});
    for (int step = 0; step < 5; ++step) {
      sgd.zero_grad();
      {
        Tape tape;
        const ShardTensor loss = ops::mse_loss(ops::cast(net->forward(xs), DType::f32), ts);
        losses.push_back(values_of(loss.full_tensor())[0]);
        tape.backward(compute == DType::f16 ? scaler.scale(loss) : loss);
      }
      for (const Parameter& parameter : net->parameters())
        EXPECT_EQ(parameter.grad()->dtype(), DType::f32);
      if (compute == DType::f16) {
        EXPECT_TRUE(scaler.step(sgd));
        scaler.update();
      } else {
        sgd.step();
      }
    }
  });
  return losses;
}

TEST(MixedPrecisionOnGpu, Bf16AndF16TrainingEqualTheCpuRun) {
  SKIP_WITHOUT_GPU();
  for (DType compute : {DType::bf16, DType::f16}) {
    const std::vector<double> cpu = train(Device::cpu(), compute);
    const std::vector<double> cuda = train(Device::cuda(0), compute);
    ASSERT_EQ(cpu.size(), cuda.size());
    for (size_t i = 0; i < cpu.size(); ++i)
      EXPECT_NEAR(cuda[i], cpu[i], 1e-2 * std::fabs(cpu[i]))
          << dtype_name(compute) << " loss of step " << i;
  }
}

}  // namespace
}  // namespace tessera
