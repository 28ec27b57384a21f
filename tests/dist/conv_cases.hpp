// Random sharded-conv and transposed-conv cases (geometry, padding, groups, bias, placements and
// extents) shared by the cpu sweeps (conv_sharded_test.cpp, conv_transpose_sharded_test.cpp) and
// the cuda one (tests/gpu/conv_cudnn_gpu_test.cpp).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
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

/// Random placements of x [N, C, spatial..] on a mesh of `mesh_shape`: each mesh dim shards a
/// distinct spatial dim or the batch dim, or replicates; default, uneven, empty and thin extents.
inline void random_conv_layout(const Shape& x_shape, int spatial,
                               const std::vector<int>& mesh_shape, CaseRng& rng,
                               std::vector<Placement>& placements,
                               std::vector<std::vector<int64_t>>& extents) {
  std::vector<bool> used(x_shape.size(), false);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    const int dim = rng.chance(0.2) ? 0 : static_cast<int>(rng.uniform(2, 1 + spatial));
    if (used[dim] || rng.chance(0.15)) {
      placements.push_back(Placement::replicate());
      extents.emplace_back();
      continue;
    }
    used[dim] = true;
    placements.push_back(Placement::shard(dim));
    extents.push_back(rng.chance(0.3) ? default_split(x_shape[dim], mesh_shape[m])
                                      : testing::random_extents(x_shape[dim], mesh_shape[m], rng));
  }
}

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
  random_conv_layout(c.x_shape, spatial, mesh_shape, rng, c.placements, c.extents);
  return c;
}

}  // namespace tessera::testing

namespace tessera::testing {

/// One transposed conv: shapes, options, and how x is sharded over a mesh.
struct ConvTransposeCase {
  Shape x_shape, w_shape;
  bool bias;
  ops::ConvTransposeOptions options;
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;

  std::string str() const {
    return fmt::format(
        "x {} w {} bias {} stride {} padding {} output_padding {} dilation {} groups {} "
        "placements {} extents {}",
        x_shape, w_shape, bias, options.stride, options.padding, options.output_padding,
        options.dilation, options.groups, placements.size(), extents);
  }
};

/// A random transposed conv on a mesh of `mesh_shape`: 1/2/3-d, kernels 1..4, stride 1..3 (also
/// above the kernel), padding, output_padding below max(stride, dilation), dilation, groups,
/// bias; uneven, empty and thin shards (the layout as random_conv_case's).
inline ConvTransposeCase random_conv_transpose_case(const std::vector<int>& mesh_shape,
                                                    CaseRng& rng) {
  ConvTransposeCase c;
  const int spatial = static_cast<int>(rng.uniform(1, 3));
  const int64_t groups = rng.uniform(1, 2);
  c.x_shape = {rng.uniform(1, 2), groups * rng.uniform(1, 2)};
  c.w_shape = {c.x_shape[1], rng.uniform(1, 2)};
  c.options.groups = groups;
  c.options.stride.clear();
  c.options.padding.clear();
  c.options.output_padding.clear();
  c.options.dilation.clear();
  for (int i = 0; i < spatial; ++i) {
    const int64_t kernel = rng.uniform(1, spatial == 3 ? 3 : 4);
    const int64_t stride = rng.uniform(1, 3);
    const int64_t dilation = rng.uniform(1, 2);
    const int64_t length = rng.uniform(1, spatial == 3 ? 5 : 9);
    const int64_t output_padding = rng.uniform(0, std::max(stride, dilation) - 1);
    // Padding up to what still leaves an output: (L-1)s + d(k-1) + op + 1 - 2p >= 1.
    const int64_t room = (length - 1) * stride + dilation * (kernel - 1) + output_padding;
    const int64_t padding = rng.uniform(0, std::min<int64_t>(3, room / 2));
    c.x_shape.push_back(length);
    c.w_shape.push_back(kernel);
    c.options.stride.push_back(stride);
    c.options.padding.push_back(padding);
    c.options.output_padding.push_back(output_padding);
    c.options.dilation.push_back(dilation);
  }
  c.bias = rng.chance(0.5);
  random_conv_layout(c.x_shape, spatial, mesh_shape, rng, c.placements, c.extents);
  return c;
}

}  // namespace tessera::testing
