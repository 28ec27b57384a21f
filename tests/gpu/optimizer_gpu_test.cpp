// The optimizers on cuda parameters (skipped, with the reason printed, when no GPU is visible):
// SGD (momentum, nesterov, weight decay) and Adam/AdamW (amsgrad) updates of cuda parameters in
// f32 and f64 for several steps equal the same updates of cpu parameters (the kernels run the
// cpu loops' per-element rules, ops/optim/update_rules.hpp; fused multiply-adds on the device
// leave a few units of roundoff), and a conv net trained on cuda with the data-parallel reducer
// over 2 local ranks sharing the GPU gives the losses of the cpu run.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/tessera.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/layers.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

#define SKIP_WITHOUT_GPU()                                                                      \
  if (gpu::device_count() == 0)                                                                 \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the optimizers' cuda " \
                  "updates need a GPU"

std::vector<double> values_of(const Tensor& tensor) {
  const Tensor host = tensor.to(Device::cpu()).to_dtype(DType::f64).contiguous();
  return {host.data<double>(), host.data<double>() + host.numel()};
}

using MakeOptimizer =
    std::function<std::unique_ptr<optim::Optimizer>(const std::vector<Parameter>&)>;

/// The parameter's values after `steps` updates with fixed gradients, on `device`.
std::vector<double> updated(Device device, DType dtype, const MakeOptimizer& make, int steps) {
  std::vector<double> result;
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    RankContextScope context(std::make_shared<RankContext>(device));
    DeviceMesh mesh(comm, {1});
    testing::CaseRng rng(5);
    const Tensor start = testing::integer_tensor({3, 1000}, dtype, rng, -9, 9).to(device);
    Parameter p(ShardTensor::distribute(start, mesh, {Placement::replicate()}), "p");
    auto optimizer = make({p});
    for (int step = 0; step < steps; ++step) {
      const Tensor g = testing::integer_tensor({3, 1000}, dtype, rng, -9, 9).to(device);
      p.set_grad(ShardTensor::distribute(g, mesh, {Placement::replicate()}));
      optimizer->step();
    }
    synchronize(current_rank_context().compute());
    result = values_of(p.tensor().to_local());
  });
  return result;
}

TEST(OptimizersOnGpu, CudaUpdatesEqualCpuUpdates) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::pair<std::string, MakeOptimizer>> optimizers{
      {"sgd nesterov",
       [](const std::vector<Parameter>& ps) {
         return std::make_unique<optim::Sgd>(
             ps, optim::SgdOptions{
                     .lr = 0.01, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
       }},
      {"adam amsgrad",
       [](const std::vector<Parameter>& ps) {
         return std::make_unique<optim::Adam>(
             ps, optim::AdamOptions{.lr = 0.01, .weight_decay = 1e-2, .amsgrad = true});
       }},
      {"adamw", [](const std::vector<Parameter>& ps) {
         return std::make_unique<optim::AdamW>(ps, optim::AdamOptions{.lr = 0.01});
       }}};
  for (const auto& [name, make] : optimizers)
    for (DType dtype : {DType::f64, DType::f32}) {
      SCOPED_TRACE(name + " " + std::string(dtype_name(dtype)));
      const std::vector<double> cpu = updated(Device::cpu(), dtype, make, 5);
      const std::vector<double> cuda = updated(Device::cuda(0), dtype, make, 5);
      ASSERT_EQ(cpu.size(), cuda.size());
      const double tolerance = dtype == DType::f64 ? 1e-12 : 1e-5;
      for (size_t i = 0; i < cpu.size(); ++i)
        ASSERT_NEAR(cuda[i], cpu[i], tolerance * (1 + std::fabs(cpu[i]))) << "element " << i;
    }
}

/// Losses of 5 AdamW steps of a conv2d net with the batch over 2 ranks, on `device`.
std::vector<double> train_losses(Device device) {
  std::vector<double> losses;
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    // The rank's device: where the layers make their parameters.
    RankContextScope context(std::make_shared<RankContext>(device));
    DeviceMesh mesh(comm, {2}, {"dp"});
    nn::Sequential net;
    net.append(std::make_shared<nn::Conv>(
        mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 4, .dtype = DType::f64}, 1));
    net.append(std::make_shared<nn::Activation>("gelu"));
    net.append(std::make_shared<nn::Conv>(
        mesh, nn::ConvConfig{.in_channels = 4, .out_channels = 2, .dtype = DType::f64}, 2));
    optim::AdamW optimizer(net.parameters(), {.lr = 0.01});
    nn::GradReducer reducer(net.parameters());
    testing::CaseRng rng(9);
    const Tensor x = testing::integer_tensor({2, 2, 12, 10}, DType::f64, rng, -4, 4).to(device);
    const Tensor y = testing::integer_tensor({2, 2, 12, 10}, DType::f64, rng, -4, 4).to(device);
    const ShardTensor xs = ShardTensor::distribute(x, mesh, {Placement::shard(0)});
    const ShardTensor ys = ShardTensor::distribute(y, mesh, {Placement::shard(0)});
    std::vector<double> mine;
    for (int step = 0; step < 5; ++step) {
      optimizer.zero_grad();
      Tape tape;
      const ShardTensor loss = ops::mse_loss(net.forward(xs), ys);
      mine.push_back(loss.full_tensor().to(Device::cpu()).item_as_double({}));
      tape.backward(loss);
      reducer.finish();
      optimizer.step();
    }
    if (comm->rank() == 0) losses = mine;
  });
  return losses;
}

TEST(OptimizersOnGpu, DataParallelTrainingOnCudaEqualsCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<double> cpu = train_losses(Device::cpu());
  const std::vector<double> cuda = train_losses(Device::cuda(0));
  ASSERT_EQ(cpu.size(), cuda.size());
  for (size_t i = 0; i < cpu.size(); ++i)
    EXPECT_NEAR(cuda[i], cpu[i], 1e-10 * std::fabs(cpu[i])) << "step " << i;
}

}  // namespace
}  // namespace tessera
