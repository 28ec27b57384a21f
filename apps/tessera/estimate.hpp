// `tessera estimate` (apps/tessera/estimate.cpp): what estimate mode reuses.
#pragma once

#include <string>

#include "core/cost/cost_model.hpp"

namespace tessera::cli {

/// The machine named by --cluster: a file path (with a '/' or ending in .json) or a shipped
/// cluster's name ($TESSERA_CLUSTERS, <prefix>/share/tessera/clusters, the source tree's
/// share/clusters); InvalidArgument("estimate", ...) listing the known ones when unknown.
cost::Machine load_machine(const std::string& cluster);

}  // namespace tessera::cli
