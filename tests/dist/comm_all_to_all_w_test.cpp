// Distributed tests of Comm::all_to_all_w (strided blocks in place of counts): row-major and
// transposed blocks, empty blocks, every dtype, on the backend's own implementation and on the
// base class's pack / all_to_all_v / unpack fallback (reached through a forwarding Comm).
#include <gtest/gtest.h>

#include "tests/dist/harness.hpp"
#include "tests/dist/typed_buffer.hpp"

namespace tessera {
namespace {

using testing::encode;
using testing::TypedBuffer;

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                DType::i32, DType::i64, DType::u8};
constexpr double sentinel = 77;
constexpr int64_t send_side = 7;  // every send base is a send_side x send_side row-major matrix
constexpr int64_t band_rows = 3;  // receivers keep a band of rows per sender
constexpr int64_t recv_cols = 5;

/// Forwards every operation to `inner` except all_to_all_w, so the base class's generic
/// all_to_all_w (pack, all_to_all_v, unpack) runs on a real backend.
class ForwardingComm final : public Comm {
 public:
  explicit ForwardingComm(std::shared_ptr<Comm> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  std::unique_ptr<P2PBatch> start_send_recv(std::span<const P2POp> ops) override {
    return inner_->start_send_recv(ops);
  }
  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    inner_->all_reduce(send, recv, count, dtype, op);
  }
  void all_gather_v(const void* send, size_t send_count, void* recv,
                    std::span<const size_t> recv_counts, DType dtype) override {
    inner_->all_gather_v(send, send_count, recv, recv_counts, dtype);
  }
  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                        DType dtype, ReduceOp op) override {
    inner_->reduce_scatter_v(send, recv, recv_counts, dtype, op);
  }
  void all_to_all_v(const void* send, std::span<const size_t> send_counts,
                    std::span<const size_t> send_displs, void* recv,
                    std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                    DType dtype) override {
    inner_->all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  }
  void broadcast(void* buffer, size_t count, DType dtype, int root) override {
    inner_->broadcast(buffer, count, dtype, root);
  }
  void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                 size_t recv_count, DType dtype, int root) override {
    inner_->scatter_v(send, send_counts, recv, recv_count, dtype, root);
  }
  void gather_v(const void* send, size_t send_count, void* recv,
                std::span<const size_t> recv_counts, DType dtype, int root) override {
    inner_->gather_v(send, send_count, recv, recv_counts, dtype, root);
  }
  void barrier() override { inner_->barrier(); }
  std::shared_ptr<Comm> split(int color, int key) override { return inner_->split(color, key); }

 private:
  std::shared_ptr<Comm> inner_;
};

/// What `sender` sends to `receiver`: a rows x cols block read from the sender's matrix at
/// (row0, col0), row-major or transposed, written at (band row, col) of the receiver's band.
struct Transfer {
  int64_t rows = 0, cols = 0;
  int64_t row0 = 0, col0 = 0;  // in the sender's matrix (of the block's first element)
  bool transposed = false;     // block (a, b) reads matrix (row0 + b, col0 + a)
  int64_t band_row = 0, band_col = 0;
};

/// The transfers of every pair, drawn identically on every rank; about a quarter are empty.
std::vector<std::vector<Transfer>> random_transfers(int size, testing::CaseRng& rng) {
  std::vector<std::vector<Transfer>> transfers(size, std::vector<Transfer>(size));
  for (auto& row : transfers)
    for (Transfer& t : row) {
      t.rows = rng.chance(0.25) ? 0 : rng.uniform(1, band_rows);
      t.cols = rng.uniform(0, recv_cols);
      t.transposed = rng.chance(0.5);
      const int64_t matrix_rows = t.transposed ? t.cols : t.rows;
      const int64_t matrix_cols = t.transposed ? t.rows : t.cols;
      t.row0 = rng.uniform(0, send_side - matrix_rows);
      t.col0 = rng.uniform(0, send_side - matrix_cols);
      t.band_row = rng.uniform(0, band_rows - t.rows);
      t.band_col = rng.uniform(0, recv_cols - t.cols);
    }
  return transfers;
}

StridedBlock send_block(const Transfer& t) {
  if (t.transposed)
    return StridedBlock{t.row0 * send_side + t.col0, {t.rows, t.cols}, {1, send_side}};
  return StridedBlock{t.row0 * send_side + t.col0, {t.rows, t.cols}, {send_side, 1}};
}

StridedBlock recv_block(const Transfer& t, int sender) {
  const int64_t row = sender * band_rows + t.band_row;
  return StridedBlock{row * recv_cols + t.band_col, {t.rows, t.cols}, {recv_cols, 1}};
}

void check_all_to_all_w(Comm& comm, int trial) {
  const int rank = comm.rank(), size = comm.size();
  testing::CaseRng rng(6000 + 100 * size + trial);
  const auto transfers = random_transfers(size, rng);
  std::vector<StridedBlock> sends, recvs;
  for (int peer = 0; peer < size; ++peer) {
    sends.push_back(send_block(transfers[rank][peer]));
    recvs.push_back(recv_block(transfers[peer][rank], peer));
  }
  for (DType dtype : all_dtypes) {
    TypedBuffer matrix(dtype, send_side * send_side);
    for (int64_t i = 0; i < send_side; ++i)
      for (int64_t j = 0; j < send_side; ++j)
        matrix.set(i * send_side + j, encode(dtype, rank, i, j));
    const int64_t recv_rows = size * band_rows;
    TypedBuffer received(dtype, recv_rows * recv_cols);
    for (int64_t i = 0; i < recv_rows * recv_cols; ++i) received.set(i, sentinel);

    comm.all_to_all_w(matrix.data(), sends, received.data(), recvs, dtype);

    for (int sender = 0; sender < size; ++sender) {
      const Transfer& t = transfers[sender][rank];
      for (int64_t r = 0; r < band_rows; ++r)
        for (int64_t c = 0; c < recv_cols; ++c) {
          const int64_t a = r - t.band_row, b = c - t.band_col;
          const bool inside = a >= 0 && a < t.rows && b >= 0 && b < t.cols;
          double expected = sentinel;
          if (inside)
            expected = t.transposed ? encode(dtype, sender, t.row0 + b, t.col0 + a)
                                    : encode(dtype, sender, t.row0 + a, t.col0 + b);
          EXPECT_EQ(received.get((sender * band_rows + r) * recv_cols + c), expected)
              << dtype_name(dtype) << " world " << size << " from " << sender << " at (" << r
              << ", " << c << ") trial " << trial << " backend " << comm.backend();
        }
    }
  }
}

TEST(CommAllToAllW, StridedAndTransposedBlocksWithEmptiesLandInTheirPlaces) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    for (int trial = 0; trial < 4; ++trial) check_all_to_all_w(*comm, trial);
  });
}

TEST(CommAllToAllW, TheBaseClassFallbackMovesTheSameBlocks) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    ForwardingComm forwarding(comm);
    for (int trial = 0; trial < 4; ++trial) check_all_to_all_w(forwarding, trial);
  });
}

}  // namespace
}  // namespace tessera
