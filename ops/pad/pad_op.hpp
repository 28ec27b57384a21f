// The sharded op pad: options and the user call, with the semantics of
// torch.nn.functional.pad (modes constant, reflect, replicate, circular).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// Options of a padding.
struct PadOptions {
  /// (lo, hi) pairs in PyTorch's order: last dim first; constant mode pads up to every dim, the
  /// other modes at most three. Negative values crop.
  std::vector<int64_t> pad{};
  /// constant | reflect | replicate | circular.
  std::string mode = "constant";
  /// The value of constant padding cells.
  double value = 0.0;
};

/// Collective: pad x sharded on any dims. The output keeps x's placements; the cells added
/// before (after) a sharded dim go to the rank owning its first (last) cell. reflect, replicate
/// and circular read across shard borders through the halo.
ShardTensor pad(const ShardTensor& x, const PadOptions& options);

}  // namespace tessera::ops
