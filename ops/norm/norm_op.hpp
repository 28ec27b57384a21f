// The sharded normalization ops group_norm, batch_norm, instance_norm and layer_norm, with the
// semantics of torch.nn.functional's functions of the same names, on x sharded on any dims.
// Statistics are reduced over exactly the mesh dims that shard the reduced dims (docs/ops.md).
#pragma once

#include <cstdint>
#include <optional>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Collective: group_norm of x [N, C, spatial..] over `groups` groups of C/groups channels, with
/// optional per-channel w, b [C]; the output has x's layout.
ShardTensor group_norm(const ShardTensor& x, int64_t groups,
                       const std::optional<ShardTensor>& w = std::nullopt,
                       const std::optional<ShardTensor>& b = std::nullopt, double eps = 1e-5);

/// Options of batch_norm.
struct BatchNormOptions {
  /// Normalize with the batch's statistics (and update the running ones), else with the running
  /// statistics.
  bool training = true;
  /// Weight of the batch's statistics in the running ones' update.
  double momentum = 0.1;
  double eps = 1e-5;
};

/// batch_norm's output and running statistics (those are absent when none were given).
struct BatchNormResult {
  ShardTensor y;
  std::optional<ShardTensor> running_mean, running_var;
};

/// Collective: batch_norm of x [N, C, spatial..]. Training: statistics over N and every spatial
/// dim (biased variance), and the running statistics [C] updated with momentum (the variance
/// unbiased), replicated, identical on every rank. Eval: normalizes with the running statistics
/// (then required).
BatchNormResult batch_norm(const ShardTensor& x,
                           const std::optional<ShardTensor>& running_mean = std::nullopt,
                           const std::optional<ShardTensor>& running_var = std::nullopt,
                           const std::optional<ShardTensor>& w = std::nullopt,
                           const std::optional<ShardTensor>& b = std::nullopt,
                           const BatchNormOptions& options = {});

/// Collective: instance_norm of x [N, C, spatial..]: every (n, c) plane over its spatial dims,
/// optional w, b [C].
ShardTensor instance_norm(const ShardTensor& x, const std::optional<ShardTensor>& w = std::nullopt,
                          const std::optional<ShardTensor>& b = std::nullopt, double eps = 1e-5);

/// Collective: layer_norm of x over its trailing `normalized_ndim` dims, optional w, b of the
/// shape of those dims.
ShardTensor layer_norm(const ShardTensor& x, int64_t normalized_ndim,
                       const std::optional<ShardTensor>& w = std::nullopt,
                       const std::optional<ShardTensor>& b = std::nullopt, double eps = 1e-5);

}  // namespace tessera::ops
