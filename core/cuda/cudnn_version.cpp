// cuDNN version query.
#include <cudnn.h>
#include <fmt/format.h>

#include "core/gpu_runtime.hpp"

namespace tessera::gpu {

std::string cudnn_version() {
  const size_t code = cudnnGetVersion();  // major*10000 + minor*100 + patch (cuDNN 9)
  return fmt::format("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100);
}

}  // namespace tessera::gpu
