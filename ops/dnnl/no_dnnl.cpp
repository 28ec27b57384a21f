// Stub for builds without oneDNN.
#include "ops/dnnl/dnnl_support.hpp"

namespace tessera {

std::string dnnl_version() {
  return "";
}

bool dnnl_sgemm_row_major(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t, int) {
  return false;
}

}  // namespace tessera
