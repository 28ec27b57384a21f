// The sharded op interpolate (1/2/3-d by the rank of x): options and the user call, with the
// semantics of torch.nn.functional.interpolate for the modes nearest, nearest-exact, linear,
// bilinear and trilinear.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Options of an interpolation (exactly one of size and scale_factor; a single value applies to
/// every spatial dim).
struct InterpolateOptions {
  /// Output spatial extents.
  std::vector<int64_t> size{};
  /// Output extent floor(input * scale_factor); the kernels use 1/scale_factor as the source step
  /// unless recompute_scale_factor.
  std::vector<double> scale_factor{};
  /// nearest | nearest-exact | linear (1-d) | bilinear (2-d) | trilinear (3-d).
  std::string mode = "nearest";
  /// Linear modes only (unset: false): corner cells of input and output are aligned.
  std::optional<bool> align_corners{};
  /// With scale_factor: the source step is input / output extent instead of 1/scale_factor.
  bool recompute_scale_factor = false;
};

/// Collective: interpolate x [N, C, spatial..] sharded on any dims. Output o along a spatial dim
/// is owned by the rank owning its (first) source cell; sources across shard borders come from
/// the halo.
ShardTensor interpolate(const ShardTensor& x, const InterpolateOptions& options);

}  // namespace tessera::ops
