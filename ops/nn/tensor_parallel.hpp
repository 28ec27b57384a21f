// Tensor parallelism (Megatron's layers) over a mesh dim the caller names, default "tp": linear
// layers with their weights split over that dim, and the MLP, attention and transformer blocks
// built from them. The layers only choose their weights' layouts; the linear op's rule does the
// rest (ops/linear/linear_op.cpp), so the same code runs on any mesh: with no tp dim (an empty
// name) every layer is the plain, replicated one. Weights are drawn from the seed on the full
// tensor exactly as nn::Linear draws them, then each rank keeps its shard, so every tp size
// starts from the same values and trains like one rank.
//
// Communication per forward of a block (tp size t, activations A = batch x sequence x features
// elements): one all-reduce of A over tp after the row-parallel layer, or with sequence
// parallelism one all-gather of A before the column-parallel layers and one reduce-scatter
// after the row-parallel one; backward mirrors it (docs/parallelism.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ops/nn/layers.hpp"
#include "ops/nn/module.hpp"

namespace tessera::nn {

/// Where tensor parallelism runs.
struct TensorParallelOptions {
  std::string dim = "tp";  ///< the mesh dim splitting features and heads; "" = plain layers
  /// Activations between the tensor-parallel regions (norms, residuals) sharded along
  /// `sequence_dim` over the tp dim: all-gather before a region and reduce-scatter after it
  /// instead of one all-reduce.
  bool sequence_parallel = false;
  int sequence_dim = 1;  ///< the sequence dim of the activations [B, S, features]
};

/// The index of `options.dim` in `mesh` (-1 for ""); a name the mesh lacks is an error naming
/// `op` and the mesh's dims (the same on every rank: every rank has the same mesh).
int tensor_parallel_mesh_dim(const DeviceMesh& mesh, const TensorParallelOptions& options,
                             const std::string& op);

/// torch.nn.Linear with weight [out, in] and bias [out] split on the out features over the tp
/// dim (column-parallel): x replicated over tp (the rule gathers a sequence-sharded x), y
/// sharded on its last dim.
class ColumnParallelLinear : public Module {
 public:
  ColumnParallelLinear(const DeviceMesh& mesh, int64_t in_features, int64_t out_features, bool bias,
                       uint64_t seed, DType dtype = DType::f32, TensorParallelOptions options = {});
  ShardTensor forward(const ShardTensor& x) override;
  const Parameter& weight() const { return weight_; }
  const Parameter& bias() const { return bias_; }

 private:
  Parameter weight_, bias_;
};

/// torch.nn.Linear with weight [out, in] split on the in features over the tp dim
/// (row-parallel): x sharded on its last dim over tp, each rank's product a Partial(sum)
/// reduced once (all-reduce, or reduce-scatter along the sequence with sequence parallelism);
/// the bias [out] (replicated) is added after the reduction.
class RowParallelLinear : public Module {
 public:
  RowParallelLinear(const DeviceMesh& mesh, int64_t in_features, int64_t out_features, bool bias,
                    uint64_t seed, DType dtype = DType::f32, TensorParallelOptions options = {});
  ShardTensor forward(const ShardTensor& x) override;
  const Parameter& weight() const { return weight_; }
  const Parameter& bias() const { return bias_; }

 private:
  TensorParallelOptions options_;
  int tp_mesh_dim_;
  Parameter weight_, bias_;
};

/// fc2(gelu(fc1(x))) of x [..., features]: fc1 column-parallel (features -> hidden, seed),
/// fc2 row-parallel (hidden -> features, seed + 1): one all-reduce forward, one backward.
class ParallelMlp : public Module {
 public:
  ParallelMlp(const DeviceMesh& mesh, int64_t features, int64_t hidden, uint64_t seed,
              DType dtype = DType::f32, TensorParallelOptions options = {});
  ShardTensor forward(const ShardTensor& x) override;

