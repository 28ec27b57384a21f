// Stub of the raw MPI baseline for builds without MPI.
#include "apps/bench/mpi_baseline.hpp"

namespace tessera::bench {

bool raw_mpi_available() {
  return false;
}
void raw_all_gather_v(const float*, int, float*, const int*, const int*) {}
void raw_all_to_all_v(const float*, const int*, const int*, float*, const int*, const int*) {}

}  // namespace tessera::bench
