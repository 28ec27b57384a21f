// `tessera estimate` (apps/tessera/estimate.cpp): what estimate mode reuses.
#pragma once

#include <string>
#include <vector>

#include "core/cost/cost_model.hpp"
#include "core/estimate/record.hpp"

namespace tessera::cli {

/// The machine named by --cluster: a file path (with a '/' or ending in .json) or a shipped
/// cluster's name ($TESSERA_CLUSTERS, <prefix>/share/tessera/clusters, the source tree's
/// share/clusters); InvalidArgument("estimate", ...) listing the known ones when unknown.
cost::Machine load_machine(const std::string& cluster);

/// Runs tessera `command` (its name and arguments, e.g. {"simulate", "gray-scott", ...}) in
/// estimate mode on `ranks` simulated ranks (apps/tessera/estimate_record.cpp): every launch it
/// makes is recorded, nothing is allocated, read or written. Errors are tagged `op`.
estimate::Recording record_command(int ranks, const std::vector<std::string>& command,
                                   const std::string& op);

}  // namespace tessera::cli
