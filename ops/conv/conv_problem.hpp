// ConvProblem: one validated convolution (zero padding on each side allowed), in the form every
// conv backend consumes. Built only by the dispatcher in conv_shapes.cpp, so backends may assume it
// is valid.
#pragma once

#include <array>
#include <cstdint>

#include "core/box.hpp"
#include "core/dtype.hpp"

namespace tessera::ops {

/// Extents of one validated conv. The spatial arrays always hold (depth, height, width):
/// a conv1d or conv2d has its missing leading dims set to 1, so a backend may treat every conv
/// as a conv3d, while `spatial_dims` keeps the user's rank for shapes and messages.
struct ConvProblem {
  int spatial_dims = 3;  // 1, 2 or 3
  int64_t batch = 0;
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  int64_t groups = 1;
  std::array<int64_t, 3> input{1, 1, 1};
  std::array<int64_t, 3> kernel{1, 1, 1};
  std::array<int64_t, 3> output{1, 1, 1};
  std::array<int64_t, 3> stride{1, 1, 1};
  std::array<int64_t, 3> dilation{1, 1, 1};
  std::array<int64_t, 3> pad_lo{0, 0, 0};  // zero padding before each spatial dim
  std::array<int64_t, 3> pad_hi{0, 0, 0};  // and after it
  DType dtype = DType::f32;

  /// Input channels each group reads (Cin / groups).
  int64_t in_channels_per_group() const { return in_channels / groups; }
  /// Output channels each group writes (Cout / groups).
  int64_t out_channels_per_group() const { return out_channels / groups; }
  /// True when some spatial dim is padded.
  bool padded() const {
    for (int d = 0; d < 3; ++d)
      if (pad_lo[d] != 0 || pad_hi[d] != 0) return true;
    return false;
  }
  /// [N, Cin, S..] in the user's rank.
  Shape x_shape() const { return with_spatial({batch, in_channels}, input); }
  /// [Cout, Cin/groups, K..] in the user's rank.
  Shape w_shape() const { return with_spatial({out_channels, in_channels_per_group()}, kernel); }
  /// [N, Cout, O..] in the user's rank.
  Shape y_shape() const { return with_spatial({batch, out_channels}, output); }

 private:
  Shape with_spatial(Shape leading, const std::array<int64_t, 3>& extents) const {
    for (int d = 3 - spatial_dims; d < 3; ++d) leading.push_back(extents[d]);
    return leading;
  }
};

}  // namespace tessera::ops
