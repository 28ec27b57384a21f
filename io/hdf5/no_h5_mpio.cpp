// Stand-in for h5_mpio.cpp in builds with a serial HDF5 (or without MPI): collective MPI-IO is
// never available, so sharded IO reads independently and writes in turns.
#include "core/errors.hpp"
#include "io/hdf5/sharded_io_detail.hpp"

namespace tessera::io::detail {

bool collective_io_available(const Comm&) {
  return false;
}

Tensor collective_read(const Comm&, const std::string&, const std::string&, const Box&, DType,
                       Device, size_t) {
  throw NotAvailable("hdf5", "collective MPI-IO needs Tessera built with a parallel HDF5 and MPI");
}

void collective_write(const Comm&, const std::string&, const std::string&, const Box&,
                      const Tensor&, bool, size_t) {
  throw NotAvailable("hdf5", "collective MPI-IO needs Tessera built with a parallel HDF5 and MPI");
}

}  // namespace tessera::io::detail
