// The raw MPI code that `tessera bench comm` measures Tessera against (blocking
// MPI_Allgatherv / MPI_Alltoallv on MPI_COMM_WORLD, f32, and a hand-written pack +
// MPI_Alltoallv + unpack of a Shard(0)->Shard(1) transpose). Stubbed without MPI.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::bench {

/// True when the raw MPI baseline can run (built with MPI and MPI is initialized).
bool raw_mpi_available();
/// MPI_Allgatherv of floats on MPI_COMM_WORLD.
void raw_all_gather_v(const float* send, int send_count, float* recv, const int* counts,
                      const int* displs);
/// MPI_Alltoallv of floats on MPI_COMM_WORLD.
void raw_all_to_all_v(const float* send, const int* send_counts, const int* send_displs,
                      float* recv, const int* recv_counts, const int* recv_displs);

/// The hand-written Shard(0)->Shard(1) of a row-major [rows, cols] f32 tensor on this rank of
/// MPI_COMM_WORLD: its [rows_me, cols] piece becomes its [rows, cols_me] piece. Every buffer is
/// made once, by make_raw_transpose.
struct RawTranspose {
  int rank = 0;
  int64_t cols = 0;                           ///< global columns
  std::vector<int64_t> row_offsets;           ///< first row of each rank, then rows (size P + 1)
  std::vector<int64_t> col_offsets;           ///< first column of each rank, then cols
  std::vector<int> send_counts, send_displs;  ///< floats per destination, [rows_me, cols_p]
  std::vector<int> recv_counts, recv_displs;  ///< floats per source, [rows_p, cols_me]
  std::vector<float> send, recv;              ///< the packed blocks, in rank order
  std::vector<float> result;                  ///< [rows, cols_me]
};

/// The buffers and counts of the transpose of rank `rank` with the given row and column
/// offsets (P + 1 each), zero-filled (so no page is first touched while timed).
RawTranspose make_raw_transpose(int rank, const std::vector<int64_t>& row_offsets,
                                const std::vector<int64_t>& col_offsets);

/// Packs each destination's column block of `local` ([rows_me, cols], row-major) into
/// t.send, runs MPI_Alltoallv on MPI_COMM_WORLD, and unpacks each source's block into t.result.
void raw_pack_all_to_all_unpack(const float* local, RawTranspose& t);

}  // namespace tessera::bench
