// The raw MPI collectives that `tessera bench comm` measures Tessera against (blocking
// MPI_Allgatherv / MPI_Alltoallv on MPI_COMM_WORLD, f32). Stubbed without MPI.
#pragma once

namespace tessera::bench {

/// True when the raw MPI baseline can run (built with MPI and MPI is initialized).
bool raw_mpi_available();
/// MPI_Allgatherv of floats on MPI_COMM_WORLD.
void raw_all_gather_v(const float* send, int send_count, float* recv, const int* counts,
                      const int* displs);
/// MPI_Alltoallv of floats on MPI_COMM_WORLD.
void raw_all_to_all_v(const float* send, const int* send_counts, const int* send_displs,
                      float* recv, const int* recv_counts, const int* recv_displs);

}  // namespace tessera::bench
