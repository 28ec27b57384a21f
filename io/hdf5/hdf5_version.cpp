// HDF5 version query.
#include <fmt/format.h>
#include <hdf5.h>

#include "core/config.hpp"
#include "io/hdf5/hdf5_support.hpp"

namespace tessera::io {

std::string hdf5_version() {
  unsigned major = 0, minor = 0, release = 0;
  H5get_libversion(&major, &minor, &release);
  return fmt::format("{}.{}.{}", major, minor, release);
}

bool hdf5_is_parallel() {
  return TESSERA_HAVE_PARALLEL_HDF5 != 0;
}

}  // namespace tessera::io
