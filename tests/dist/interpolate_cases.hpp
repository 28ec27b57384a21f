// Random sharded-interpolate cases (geometry, attributes, placements and extents) shared by the
// cpu sweep (interpolate_sharded_test.cpp) and the cuda one (tests/gpu/interpolate_gpu_test.cpp).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/tessera.hpp"
#include "ops/ops.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera::testing {

/// One interpolation: the shape of x, options and how x is sharded over a mesh.
struct InterpolateCase {
  Shape x_shape;
  ops::InterpolateOptions options;
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;

  std::string str() const {
    std::vector<std::string> names;
    for (const Placement& placement : placements) names.push_back(placement.str());
    return fmt::format(
        "interpolate x {} mode {} size {} scale_factor {} align_corners {} recompute {} "
        "placements [{}] extents {}",
        x_shape, options.mode, options.size, options.scale_factor,
        options.align_corners ? (*options.align_corners ? "1" : "0") : "unset",
        options.recompute_scale_factor, fmt::join(names, ", "), extents);
  }
};

/// interpolate of x with the case's options.
inline ShardTensor interpolate(const InterpolateCase& c, const ShardTensor& x) {
  return ops::interpolate(x, c.options);
}

/// The linear mode of a `spatial`-d input.
inline std::string linear_mode(int spatial) {
  return spatial == 1 ? "linear" : spatial == 2 ? "bilinear" : "trilinear";
}

/// A random interpolation on a mesh of `mesh_shape`: 1/2/3-d, every mode, size (one value or per
/// dim) or scale_factor (integer and not, up- and downsampling, recomputed or not), align_corners
/// unset, 0 or 1 for the linear modes; mesh dims shard spatial, batch or channel dims with uneven,
/// empty and thin shards, or replicate.
inline InterpolateCase random_interpolate_case(const std::vector<int>& mesh_shape, CaseRng& rng) {
  InterpolateCase c;
  const int spatial = static_cast<int>(rng.uniform(1, 3));
  c.x_shape = {rng.uniform(1, 2), rng.uniform(1, 3)};
  for (int i = 0; i < spatial; ++i) c.x_shape.push_back(rng.uniform(1, spatial == 3 ? 6 : 12));
  const int mode = static_cast<int>(rng.uniform(0, 2));
  c.options.mode = mode == 0 ? "nearest" : mode == 1 ? "nearest-exact" : linear_mode(spatial);
  if (mode == 2) {
    const int64_t corners = rng.uniform(0, 2);
    if (corners < 2) c.options.align_corners = corners == 1;
  }
  const double factors[] = {0.3, 0.5, 0.6, 0.75, 1.0, 1.3, 1.5, 1.7, 2.0, 2.5, 3.0};
  if (rng.chance(0.5)) {
    const int64_t most = spatial == 3 ? 9 : 20;
    if (rng.chance(0.2)) {
      c.options.size = {rng.uniform(1, most)};
    } else {
      for (int i = 0; i < spatial; ++i) c.options.size.push_back(rng.uniform(1, most));
    }
  } else {
    for (int i = 0; i < spatial; ++i) {
      // At least one output cell.
      double factor = factors[rng.uniform(0, 10)];
      while (std::floor(static_cast<double>(c.x_shape[2 + i]) * factor) < 1.0) factor *= 2.0;
      c.options.scale_factor.push_back(factor);
    }
    c.options.recompute_scale_factor = rng.chance(0.3);
  }
  // Mesh dims shard distinct dims (spatial mostly, batch or channel sometimes) or replicate.
  std::vector<bool> used(c.x_shape.size(), false);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    const int dim = rng.chance(0.25) ? static_cast<int>(rng.uniform(0, 1))
                                     : static_cast<int>(rng.uniform(2, 1 + spatial));
    if (used[dim] || rng.chance(0.1)) {
      c.placements.push_back(Placement::replicate());
      c.extents.emplace_back();
      continue;
    }
    used[dim] = true;
    c.placements.push_back(Placement::shard(dim));
    c.extents.push_back(rng.chance(0.3) ? default_split(c.x_shape[dim], mesh_shape[m])
                                        : random_extents(c.x_shape[dim], mesh_shape[m], rng));
  }
  return c;
}

/// Random values: distinct-ish multiples of 1/64 in [-3, 3].
inline Tensor random_interpolate_input(const Shape& shape, CaseRng& rng) {
  Tensor x = integer_tensor(shape, DType::f64, rng, -200, 200);
  double* data = x.data<double>();
  for (int64_t i = 0; i < x.numel(); ++i) data[i] /= 64.0;
  return x;
}

}  // namespace tessera::testing
