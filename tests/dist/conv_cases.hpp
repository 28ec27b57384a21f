// Random sharded-conv cases (geometry, padding, groups, bias, placements and extents) shared
// by the cpu sweep (conv_sharded_test.cpp) and the cuda one (tests/gpu/conv_cudnn_gpu_test.cpp).
#pragma once

#include <algorithm>
#include <vector>

#include "core/tessera.hpp"
#include "ops/ops.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera::testing {

/// One conv: shapes, options, and how x is sharded over a mesh.
struct ConvCase {
  Shape x_shape, w_shape;
  bool bias;
  ops::ConvOptions options;
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
};

/// A random conv on a mesh of `mesh_shape`: conv1d/2d/3d, kernels 1..5, stride, dilation,
/// explicit/same padding, zeros/circular, groups, bias; uneven, empty and thin shards.
inline ConvCase random_conv_case(const std::vector<int>& mesh_shape, CaseRng& rng) {
  ConvCase c;
  const int spatial = static_cast<int>(rng.uniform(1, 3));
  const int64_t groups = rng.uniform(1, 2);
  c.x_shape = {rng.uniform(1, 2), groups * rng.uniform(1, 2)};
  c.w_shape = {groups * rng.uniform(1, 2), c.x_shape[1] / groups};
  c.options.groups = groups;
  c.options.padding_mode = rng.chance(0.3) ? "circular" : "zeros";
  c.options.stride.clear();
  c.options.dilation.clear();
  c.options.padding.clear();
  const bool same = rng.chance(0.2);
  for (int i = 0; i < spatial; ++i) {
    const int64_t kernel = rng.uniform(1, spatial == 3 ? 3 : 5);
    const int64_t dilation = rng.uniform(1, 3);
    const int64_t stride = same ? 1 : rng.uniform(1, 3);
    const int64_t span = dilation * (kernel - 1) + 1;
    int64_t padding = rng.uniform(0, 3);
    const int64_t max_length = spatial == 3 ? 7 : 12;
    // Long enough for the dilated kernel (and for circular padding to wrap at most once).
    const int64_t length =
        std::max<int64_t>({rng.uniform(1, max_length), span - 2 * padding, padding, 1});
    if (span > length + 2 * padding) padding = (span - length + 1) / 2;
    c.x_shape.push_back(length);
    c.w_shape.push_back(kernel);
    c.options.stride.push_back(stride);
    c.options.dilation.push_back(dilation);
    c.options.padding.push_back(padding);
  }
  if (same) c.options.padding_name = "same";
  if (c.options.padding_mode == "circular") {  // same padding may exceed the extent: widen x
    for (int i = 0; i < spatial; ++i) {
      const int64_t total =
          same ? c.options.dilation[i] * (c.w_shape[2 + i] - 1) : 2 * c.options.padding[i];
      c.x_shape[2 + i] = std::max(c.x_shape[2 + i], (total + 1) / 2 + 1);
    }
  }
  c.bias = rng.chance(0.5);
  // Mesh dims shard distinct spatial dims or the batch dim, or replicate.
  std::vector<bool> used(c.x_shape.size(), false);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    const int dim = rng.chance(0.2) ? 0 : static_cast<int>(rng.uniform(2, 1 + spatial));
    if (used[dim] || rng.chance(0.15)) {
      c.placements.push_back(Placement::replicate());
      c.extents.emplace_back();
      continue;
    }
    used[dim] = true;
    c.placements.push_back(Placement::shard(dim));
    c.extents.push_back(rng.chance(0.3)
                            ? default_split(c.x_shape[dim], mesh_shape[m])
                            : testing::random_extents(c.x_shape[dim], mesh_shape[m], rng));
  }
  return c;
}

}  // namespace tessera::testing
