// Stub of the plain HDF5 baseline for builds without HDF5 (raw_hdf5_available() is false, so the
// benchmark never calls raw_read_samples).
#include "apps/bench/h5_baseline.hpp"

namespace tessera::bench {

bool raw_hdf5_available() {
  return false;
}
int64_t raw_read_samples(const std::string&, const std::string&, const std::vector<int64_t>&) {
  return 0;
}

}  // namespace tessera::bench
