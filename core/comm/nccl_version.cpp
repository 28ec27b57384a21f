// NCCL version query.
#include <fmt/format.h>
#include <nccl.h>

#include "core/comm/nccl_support.hpp"

namespace tessera {

std::string nccl_version() {
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return "unknown";
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return fmt::format("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100);
}

}  // namespace tessera
