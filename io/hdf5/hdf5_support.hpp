// What the HDF5 layer reports about itself.
#pragma once

#include <string>

namespace tessera::io {

/// HDF5 library version as "1.10.8", or "" when Tessera was built without HDF5.
std::string hdf5_version();
/// True when the HDF5 library was built with MPI-IO (parallel HDF5).
bool hdf5_is_parallel();

}  // namespace tessera::io
