// Internal helpers shared by shard_tensor.cpp and redistribute.cpp.
#pragma once

#include <string>
#include <vector>

#include "core/device_mesh.hpp"
#include "core/layout.hpp"

namespace tessera::detail {

/// Collective: ShardSpec::make on every rank, with its error (or any disagreement about the
/// resulting layout or dtype between ranks) raised as the same AgreedError everywhere.
ShardSpec make_agreed_spec(const DeviceMesh& mesh, const std::string& op, const Shape& global_shape,
                           std::vector<Placement> placements,
                           std::vector<std::vector<int64_t>> extents, DType dtype);

/// False when a Partial(sum) placement makes the rank at `coord` hold zeros (only coordinate 0
/// of a Partial(sum) mesh dim holds the values when a full tensor becomes partial).
bool holds_partial_values(const ShardSpec& spec, const std::vector<int>& coord);

}  // namespace tessera::detail
