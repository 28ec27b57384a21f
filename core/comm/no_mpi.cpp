// Stub of the mpi backend for builds without MPI.
#include <cstdlib>

#include "core/comm/mpi_comm.hpp"

namespace tessera {

bool mpi_compiled() {
  return false;
}

std::shared_ptr<Comm> mpi_world() {
  throw NotAvailable("mpi",
                     "this Tessera was built without MPI (TESSERA_WITH_MPI=OFF); use "
                     "TESSERA_BACKEND=local");
}

std::string mpi_library_version() {
  return "";
}

void mpi_abort(int code) {
  std::exit(code);
}

bool mpi_handle_of(const Comm&, void*) {
  return false;
}

bool mpi_initialized() {
  return false;
}

int mpi_library_cuda_support() {
  return -1;
}

bool mpi_cuda_aware() {
  return false;
}

}  // namespace tessera
