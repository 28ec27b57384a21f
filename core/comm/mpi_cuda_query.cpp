// Asks the MPI library whether it is CUDA-aware (MPIX_Query_cuda_support of MPICH >= 4 and of
// Open MPI's mpi-ext.h). Built when CMake found the declaration; its header comes from
// TESSERA_MPI_CUDA_QUERY_HEADER, set by core/CMakeLists.txt.
#include <mpi.h>

#include TESSERA_MPI_CUDA_QUERY_HEADER

#include "core/comm/mpi_comm.hpp"

namespace tessera {

int mpi_library_cuda_support() {
  return MPIX_Query_cuda_support() ? 1 : 0;
}

}  // namespace tessera
