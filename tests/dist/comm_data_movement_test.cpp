// Distributed tests of the data-moving collectives of Comm with zero and uneven counts:
// all_gather_v, all_to_all_v (with gaps between blocks), broadcast, scatter_v and gather_v.
// Every element encodes (sender, receiver, index), so a misplaced element is caught.
#include <gtest/gtest.h>

#include "tests/dist/harness.hpp"
#include "tests/dist/typed_buffer.hpp"

namespace tessera {
namespace {

using testing::encode;
using testing::TypedBuffer;

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                DType::i32, DType::i64, DType::u8};
constexpr double sentinel = 77;  // fits every dtype; never produced where checked

/// `size` counts in [0, max_count] with zeros, the same on every rank for the same seed.
std::vector<size_t> random_counts(testing::CaseRng& rng, int size, int64_t max_count) {
  std::vector<size_t> counts(size);
  for (size_t& count : counts)
    count = rng.chance(0.3) ? 0 : static_cast<size_t>(rng.uniform(0, max_count));
  return counts;
}

TEST(CommAllGather, UnevenCountsWithZerosConcatenateInRankOrder) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank(), size = comm->size();
    testing::CaseRng rng(2000 + size);
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<size_t> counts = random_counts(rng, size, 6);
      if (trial == 0) std::fill(counts.begin(), counts.end(), 0);  // nothing at all to move
      const std::vector<size_t> displs = displacements_of(counts);
      const size_t total = displs.back() + counts.back();
      for (DType dtype : all_dtypes) {
        TypedBuffer send(dtype, counts[rank]), recv(dtype, total);
        for (size_t i = 0; i < counts[rank]; ++i) send.set(i, encode(dtype, rank, 0, i));
        comm->all_gather_v(send.data(), counts[rank], recv.data(), counts, dtype);
        for (int from = 0; from < size; ++from)
          for (size_t i = 0; i < counts[from]; ++i)
            EXPECT_EQ(recv.get(displs[from] + i), encode(dtype, from, 0, i))
                << dtype_name(dtype) << " world " << size << " counts "
                << ::testing::PrintToString(counts);
      }
    }
  });
}

TEST(CommAllToAll, UnevenCountsWithZerosAndGapsReachTheirDisplacements) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank(), size = comm->size();
    testing::CaseRng rng(3000 + size);
    for (int trial = 0; trial < 4; ++trial) {
      // counts[from][to]: drawn identically on every rank.
      std::vector<std::vector<size_t>> counts(size);
      for (auto& row : counts) row = random_counts(rng, size, 5);
      // Displacements leave one (send) or two (receive) unused elements after every block.
      std::vector<size_t> send_displs(size), recv_counts(size), recv_displs(size);
      size_t send_total = 0, recv_total = 0;
      for (int peer = 0; peer < size; ++peer) {
        send_displs[peer] = send_total;
        send_total += counts[rank][peer] + 1;
        recv_counts[peer] = counts[peer][rank];
        recv_displs[peer] = recv_total;
        recv_total += recv_counts[peer] + 2;
      }
      for (DType dtype : all_dtypes) {
        TypedBuffer send(dtype, send_total), recv(dtype, recv_total);
        for (size_t i = 0; i < recv_total; ++i) recv.set(i, sentinel);
        for (int to = 0; to < size; ++to)
          for (size_t i = 0; i < counts[rank][to]; ++i)
            send.set(send_displs[to] + i, encode(dtype, rank, to, i));
        comm->all_to_all_v(send.data(), counts[rank], send_displs, recv.data(), recv_counts,
                           recv_displs, dtype);
        for (int from = 0; from < size; ++from) {
          for (size_t i = 0; i < recv_counts[from]; ++i)
            EXPECT_EQ(recv.get(recv_displs[from] + i), encode(dtype, from, rank, i))
                << dtype_name(dtype) << " world " << size << " from " << from;
          // The gaps are never written.
          EXPECT_EQ(recv.get(recv_displs[from] + recv_counts[from]), sentinel);
          EXPECT_EQ(recv.get(recv_displs[from] + recv_counts[from] + 1), sentinel);
        }
      }
    }
  });
}

TEST(CommBroadcast, EveryRootReachesEveryRankForZeroAndNonZeroCounts) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    for (int root = 0; root < comm->size(); ++root) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}}) {
        for (DType dtype : all_dtypes) {
          TypedBuffer buffer(dtype, count);
          for (size_t i = 0; i < count; ++i)
            buffer.set(i, comm->rank() == root ? encode(dtype, root, count, i) : sentinel);
          comm->broadcast(buffer.data(), count, dtype, root);
          for (size_t i = 0; i < count; ++i)
            EXPECT_EQ(buffer.get(i), encode(dtype, root, count, i))
                << dtype_name(dtype) << " root " << root << " world " << comm->size();
        }
      }
    }
  });
}

TEST(CommScatter, EveryRootSendsEachRankOnlyItsUnevenBlock) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank(), size = comm->size();
    testing::CaseRng rng(4000 + size);
    for (int root = 0; root < size; ++root) {
      const std::vector<size_t> counts = random_counts(rng, size, 6);
      const std::vector<size_t> displs = displacements_of(counts);
      for (DType dtype : all_dtypes) {
        TypedBuffer send(dtype, rank == root ? displs.back() + counts.back() : 0);
        if (rank == root)
          for (int to = 0; to < size; ++to)
            for (size_t i = 0; i < counts[to]; ++i)
              send.set(displs[to] + i, encode(dtype, root, to, i));
        // One spare element after the block shows that nothing beyond it is written.
        TypedBuffer recv(dtype, counts[rank] + 1);
        recv.set(counts[rank], sentinel);
        comm->scatter_v(send.data(), counts, recv.data(), counts[rank], dtype, root);
        for (size_t i = 0; i < counts[rank]; ++i)
          EXPECT_EQ(recv.get(i), encode(dtype, root, rank, i))
              << dtype_name(dtype) << " root " << root << " world " << size;
        EXPECT_EQ(recv.get(counts[rank]), sentinel);
      }
    }
  });
}

TEST(CommGather, EveryRootReceivesEveryUnevenBlockInRankOrder) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank(), size = comm->size();
    testing::CaseRng rng(5000 + size);
    for (int root = 0; root < size; ++root) {
      const std::vector<size_t> counts = random_counts(rng, size, 6);
      const std::vector<size_t> displs = displacements_of(counts);
      const size_t total = displs.back() + counts.back();
      for (DType dtype : all_dtypes) {
        TypedBuffer send(dtype, counts[rank]);
        for (size_t i = 0; i < counts[rank]; ++i) send.set(i, encode(dtype, rank, root, i));
        TypedBuffer recv(dtype, rank == root ? total : 0);
        comm->gather_v(send.data(), counts[rank], recv.data(), counts, dtype, root);
        if (rank != root) continue;
        for (int from = 0; from < size; ++from)
          for (size_t i = 0; i < counts[from]; ++i)
            EXPECT_EQ(recv.get(displs[from] + i), encode(dtype, from, root, i))
                << dtype_name(dtype) << " root " << root << " world " << size;
      }
    }
  });
}

}  // namespace
}  // namespace tessera
