// Stub for builds without NCCL.
#include "core/comm/nccl_support.hpp"

namespace tessera {

std::string nccl_version() {
  return "";
}

}  // namespace tessera
