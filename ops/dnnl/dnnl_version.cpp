// oneDNN version query.
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.h>

#include "ops/dnnl/dnnl_support.hpp"

namespace tessera {

std::string dnnl_version() {
  const dnnl_version_t* version = ::dnnl_version();
  return fmt::format("{}.{}.{}", version->major, version->minor, version->patch);
}

}  // namespace tessera