 private:
  std::shared_ptr<ColumnParallelLinear> fc1_;
  std::shared_ptr<RowParallelLinear> fc2_;
};

/// Multi-head self-attention of x [B, S, embed]: q, k, v projections column-parallel (seeds
/// seed, seed + 1, seed + 2; each rank's out features are whole heads), attention per local
/// head (ops::attention), output projection row-parallel (seed + 3). The heads must divide
/// evenly over the tp dim.
class ParallelAttention : public Module {
 public:
  ParallelAttention(const DeviceMesh& mesh, int64_t embed, int64_t heads, uint64_t seed,
                    DType dtype = DType::f32, TensorParallelOptions options = {},
                    bool causal = false);
  ShardTensor forward(const ShardTensor& x) override;

 private:
  int64_t head_dim_;
  bool causal_;
  std::shared_ptr<ColumnParallelLinear> q_, k_, v_;
  std::shared_ptr<RowParallelLinear> out_;
};

/// A pre-norm transformer layer: x + attention(ln1(x)), then + mlp(ln2(x)). With sequence
/// parallelism x arrives (and leaves) sharded along the sequence over the tp dim, so the norms
/// and residual adds run on 1/t of the sequence and their parameters' gradients sum over tp.
class ParallelTransformerBlock : public Module {
 public:
  ParallelTransformerBlock(const DeviceMesh& mesh, int64_t embed, int64_t heads, int64_t hidden,
                           uint64_t seed, DType dtype = DType::f32,
                           TensorParallelOptions options = {});
  ShardTensor forward(const ShardTensor& x) override;

 private:
  std::shared_ptr<LayerNorm> ln1_, ln2_;
  std::shared_ptr<ParallelAttention> attention_;
  std::shared_ptr<ParallelMlp> mlp_;
};

/// nn::Conv (groups 1) with weight [out, in, k..] and bias [out] split on the out channels over
/// the tp dim (filter-parallel): x's channels whole there, y sharded on its channels. Composes
/// with x sharded in space (or batch) over other mesh dims.
class FilterParallelConv : public Module {
 public:
  FilterParallelConv(const DeviceMesh& mesh, ConvConfig config, uint64_t seed,
                     TensorParallelOptions options = {});
  ShardTensor forward(const ShardTensor& x) override;

 private:
  ConvConfig config_;
  Parameter weight_, bias_;
};

/// nn::Conv (groups 1) with weight [out, in, k..] split on the in channels over the tp dim
/// (channel-parallel): x sharded on its channels there, each rank's sum over its channels a
/// Partial(sum) reduced once (all-reduce over tp); the bias [out] is added after the reduction.
class ChannelParallelConv : public Module {
 public:
  ChannelParallelConv(const DeviceMesh& mesh, ConvConfig config, uint64_t seed,
                      TensorParallelOptions options = {});
  ShardTensor forward(const ShardTensor& x) override;

 private:
  ConvConfig config_;
  int tp_mesh_dim_;
  Parameter weight_, bias_;
};

/// nn::ConvTranspose (groups 1) with weight [in, out, k..] and bias [out] split on the out
/// channels (weight dim 1) over the tp dim (filter-parallel): x's channels whole there, y sharded
/// on its channels. Composes with x sharded in space (or batch) over other mesh dims.
class FilterParallelConvTranspose : public Module {
 public:
  FilterParallelConvTranspose(const DeviceMesh& mesh, ConvTransposeConfig config, uint64_t seed,
                              TensorParallelOptions options = {});
  ShardTensor forward(const ShardTensor& x) override;

 private:
  ConvTransposeConfig config_;
  Parameter weight_, bias_;
};

/// nn::ConvTranspose (groups 1) with weight [in, out, k..] split on the in channels (weight dim 0)
/// over the tp dim (channel-parallel): x sharded on its channels there, each rank's sum over its
/// channels a Partial(sum) reduced once (all-reduce over tp); the bias [out] is added after the
/// reduction.
class ChannelParallelConvTranspose : public Module {
 public:
  ChannelParallelConvTranspose(const DeviceMesh& mesh, ConvTransposeConfig config, uint64_t seed,
                               TensorParallelOptions options = {});
  ShardTensor forward(const ShardTensor& x) override;

 private:
  ConvTransposeConfig config_;
  int tp_mesh_dim_;
  Parameter weight_, bias_;
};

}  // namespace tessera::nn
