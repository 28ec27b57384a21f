// The sharded convolution ops: conv1d/2d/3d (options, padding resolution, the user call) and the
// transposed convolution conv_transpose1d/2d/3d (options, the geometry of a rank's piece, the
// user call).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Options of a convolution, per spatial dim (a single value applies to every dim).
struct ConvOptions {
  std::vector<int64_t> stride{1};
  std::vector<int64_t> dilation{1};
  /// Explicit per-dim padding on the low side (and the high side unless `padding_hi` is given);
  /// ignored when `padding_name` is "same" or "valid".
  std::vector<int64_t> padding{0};
  /// Explicit per-dim padding on the high side (empty: the same as `padding`).
  std::vector<int64_t> padding_hi;
  /// "" (use `padding`), "same" (stride 1: output extent = input extent) or "valid" (none).
  std::string padding_name;
  int64_t groups = 1;
  /// "zeros" or "circular".
  std::string padding_mode = "zeros";
};

/// Collective: y = conv(x, w) (+ b) for x [N, C, spatial..] sharded on any spatial dims (and
/// optionally the batch dim), w [Cout, C/groups, k..] and b [Cout] replicated. Output element o
/// along a dim is owned by the rank owning input index clamp(o*stride, 0, L_in-1); user padding
/// applies only at global edges (circular wraps through the halo).
ShardTensor conv(const ShardTensor& x, const ShardTensor& w, const std::optional<ShardTensor>& b,
                 const ConvOptions& options = {});

/// Options of a transposed convolution, per spatial dim (a single value applies to every dim);
/// torch.nn.functional.conv_transpose{1,2,3}d's arguments.
struct ConvTransposeOptions {
  std::vector<int64_t> stride{1};
  std::vector<int64_t> padding{0};
  std::vector<int64_t> output_padding{0};
  std::vector<int64_t> dilation{1};
  int64_t groups = 1;
};

/// Output extent of a transposed conv along one dim: (L-1)*s - 2p + d*(k-1) + output_padding + 1.
int64_t conv_transpose_extent(int64_t length, int64_t kernel, int64_t stride, int64_t padding,
                              int64_t dilation, int64_t output_padding);

/// One spatial dim of the piece of a transposed conv that computes outputs [out_lo, out_hi):
/// the inputs [in_lo, in_hi) it reads and the conv whose data gradient it is. That conv maps an
/// input of out_hi - out_lo cells (the outputs) padded by pad_lo before and pad_hi after to
/// in_hi - in_lo cells (the inputs), with the op's stride and dilation. A negative pad is a crop:
/// that many outputs at that end are reached by no input (they get 0, or the bias).
struct ConvTransposeSpan {
  int64_t in_lo = 0, in_hi = 0;    // inputs read, within [0, length)
  int64_t pad_lo = 0, pad_hi = 0;  // the conv's padding of the outputs (may be negative)
};

/// The span of outputs [out_lo, out_hi) of a transposed conv of an input of `length` cells:
/// inputs i with i*s - p + j*d in [out_lo, out_hi) for a tap j < kernel, i.e. i from
/// ceil((out_lo + p - d*(k-1)) / s) to floor((out_hi - 1 + p) / s), clipped to [0, length).
ConvTransposeSpan conv_transpose_span(int64_t length, int64_t kernel, int64_t stride,
                                      int64_t padding, int64_t dilation, int64_t out_lo,
                                      int64_t out_hi);

/// Collective: y = conv_transpose(x, w) (+ b) for x [N, Cin, spatial..] sharded on any spatial
/// dims (and optionally the batch dim), w [Cin, Cout/groups, k..] and b [Cout] replicated;
/// PyTorch's semantics. y's spatial dims are sharded like x's: output o along a dim is owned by
/// the rank owning input clamp(floor((o + p) / s), 0, L_in - 1).
ShardTensor conv_transpose(const ShardTensor& x, const ShardTensor& w,
                           const std::optional<ShardTensor>& b,
                           const ConvTransposeOptions& options = {});

}  // namespace tessera::ops
