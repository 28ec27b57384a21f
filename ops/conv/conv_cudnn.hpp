// cuDNN conv kernels for cuda operands: forward, backward data, backward filter and backward
// bias of a conv1d/2d/3d (zero padding the same on both sides of each dim, taken by cuDNN), in f32
// (no TF32 unless allowed), f64, f16 and bf16 (both accumulating in f32), channels-first or
// channels-last, with groups, stride and dilation. Operands may have any strides (a box of a larger
// buffer included), so the sharded conv runs the interior and the boundary slabs of a haloed piece
// without copies.
//
// Implemented by conv_cudnn.cpp on cuDNN 9's legacy convolution API (the bias gradient by
// conv_bias_cuda.cu), or by no_cudnn_conv.cpp (NotAvailable) when Tessera is built without
// cuDNN. Work is queued on the compute stream of the operands' device (compute_stream_for): the
// calls return before the GPU is done.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/device.hpp"
#include "core/tensor.hpp"
#include "ops/conv/conv_kernels.hpp"

namespace tessera::ops {

/// A device array as a cuDNN conv reads or writes it: an activation [N, C, spatial..] or
/// weights [Cout, Cin/g, k..], in that index order whatever the memory order; strides in
/// elements.
struct ConvOperand {
  void* data = nullptr;
  Shape shape;
  std::vector<int64_t> strides;
  DType dtype = DType::f32;
  Device device;
};

/// The operand of `tensor` (its first element, shape and strides; views included).
ConvOperand conv_operand(const Tensor& tensor);

/// True when the cuDNN path was compiled in.
bool conv_cudnn_available();

/// y = conv of x with w (+ bias[Cout]), written into y (which may be a box of a larger
/// output). x, y: any strides; w: packed [Cout, Cin/g, k..] or packed channels-last.
void conv_forward_cudnn(const ConvOperand& x, const ConvOperand& w, const ConvOperand* bias,
                        const ConvGeometry& geometry, const ConvOperand& y);
/// dx = adjoint of the forward conv in x, applied to dy (positions no output reads get 0).
void conv_backward_data_cudnn(const ConvOperand& dy, const ConvOperand& w,
                              const ConvGeometry& geometry, const ConvOperand& dx);
/// dw = adjoint of the forward conv in w, applied to dy.
void conv_backward_filter_cudnn(const ConvOperand& x, const ConvOperand& dy,
                                const ConvGeometry& geometry, const ConvOperand& dw);
/// db[Cout] = sum of dy over N and all spatial positions (overwriting db), by the project's
/// deterministic reduction (conv_bias_cuda.cu; cuDNN's takes no f16 or bf16), bit-identical run
/// to run.
void conv_backward_bias_cudnn(const ConvOperand& dy, const ConvOperand& db);

/// Number of (shape, direction, ...) keys whose algorithm (or graph-API engine) has been measured
/// and cached.
size_t conv_cudnn_cached_algorithms();
/// One line per cached key, sorted: the conv (describe) and the algorithm, math type and
/// workspace chosen for it (what bench conv reports beside its figures).
std::vector<std::string> conv_cudnn_algorithm_choices();

}  // namespace tessera::ops
