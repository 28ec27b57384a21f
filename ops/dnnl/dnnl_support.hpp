// What the oneDNN CPU kernels report about themselves.
#pragma once

#include <string>

namespace tessera {

/// oneDNN version as "2.6.3", or "" when Tessera was built without oneDNN.
std::string dnnl_version();

}  // namespace tessera
