// Layers over the sharded ops (Modules, ops/nn/module.hpp). Weights are initialized like
// PyTorch's defaults (Conv, ConvTranspose: kaiming_uniform with a = sqrt(5), i.e. uniform in
// +-1/sqrt(fan_in), and the bias in the same range; norms: weight 1, bias 0) from a seed, on the
// full tensor, so every layout of every mesh starts from the same values; parameters are replicated
// on the mesh they are made on, on the calling rank's device.
#pragma once

#include <cstdint>
#include <string>

#include "ops/conv/conv_op.hpp"
#include "ops/dropout/dropout_op.hpp"
#include "ops/interpolate/interpolate_op.hpp"
#include "ops/linear/linear_op.hpp"
#include "ops/nn/module.hpp"
#include "ops/norm/norm_op.hpp"
#include "ops/pool/pool_op.hpp"

namespace tessera::nn {

struct ConvConfig {
  int spatial_dims = 2;  ///< 1, 2 or 3 (conv1d/2d/3d)
  int64_t in_channels = 1;
  int64_t out_channels = 1;
  int64_t kernel = 3;  ///< extent along every spatial dim
  bool bias = true;
  DType dtype = DType::f32;
  ops::ConvOptions options = same_padding();  ///< stride, dilation, padding, groups, mode

  static ops::ConvOptions same_padding() {
    ops::ConvOptions same;
    same.padding_name = "same";
    return same;
  }
};

/// torch.nn.Conv1d/2d/3d: weight [out, in/groups, k...] and bias [out], replicated on `mesh`.
class Conv : public Module {
 public:
  Conv(const DeviceMesh& mesh, ConvConfig config, uint64_t seed);
  ShardTensor forward(const ShardTensor& x) override;
  const Parameter& weight() const { return weight_; }
  const Parameter& bias() const { return bias_; }

 private:
  ConvConfig config_;
  Parameter weight_, bias_;
};

struct ConvTransposeConfig {
  int spatial_dims = 2;  ///< 1, 2 or 3 (conv_transpose1d/2d/3d)
  int64_t in_channels = 1;
  int64_t out_channels = 1;
  int64_t kernel = 2;  ///< extent along every spatial dim
  bool bias = true;
  DType dtype = DType::f32;
  ops::ConvTransposeOptions options{};  ///< stride, padding, output_padding, dilation, groups
};

/// torch.nn.ConvTranspose1d/2d/3d: weight [in, out/groups, k...] and bias [out], replicated on
/// `mesh`; both uniform in +-1/sqrt(fan_in) with fan_in = out/groups * prod(k) (PyTorch's
/// kaiming_uniform with a = sqrt(5) on the transposed weight).
class ConvTranspose : public Module {
 public:
  ConvTranspose(const DeviceMesh& mesh, ConvTransposeConfig config, uint64_t seed);
  ShardTensor forward(const ShardTensor& x) override;
  const Parameter& weight() const { return weight_; }
  const Parameter& bias() const { return bias_; }

 private:
  ConvTransposeConfig config_;
  Parameter weight_, bias_;
};

/// torch.nn.MaxPool1d/2d/3d (by the rank of the input): no parameters.
class MaxPool : public Module {
 public:
  explicit MaxPool(ops::PoolOptions options);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  ops::PoolOptions options_;
};

/// torch.nn.Upsample (1/2/3-d by the rank of the input): ops::interpolate, no parameters.
class Upsample : public Module {
 public:
  explicit Upsample(ops::InterpolateOptions options);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  ops::InterpolateOptions options_;
};

/// torch.nn.AvgPool1d/2d/3d (by the rank of the input): no parameters.
class AvgPool : public Module {
 public:
  explicit AvgPool(ops::PoolOptions options);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  ops::PoolOptions options_;
};

/// torch.nn.GroupNorm: `groups` groups of `channels` / groups channels; weight [channels] = 1 and
/// bias = 0 when `affine`.
class GroupNorm : public Module {
 public:
  GroupNorm(const DeviceMesh& mesh, int64_t groups, int64_t channels, double eps = 1e-5,
            bool affine = true, DType dtype = DType::f32);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  int64_t groups_;
  double eps_;
  Parameter weight_, bias_;
};

/// torch.nn.BatchNorm1d/2d/3d (by the rank of the input): weight [channels] = 1 and bias = 0 when
/// `affine`; buffers running_mean = 0 and running_var = 1 [channels] (replicated), updated with
/// `momentum` by every forward in training mode and used in eval mode.
class BatchNorm : public Module {
 public:
  BatchNorm(const DeviceMesh& mesh, int64_t channels, double eps = 1e-5, double momentum = 0.1,
            bool affine = true, DType dtype = DType::f32);
  ShardTensor forward(const ShardTensor& x) override;
  const Parameter& weight() const { return weight_; }
  const Parameter& bias() const { return bias_; }

 private:
  double eps_, momentum_;
  Parameter weight_, bias_;
};

/// torch.nn.InstanceNorm1d/2d/3d without running statistics: weight [channels] = 1 and bias = 0
/// when `affine` (PyTorch's default: no affine).
class InstanceNorm : public Module {
 public:
  InstanceNorm(const DeviceMesh& mesh, int64_t channels, double eps = 1e-5, bool affine = false,
               DType dtype = DType::f32);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  double eps_;
  Parameter weight_, bias_;
};

/// torch.nn.LayerNorm over the trailing dims `normalized_shape`: weight = 1 and bias = 0 of that
/// shape when `elementwise_affine`.
class LayerNorm : public Module {
 public:
  LayerNorm(const DeviceMesh& mesh, Shape normalized_shape, double eps = 1e-5,
            bool elementwise_affine = true, DType dtype = DType::f32);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  Shape normalized_shape_;
  double eps_;
  Parameter weight_, bias_;
};

/// torch.nn.Linear: weight [out, in] and bias [out] (uniform in +-1/sqrt(in), as PyTorch's
/// default), replicated on `mesh`; applies to x [..., in] sharded on any dim.
class Linear : public Module {
 public:
  Linear(const DeviceMesh& mesh, int64_t in_features, int64_t out_features, bool bias,
         uint64_t seed, DType dtype = DType::f32);
  ShardTensor forward(const ShardTensor& x) override;
  const Parameter& weight() const { return weight_; }
  const Parameter& bias() const { return bias_; }

 private:
  Parameter weight_, bias_;
};

/// torch.nn.Dropout: in training, zeroes each element with probability p (the identity in
/// eval). Call k uses the mask of seed (seed + k): a new mask every step, the same on every
/// layout and rank count (ops::dropout's mask is a function of the seed and the global index).
/// k is the module's counter "calls", saved by training checkpoints, so a resumed run continues
/// with the masks the uninterrupted run would have drawn.
class Dropout : public Module {
 public:
  Dropout(double p, uint64_t seed);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  double p_;
  uint64_t seed_;
};

/// Elementwise activations: "relu", "gelu", "silu", "tanh", "sigmoid" or "softplus".
class Activation : public Module {
 public:
  explicit Activation(std::string kind);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  std::string kind_;
};

}  // namespace tessera::nn
