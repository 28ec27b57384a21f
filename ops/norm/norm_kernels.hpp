// The local kernels of the normalizations on one contiguous piece laid out by a NormGeometry,
// for cpu (norm_cpu.cpp: threads over fixed chunks of planes, so results never depend on the
// thread count) and cuda (norm_cuda.cpp launching norm_cuda.cu; a build without CUDA gets
// no_norm_cuda.cpp, whose functions throw NotAvailable). Statistics are f64 tensors on the
// piece's device:
//   moments     [slots, 3]: count, mean, M2 (sum of squared deviations) of the local elements
//   statistics  [slots, 4]: mean, rstd = 1/sqrt(biased var + eps), count, M2 of every rank's
//   sums        [slots, 2]: sum of dxhat and of dxhat * xhat (dxhat = dy * w)
// Elements are f32, f64, f16 or bf16 (f16/bf16 elementwise in float); every accumulation is in
// f64. The cuda functions queue on `stream` and never synchronize.
#pragma once

#include <optional>

#include "core/runtime/rank_context.hpp"
#include "core/tensor.hpp"
#include "ops/norm/norm_geometry.hpp"

namespace tessera::ops {

/// Gradients of the affine parameters on one piece: [channels] (per-plane affine) or [length]
/// (layer_norm), in x's dtype; empty when not asked for.
struct NormParamGrads {
  std::optional<Tensor> dw, db;
};

/// The moments [slots, 3] of the local piece x (two passes per chunk, chunks combined by Chan's
/// formula in plane order).
Tensor norm_moments_cpu(const kernels::NormGeometry& g, const Tensor& x);
/// The statistics [slots, 4] from every rank's moments `gathered` [ranks, slots, 3], combined by
/// Chan's formula in rank order.
Tensor norm_statistics_cpu(const Tensor& gathered, double eps);
/// The statistics [C, 4] of batch_norm's eval mode from the running mean and variance.
Tensor norm_running_statistics_cpu(const Tensor& running_mean, const Tensor& running_var,
                                   double eps);
/// batch_norm's running statistics after a training step: (1 - momentum) * old + momentum *
/// (batch mean, unbiased batch variance); in the dtype of the old ones.
std::pair<Tensor, Tensor> norm_update_running_cpu(const Tensor& statistics,
                                                  const Tensor& running_mean,
                                                  const Tensor& running_var, double momentum);
/// y = (x - mean) * rstd * w + b (w, b optional).
Tensor norm_forward_cpu(const kernels::NormGeometry& g, const Tensor& x, const Tensor& statistics,
                        const std::optional<Tensor>& w, const std::optional<Tensor>& b);
/// The local sums [slots, 2] of the backward, and dw, db when asked for.
Tensor norm_backward_sums_cpu(const kernels::NormGeometry& g, const Tensor& x, const Tensor& dy,
                              const Tensor& statistics, const std::optional<Tensor>& w,
                              bool want_dw, bool want_db, NormParamGrads& grads);
/// layer_norm's backward when no other rank holds part of a row (nothing to combine): the sums,
/// dw and db and dx of each block of rows in one pass while the rows are in cache, with the
/// arithmetic of norm_backward_sums_cpu then norm_backward_dx_cpu. Returns dx (and sets dw, db
/// when asked for); nullopt when the piece is not rows of at most 8192 elements (then the caller
/// takes those two).
std::optional<Tensor> norm_backward_rows_cpu(const kernels::NormGeometry& g, const Tensor& x,
                                             const Tensor& dy, const Tensor& statistics,
                                             const std::optional<Tensor>& w, bool want_dw,
                                             bool want_db, NormParamGrads& grads);
/// Element-wise sum in rank order of `gathered` [ranks, slots, 2].
Tensor norm_sum_ranks_cpu(const Tensor& gathered);
/// dx = rstd * (dxhat - sum(dxhat) / count - xhat * sum(dxhat * xhat) / count) with the global
/// `sums` [slots, 2]; without sums (batch_norm eval: constant statistics) dx = rstd * dxhat.
Tensor norm_backward_dx_cpu(const kernels::NormGeometry& g, const Tensor& x, const Tensor& dy,
                            const Tensor& statistics, const std::optional<Tensor>& sums,
                            const std::optional<Tensor>& w);

/// The cuda counterparts of the functions above (same operands, queued on the stream):
/// norm_moments_cpu.
Tensor norm_moments_cuda(const kernels::NormGeometry& g, const Tensor& x, const Stream& stream);
/// norm_statistics_cpu on the device.
Tensor norm_statistics_cuda(const Tensor& gathered, double eps, const Stream& stream);
/// norm_running_statistics_cpu on the device.
Tensor norm_running_statistics_cuda(const Tensor& running_mean, const Tensor& running_var,
                                    double eps, const Stream& stream);
/// norm_update_running_cpu on the device.
std::pair<Tensor, Tensor> norm_update_running_cuda(const Tensor& statistics,
                                                   const Tensor& running_mean,
                                                   const Tensor& running_var, double momentum,
                                                   const Stream& stream);
/// norm_forward_cpu on the device.
Tensor norm_forward_cuda(const kernels::NormGeometry& g, const Tensor& x, const Tensor& statistics,
                         const std::optional<Tensor>& w, const std::optional<Tensor>& b,
                         const Stream& stream);
/// norm_backward_sums_cpu on the device.
Tensor norm_backward_sums_cuda(const kernels::NormGeometry& g, const Tensor& x, const Tensor& dy,
                               const Tensor& statistics, const std::optional<Tensor>& w,
                               bool want_dw, bool want_db, NormParamGrads& grads,
                               const Stream& stream);
/// norm_sum_ranks_cpu on the device.
Tensor norm_sum_ranks_cuda(const Tensor& gathered, const Stream& stream);
/// norm_backward_dx_cpu on the device.
Tensor norm_backward_dx_cuda(const kernels::NormGeometry& g, const Tensor& x, const Tensor& dy,
                             const Tensor& statistics, const std::optional<Tensor>& sums,
                             const std::optional<Tensor>& w, const Stream& stream);

}  // namespace tessera::ops
