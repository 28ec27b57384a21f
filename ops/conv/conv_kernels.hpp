// Local (single-rank, unsharded) convolution kernels for conv1d/2d/3d: forward, backward data,
// backward weight and backward bias of a convolution with optional zero padding on each side, on
// cpu tensors (the reference or oneDNN) and on cuda tensors (cuDNN). The sharded conv op exchanges
// halos itself, then calls these on the haloed local piece with the zero padding its piece has at
// the global edges (so the padded cells are never written into memory where a backend takes the
// padding itself: oneDNN always, cuDNN when it is the same on both sides).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.hpp"

namespace tessera::ops {

/// Which implementation runs a conv: automatic (cpu tensors: oneDNN for f32 when compiled in,
/// else the reference; cuda tensors: cuDNN), the plain C++ reference (cpu, f32/f64), oneDNN (cpu,
/// f32 only) or cuDNN (cuda: f32, f64, f16, bf16). Asking for one that was not compiled in
/// throws NotAvailable.
enum class ConvBackend : uint8_t { automatic, reference, onednn, cudnn };

/// Stride, dilation (one entry per spatial dim: 1, 2 or 3 of them; empty means all 1), groups,
/// and the zero padding before and after each spatial dim (empty means none).
struct ConvGeometry {
  std::vector<int64_t> stride;    // per spatial dim, >= 1
  std::vector<int64_t> dilation;  // per spatial dim, >= 1
  int64_t groups = 1;
  std::vector<int64_t> pad_lo{};  // per spatial dim, >= 0
  std::vector<int64_t> pad_hi{};  // per spatial dim, >= 0
};

/// Output spatial extents of a conv: floor((S + lo + hi - d*(K-1) - 1)/s) + 1, or 0 when
/// S + lo + hi < d*(K-1)+1; returned as the full output shape [N, Cout, O..].
Shape conv_output_shape(const Shape& x_shape, const Shape& w_shape, const ConvGeometry& geometry);

/// y[N,Cout,O..] = conv of the zero-padded x[N,Cin,S..] with w[Cout,Cin/groups,K..]
/// (+ bias[Cout] if bias != nullptr).
Tensor conv_forward(const Tensor& x, const Tensor& w, const Tensor* bias,
                    const ConvGeometry& geometry, ConvBackend backend = ConvBackend::automatic);

/// Writes the conv of x with w (+ bias) into `y`, which may be a view (e.g. a box of a
/// larger output): on cuda in place with no copy (cuDNN reads and writes strided operands), on
/// cpu through a contiguous result copied into `y`.
void conv_forward_into(const Tensor& x, const Tensor& w, const Tensor* bias,
                       const ConvGeometry& geometry, Tensor& y,
                       ConvBackend backend = ConvBackend::automatic);

/// dx with shape x_shape from dy (positions no output reads get 0).
Tensor conv_backward_data(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                          const ConvGeometry& geometry,
                          ConvBackend backend = ConvBackend::automatic);

/// dw with shape w_shape from x and dy.
Tensor conv_backward_weight(const Tensor& x, const Tensor& dy, const Shape& w_shape,
                            const ConvGeometry& geometry,
                            ConvBackend backend = ConvBackend::automatic);

/// db[Cout] = sum of dy over N and all spatial positions.
Tensor conv_backward_bias(const Tensor& dy);

/// True when the oneDNN path was compiled in.
bool conv_onednn_available();

/// Whether f32 convs on cuda may use TF32 tensor cores (about 10 mantissa bits per product).
/// Off unless TESSERA_ALLOW_TF32=1 at start-up or set_conv_allow_tf32(true).
bool conv_allow_tf32();
/// Allows or forbids TF32 in f32 cuda convs from now on (algorithms are cached per setting).
void set_conv_allow_tf32(bool allow);

}  // namespace tessera::ops
