// Stub for CUDA builds without cuDNN.
#include "core/gpu_runtime.hpp"

namespace tessera::gpu {

std::string cudnn_version() {
  return "";
}

}  // namespace tessera::gpu
