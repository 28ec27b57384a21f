// Training loop shared by the module, training and checkpoint tests.
#pragma once

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

}  // namespace tessera::testing
