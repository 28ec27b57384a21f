// Distributed tests of the reducing collectives of Comm: all_reduce (sum, max, min, prod, avg on
// f32, f64, i32, i64, f16, bf16; zero and non-zero counts; in place) and reduce_scatter_v (uneven
// blocks with zeros), against references computed in double.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "tests/dist/harness.hpp"
#include "tests/dist/typed_buffer.hpp"

namespace tessera {
namespace {

using testing::TypedBuffer;

constexpr DType reduce_dtypes[] = {DType::f32, DType::f64, DType::i32,
                                   DType::i64, DType::f16, DType::bf16};
constexpr ReduceOp reduce_ops[] = {ReduceOp::sum, ReduceOp::max, ReduceOp::min, ReduceOp::prod,
                                   ReduceOp::avg};

/// Rank `rank`'s element `i` for a reduction by `op` over `size` ranks. Chosen so that every
/// partial result is exact in every dtype: prod multiplies ±1 and ±2 (powers of two), avg's sum
/// is a multiple of the size, and nothing exceeds 256 in magnitude.
double contribution(ReduceOp op, int rank, int size, int64_t i) {
  if (op == ReduceOp::prod) {
    constexpr double factors[4] = {-2, -1, 1, 2};
    return factors[(rank * 3 + i) % 4];
  }
  const double small = static_cast<double>((rank * 3 + i * 5) % 7 - 3);  // in [-3, 3]
  return op == ReduceOp::avg ? small * size : small;
}

/// The exact reduction of contribution(op, r, size, i) over r.
double reference(ReduceOp op, int size, int64_t i) {
  double result = contribution(op, 0, size, i);
  for (int r = 1; r < size; ++r) {
    const double value = contribution(op, r, size, i);
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: result += value; break;
      case ReduceOp::prod: result *= value; break;
      case ReduceOp::max: result = std::max(result, value); break;
      case ReduceOp::min: result = std::min(result, value); break;
    }
  }
  return op == ReduceOp::avg ? result / size : result;
}

TEST(CommAllReduce, EveryOpOnEveryDTypeMatchesTheReferenceForZeroAndNonZeroCounts) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank(), size = comm->size();
    for (DType dtype : reduce_dtypes) {
      for (ReduceOp op : reduce_ops) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{33}}) {
          TypedBuffer send(dtype, count), recv(dtype, count);
          for (size_t i = 0; i < count; ++i) {
            send.set(i, contribution(op, rank, size, static_cast<int64_t>(i)));
            recv.set(i, -99);
          }
          comm->all_reduce(send.data(), recv.data(), count, dtype, op);
          for (size_t i = 0; i < count; ++i) {
            EXPECT_EQ(recv.get(i), reference(op, size, static_cast<int64_t>(i)))
                << "world " << size << " rank " << rank << " " << dtype_name(dtype) << " "
                << reduce_op_name(op) << " count " << count << " element " << i;
            // The send buffer is left alone.
            EXPECT_EQ(send.get(i), contribution(op, rank, size, static_cast<int64_t>(i)));
          }
        }
      }
    }
  });
}

TEST(CommAllReduce, InPlaceGivesTheSameResult) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    for (DType dtype : reduce_dtypes) {
      for (ReduceOp op : reduce_ops) {
        const size_t count = 9;
        TypedBuffer buffer(dtype, count);
        for (size_t i = 0; i < count; ++i)
          buffer.set(i, contribution(op, comm->rank(), comm->size(), static_cast<int64_t>(i)));
        comm->all_reduce(buffer.data(), buffer.data(), count, dtype, op);
        for (size_t i = 0; i < count; ++i)
          EXPECT_EQ(buffer.get(i), reference(op, comm->size(), static_cast<int64_t>(i)))
              << dtype_name(dtype) << " " << reduce_op_name(op) << " world " << comm->size();
      }
    }
  });
}

TEST(CommAllReduce, ResultsAreBitIdenticalOnEveryRank) {
  // Non-exact float sums: every rank must still get the same bits.
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const size_t count = 16;
    std::vector<float> values(count), sums(count);
    for (size_t i = 0; i < count; ++i)
      values[i] = 0.1f * static_cast<float>(comm->rank() + 1) / (i + 3);
    comm->all_reduce(values.data(), sums.data(), count, DType::f32, ReduceOp::sum);
    std::string bits(reinterpret_cast<const char*>(sums.data()), count * sizeof(float));
    const auto all = testing::all_gather_strings(*comm, bits);
    for (const std::string& other : all) EXPECT_EQ(other, bits);
  });
}

TEST(CommReduceScatter, UnevenBlocksWithZerosGetTheReducedBlockOfEachRank) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank(), size = comm->size();
    testing::CaseRng rng(1000 + size);  // same counts on every rank
    for (int trial = 0; trial < 4; ++trial) {
      const int64_t total = rng.uniform(0, 3 * size);
      const std::vector<int64_t> extents = testing::random_extents(total, size, rng);
      const std::vector<size_t> counts(extents.begin(), extents.end());
      const std::vector<size_t> displs = displacements_of(counts);
      for (DType dtype : reduce_dtypes) {
        for (ReduceOp op : reduce_ops) {
          TypedBuffer send(dtype, static_cast<size_t>(total));
          for (int64_t j = 0; j < total; ++j) send.set(j, contribution(op, rank, size, j));
          TypedBuffer recv(dtype, counts[rank]);
          comm->reduce_scatter_v(send.data(), recv.data(), counts, dtype, op);
          for (size_t i = 0; i < counts[rank]; ++i) {
            const int64_t global = static_cast<int64_t>(displs[rank] + i);
            EXPECT_EQ(recv.get(i), reference(op, size, global))
                << "world " << size << " rank " << rank << " " << dtype_name(dtype) << " "
                << reduce_op_name(op) << " counts " << ::testing::PrintToString(counts);
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace tessera
