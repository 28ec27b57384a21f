// Stub for builds without HDF5.
#include "io/hdf5/hdf5_support.hpp"

namespace tessera::io {

std::string hdf5_version() {
  return "";
}
bool hdf5_is_parallel() {
  return false;
}

}  // namespace tessera::io
