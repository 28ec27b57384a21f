// Stub of the raw MPI baseline for builds without MPI (raw_mpi_available() is false, so the
// benchmark never calls the others).
#include "apps/bench/mpi_baseline.hpp"

namespace tessera::bench {

bool raw_mpi_available() {
  return false;
}
void raw_all_gather_v(const float*, int, float*, const int*, const int*) {}
void raw_all_to_all_v(const float*, const int*, const int*, float*, const int*, const int*) {}
RawTranspose make_raw_transpose(int, const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {};
}
void raw_pack_all_to_all_unpack(const float*, RawTranspose&) {}

}  // namespace tessera::bench
