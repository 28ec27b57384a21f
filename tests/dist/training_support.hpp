// Training loop and run comparison shared by the module, training, checkpoint, FSDP, tensor-
// parallel and mixed-precision tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tessera.hpp"
#include "ops/nn/module.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"

namespace tessera::testing {

/// Losses of `count` steps of `optimizer` on mse_loss(net(x), target), one tape per step.
inline std::vector<double> train_steps(nn::Module& net, optim::Optimizer& optimizer,
                                       const ShardTensor& x, const ShardTensor& target, int count) {
  std::vector<double> losses;
  for (int step = 0; step < count; ++step) {
    optimizer.zero_grad();
    Tape tape;
    const ShardTensor loss = ops::mse_loss(net.forward(x), target);
    losses.push_back(loss.full_tensor().item_as_double({}));
    tape.backward(loss);
    optimizer.step();
  }
  return losses;
}

/// The values of a tensor of any device and dtype, as doubles in row-major order.
inline std::vector<double> values_of(const Tensor& tensor) {
  const Tensor host = tensor.to(Device::cpu()).to_dtype(DType::f64).contiguous();
  return {host.data<double>(), host.data<double>() + host.numel()};
}

/// The losses of a training run and its final parameters (full values).
struct RunResult {
  std::vector<double> losses;
  std::vector<std::vector<double>> parameters;
};

/// Losses and parameters equal within 1e-10 relative (the layout-equivalence tests' tolerance).
inline void expect_close(const RunResult& got, const RunResult& expected, const std::string& what) {
  ASSERT_EQ(got.losses.size(), expected.losses.size()) << what;
  for (size_t i = 0; i < got.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], expected.losses[i], 1e-10 * std::fabs(expected.losses[i]))
        << what << " loss of step " << i;
  ASSERT_EQ(got.parameters.size(), expected.parameters.size()) << what;
  for (size_t p = 0; p < got.parameters.size(); ++p)
    for (size_t i = 0; i < got.parameters[p].size(); ++i)
      EXPECT_NEAR(got.parameters[p][i], expected.parameters[p][i],
                  1e-10 * (1 + std::fabs(expected.parameters[p][i])))
          << what << " parameter " << p << " element " << i;
}

/// Makes a test's optimizer over the parameters it is given.
using MakeOptimizer =
    std::function<std::unique_ptr<optim::Optimizer>(const std::vector<Parameter>&)>;

/// SGD with momentum and weight decay, the training tests' first optimizer.
inline std::unique_ptr<optim::Optimizer> sgd(const std::vector<Parameter>& parameters) {
  return std::make_unique<optim::Sgd>(
      parameters, optim::SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
}

/// AdamW at PyTorch's default decay, the training tests' second optimizer.
inline std::unique_ptr<optim::Optimizer> adamw(const std::vector<Parameter>& parameters) {
  return std::make_unique<optim::AdamW>(parameters, optim::AdamOptions{.lr = 0.01});
}

}  // namespace tessera::testing
