// Stub for builds without oneDNN.
#include "ops/dnnl/dnnl_support.hpp"

namespace tessera {

std::string dnnl_version() {
  return "";
}

}  // namespace tessera
