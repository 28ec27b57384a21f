// For MPI libraries that declare no MPIX_Query_cuda_support: they cannot tell whether they are
// CUDA-aware (device buffers are staged unless TESSERA_MPI_CUDA_AWARE=1).
#include "core/comm/mpi_comm.hpp"

namespace tessera {

int mpi_library_cuda_support() {
  return -1;
}

}  // namespace tessera
