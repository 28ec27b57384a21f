// What the NCCL backend reports about itself (the backend proper arrives with the GPU path).
#pragma once

#include <string>

namespace tessera {

/// NCCL version as "2.28.3", or "" when Tessera was built without NCCL.
std::string nccl_version();

}  // namespace tessera
