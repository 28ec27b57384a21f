// Random sharded-pooling cases (op, geometry, attributes, placements and extents) shared by the
// cpu sweep (pool_sharded_test.cpp) and the cuda one (tests/gpu/pool_gpu_test.cpp).
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

/// One pooling: the op, the shape of x, options and how x is sharded over a mesh.
struct PoolCase {
  bool max = true;
  Shape x_shape;
  ops::PoolOptions options;
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;

  std::string str() const {
    std::vector<std::string> names;
    for (const Placement& placement : placements) names.push_back(placement.str());
    return fmt::format(
        "{} x {} kernel {} stride {} padding {} dilation {} ceil {} include_pad {} divisor {} "
        "placements [{}] extents {}",
        max ? "max_pool" : "avg_pool", x_shape, options.kernel_size, options.stride,
        options.padding, options.dilation, options.ceil_mode, options.count_include_pad,
        options.divisor_override, fmt::join(names, ", "), extents);
  }
};

/// max_pool or avg_pool of x with the case's options.
inline ShardTensor pool(const PoolCase& c, const ShardTensor& x) {
  return c.max ? ops::max_pool(x, c.options) : ops::avg_pool(x, c.options);
}

/// A random pooling on a mesh of `mesh_shape`: max_pool or avg_pool, 1/2/3-d, kernels 1..4,
/// strides below, equal to and above the kernel (or the default), padding up to half the kernel,
/// dilation (max), ceil_mode, count_include_pad, divisor_override (avg); mesh dims shard spatial,
/// batch or channel dims with uneven, empty and thin shards, or replicate.
inline PoolCase random_pool_case(const std::vector<int>& mesh_shape, CaseRng& rng) {
  PoolCase c;
  c.max = rng.chance(0.5);
  const int spatial = static_cast<int>(rng.uniform(1, 3));
  c.x_shape = {rng.uniform(1, 2), rng.uniform(1, 3)};
  c.options.kernel_size.clear();
  c.options.padding.clear();
  c.options.dilation.clear();
  const bool default_stride = rng.chance(0.25);
  for (int i = 0; i < spatial; ++i) {
    const int64_t kernel = rng.uniform(1, spatial == 3 ? 3 : 4);
    const int64_t stride = rng.uniform(1, spatial == 3 ? 3 : 4);
    const int64_t padding = rng.uniform(0, kernel / 2);
    const int64_t dilation = c.max ? rng.uniform(1, 3) : 1;
    const int64_t span = dilation * (kernel - 1) + 1;
    const int64_t length =
        std::max<int64_t>({rng.uniform(1, spatial == 3 ? 7 : 13), span - 2 * padding, 1});
    c.x_shape.push_back(length);
    c.options.kernel_size.push_back(kernel);
    if (!default_stride) c.options.stride.push_back(stride);
    c.options.padding.push_back(padding);
    c.options.dilation.push_back(dilation);
  }
  c.options.ceil_mode = rng.chance(0.5);
  c.options.count_include_pad = rng.chance(0.5);
  if (!c.max && rng.chance(0.2)) c.options.divisor_override = rng.uniform(1, 7);
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

/// Random values: small integers (many tied maxima) or distinct multiples of 1/64.
inline Tensor random_input(const Shape& shape, CaseRng& rng) {
  if (rng.chance(0.5)) return integer_tensor(shape, DType::f64, rng, -3, 3);
  Tensor x = integer_tensor(shape, DType::f64, rng, -200, 200);
  double* data = x.data<double>();
  for (int64_t i = 0; i < x.numel(); ++i) data[i] /= 64.0;
  return x;
}

}  // namespace tessera::testing
