// Raw MPI baseline collectives.
#include "apps/bench/mpi_baseline.hpp"

#include <mpi.h>

namespace tessera::bench {

bool raw_mpi_available() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0;
}

void raw_all_gather_v(const float* send, int send_count, float* recv, const int* counts,
                      const int* displs) {
  MPI_Allgatherv(send, send_count, MPI_FLOAT, recv, counts, displs, MPI_FLOAT, MPI_COMM_WORLD);
}

void raw_all_to_all_v(const float* send, const int* send_counts, const int* send_displs,
                      float* recv, const int* recv_counts, const int* recv_displs) {
  MPI_Alltoallv(send, send_counts, send_displs, MPI_FLOAT, recv, recv_counts, recv_displs,
                MPI_FLOAT, MPI_COMM_WORLD);
}

}  // namespace tessera::bench
