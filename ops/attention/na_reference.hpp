// Plain C++ neighborhood attention (NATTEN semantics) for 1-d, 2-d and 3-d, forward and
// backward, on cpu tensors in the heads-last layout q, k, v [B, X(, Y(, Z)), heads, D].
//
// The kernels are told where their pieces lie in the global index space: the global offset of
// the local query piece, the global offset of the key/value tile they are given (a haloed
// tile in a sharded call, the whole tensor in an unsharded one) and the global extents. Windows
// are computed from global indices and global extents, so the same function serves both calls.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.hpp"

namespace tessera::ops {

/// The keys of one query along one axis: global indices first + t * step for t < count.
struct NaWindow {
  int64_t first = 0;
  int64_t count = 0;
  int64_t step = 1;
  /// One past the last key index (first + (count - 1) * step + 1).
  int64_t end() const { return first + (count - 1) * step + 1; }
};

/// The window of query `index` along an axis of global extent `length` with kernel `kernel`,
/// dilation `dilation` (kernel * dilation <= length), causal or not. Non-causal windows hold
/// exactly `kernel` keys and shift (not shrink) at the global borders.
NaWindow na_window(int64_t index, int64_t length, int64_t kernel, int64_t dilation, bool causal);

/// Per-spatial-axis attributes of one call (1 to 3 axes, all vectors of the same size).
struct NaGeometry {
  std::vector<int64_t> extent;    ///< global extent L of each axis
  std::vector<int64_t> kernel;    ///< kernel size k (odd or even, k * d <= L)
  std::vector<int64_t> dilation;  ///< dilation d >= 1
  std::vector<int64_t> causal;    ///< 0 or 1
  double scale = 1.0;             ///< logits are scale * q.k (+ bias)
};

/// Where the local pieces lie (spatial axes only; batch, heads and D are whole in both).
struct NaPieces {
  std::vector<int64_t> query_offset;  ///< global index of the first local query, per axis
  std::vector<int64_t> key_offset;    ///< global index of the first row of the k/v tile, per axis
};

/// Outputs of the forward: o [B, X.., heads, D] (q's dtype) and lse [B, X.., heads] (f32 for
/// f16/bf16 inputs, otherwise q's dtype).
struct NaForward {
  Tensor output;
  Tensor lse;
};

/// Gradients: dq (q's shape), dk and dv (the tile's shape, halo rows included), drpb (rpb's
/// shape; an empty tensor without rpb).
struct NaGradients {
  Tensor dq, dk, dv, drpb;
};

/// The relative positional bias shape [heads, 2k1-1(, 2k2-1..)] for `heads` and `geometry`.
Shape na_rpb_shape(int64_t heads, const NaGeometry& geometry);

/// Forward on the local query piece q and the k/v tile (same batch, heads and D as q). `rpb`
/// (nullptr: none) is added to the scaled logits. Throws InvalidArgument when a key some query
/// needs lies outside the tile. f32/f64/f16/bf16; computes in double.
NaForward na_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                     const NaGeometry& geometry, const NaPieces& pieces);

/// Backward of na_forward for the gradient `grad_output` of o and (nullptr: none) `grad_lse` of
/// lse. dk and dv cover the whole tile; rows no local query reads get zero.
NaGradients na_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                        const Tensor& grad_output, const Tensor* grad_lse,
                        const NaGeometry& geometry, const NaPieces& pieces);

}  // namespace tessera::ops
