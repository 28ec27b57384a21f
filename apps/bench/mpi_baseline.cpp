// Raw MPI baseline collectives and the hand-written pack + MPI_Alltoallv + unpack transpose.
#include "apps/bench/mpi_baseline.hpp"

#include <mpi.h>

#include <cstring>

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

RawTranspose make_raw_transpose(int rank, const std::vector<int64_t>& row_offsets,
                                const std::vector<int64_t>& col_offsets) {
  RawTranspose t;
  const size_t parts = row_offsets.size() - 1;
  t.rank = rank;
  t.cols = col_offsets.back();
  t.row_offsets = row_offsets;
  t.col_offsets = col_offsets;
  const int64_t rows_me = row_offsets[rank + 1] - row_offsets[rank];
  const int64_t cols_me = col_offsets[rank + 1] - col_offsets[rank];
  int send_total = 0, recv_total = 0;
  for (size_t p = 0; p < parts; ++p) {
    t.send_displs.push_back(send_total);
    t.send_counts.push_back(static_cast<int>(rows_me * (col_offsets[p + 1] - col_offsets[p])));
    send_total += t.send_counts.back();
    t.recv_displs.push_back(recv_total);
    t.recv_counts.push_back(static_cast<int>((row_offsets[p + 1] - row_offsets[p]) * cols_me));
    recv_total += t.recv_counts.back();
  }
  t.send.assign(static_cast<size_t>(send_total), 0.0f);
  t.recv.assign(static_cast<size_t>(recv_total), 0.0f);
  t.result.assign(static_cast<size_t>(row_offsets.back() * cols_me), 0.0f);
  return t;
}

void raw_pack_all_to_all_unpack(const float* local, RawTranspose& t) {
  const size_t parts = t.send_counts.size();
  const int64_t rows_me = t.row_offsets[t.rank + 1] - t.row_offsets[t.rank];
  const int64_t cols_me = t.col_offsets[t.rank + 1] - t.col_offsets[t.rank];
  for (size_t p = 0; p < parts; ++p) {  // pack: rows of the column block [col_p, col_p+1)
    const int64_t width = t.col_offsets[p + 1] - t.col_offsets[p];
    float* out = t.send.data() + t.send_displs[p];
    const float* in = local + t.col_offsets[p];
    for (int64_t i = 0; i < rows_me; ++i)
      std::memcpy(out + i * width, in + i * t.cols, static_cast<size_t>(width) * sizeof(float));
  }
  MPI_Alltoallv(t.send.data(), t.send_counts.data(), t.send_displs.data(), MPI_FLOAT, t.recv.data(),
                t.recv_counts.data(), t.recv_displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
  // Unpack: source p's block is rows [row_p, row_p+1) of the result, whole rows of cols_me
  // columns, so it lands as one contiguous run.
  for (size_t p = 0; p < parts; ++p)
    std::memcpy(t.result.data() + t.row_offsets[p] * cols_me, t.recv.data() + t.recv_displs[p],
                static_cast<size_t>(t.recv_counts[p]) * sizeof(float));
}

}  // namespace tessera::bench
