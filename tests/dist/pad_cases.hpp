// Random sharded-pad cases (shape, attributes, placements and extents) shared by the cpu sweep
// (pad_sharded_test.cpp) and the cuda one (tests/gpu/pad_gpu_test.cpp).
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

/// One padding: the shape of x, options and how x is sharded over a mesh.
struct PadCase {
  Shape x_shape;
  ops::PadOptions options;
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;

  std::string str() const {
    std::vector<std::string> names;
    for (const Placement& placement : placements) names.push_back(placement.str());
    return fmt::format("pad x {} pad {} mode {} value {} placements [{}] extents {}", x_shape,
                       options.pad, options.mode, options.value, fmt::join(names, ", "), extents);
  }
};

/// pad of x with the case's options.
inline ShardTensor pad(const PadCase& c, const ShardTensor& x) {
  return ops::pad(x, c.options);
}

/// A random padding on a mesh of `mesh_shape`: every mode, 1..3 padded dims (constant: of a 1-d
/// to 4-d input; the others: of an input with one or two more dims, as PyTorch), pads from 0 to
/// the mode's limit and now and then negative ones (crops); mesh dims shard any dims with uneven,
/// empty and thin shards, or replicate.
inline PadCase random_pad_case(const std::vector<int>& mesh_shape, CaseRng& rng) {
  PadCase c;
  const char* modes[] = {"constant", "reflect", "replicate", "circular"};
  c.options.mode = modes[rng.uniform(0, 3)];
  const bool constant = c.options.mode == "constant";
  const int count = static_cast<int>(rng.uniform(1, 3));
  const int rank = constant ? static_cast<int>(rng.uniform(count, 4))
                            : count + static_cast<int>(rng.uniform(1, 2));
  for (int d = 0; d < rank; ++d)
    c.x_shape.push_back(d < rank - count ? rng.uniform(1, 3) : rng.uniform(1, count == 3 ? 5 : 9));
  for (int pair = 0; pair < count; ++pair) {
    const int64_t length = c.x_shape[rank - 1 - pair];
    const int64_t most = c.options.mode == "reflect"    ? length - 1
                         : c.options.mode == "circular" ? length
                                                        : 4;
    int64_t lo = rng.uniform(0, std::min<int64_t>(most, 4));
    int64_t hi = rng.uniform(0, std::min<int64_t>(most, 4));
    // A crop now and then: negative values, leaving the dim at least one cell (constant and
    // circular: possibly none); circular crops a dim on both sides or pads it on both.
    if (rng.chance(0.3)) {
      const bool circular = c.options.mode == "circular";
      const int64_t least = c.options.mode == "reflect" || c.options.mode == "replicate" ? 1 : 0;
      if (rng.chance(0.5)) lo = -rng.uniform(0, length - least);
      const int64_t room = length + std::min<int64_t>(lo, 0) - least;  // what hi may still crop
      if (rng.chance(0.7) && (!circular || lo <= 0))
        hi = -rng.uniform(0, room);
      else if (circular && lo < 0)
        hi = 0;
    }
    c.options.pad.push_back(lo);
    c.options.pad.push_back(hi);
  }
  if (constant && rng.chance(0.5)) c.options.value = static_cast<double>(rng.uniform(-8, 8)) / 4;
  std::vector<bool> used(c.x_shape.size(), false);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    const int dim = rng.chance(0.25) ? static_cast<int>(rng.uniform(0, rank - 1))
                                     : static_cast<int>(rng.uniform(rank - count, rank - 1));
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

}  // namespace tessera::testing
