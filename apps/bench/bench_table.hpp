// The benchmark harness's output: one row per (operation, size), printed as a table on rank 0
// as it is measured, and collected as JSON. Column formulas are in docs/benchmarks.md.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/comm/comm.hpp"
#include "core/tensor.hpp"

namespace tessera::bench {

struct BenchRow {
  std::string op;
  size_t bytes = 0;        ///< bytes of the global tensor the operation moves
  double time_us = 0;      ///< mean time per iteration, slowest rank
  double algbw = 0;        ///< GB/s: bytes / time
  double busbw = 0;        ///< GB/s: algbw * bus factor of the operation
  int64_t wrong = 0;       ///< elements that differ from the expected result (all ranks)
  double vs_baseline = 0;  ///< time / time of the baseline row, 0 when there is none
};

/// Times `iteration` on every rank: `warmup` untimed runs, then `iterations` timed runs between
/// barriers. Returns the slowest rank's mean seconds per iteration.
double time_iterations(Comm& comm, int warmup, int iterations,
                       const std::function<void()>& iteration);

/// Deterministic values uniform in [-0.5, 0.5) from `seed` (xorshift), made in f32 and converted
/// to `dtype`: benchmark inputs that every rank can build alike.
Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype = DType::f32);

/// Prints rows as they come (rank 0 only) and collects them.
class BenchTable {
 public:
  BenchTable(std::string title, bool print_table, int rank);
  /// Adds a row and prints it.
  void add(const BenchRow& row);
  /// All rows as a JSON array.
  const nlohmann::json& json() const { return rows_; }

 private:
  bool print_;
  nlohmann::json rows_ = nlohmann::json::array();
};

}  // namespace tessera::bench
