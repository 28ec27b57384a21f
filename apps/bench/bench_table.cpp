// Benchmark timing and the nccl-tests style table.
#include "apps/bench/bench_table.hpp"

#include <fmt/format.h>

#include "apps/tessera/cli_parse.hpp"

namespace tessera::bench {

double time_iterations(Comm& comm, int warmup, int iterations,
                       const std::function<void()>& iteration) {
  for (int i = 0; i < warmup; ++i) iteration();
  comm.barrier();
  const double start = cli::now_seconds();
  for (int i = 0; i < iterations; ++i) iteration();
  double seconds = (cli::now_seconds() - start) / iterations;
  comm.all_reduce(&seconds, &seconds, 1, DType::f64, ReduceOp::max);
  return seconds;
}

BenchTable::BenchTable(std::string title, bool print_table, int rank)
    : print_(print_table && rank == 0) {
  if (!print_) return;
  fmt::print("# {}\n", title);
  fmt::print("# {:<28} {:>12} {:>12} {:>10} {:>10} {:>8} {:>9}\n", "op", "size (B)", "time (us)",
             "algbw", "busbw", "#wrong", "vs raw");
  fmt::print("# {:<28} {:>12} {:>12} {:>10} {:>10} {:>8} {:>9}\n", "", "", "", "(GB/s)", "(GB/s)",
             "", "");
}

void BenchTable::add(const BenchRow& row) {
  rows_.push_back({{"op", row.op},
                   {"bytes", row.bytes},
                   {"time_us", row.time_us},
                   {"algbw_GBps", row.algbw},
                   {"busbw_GBps", row.busbw},
                   {"wrong", row.wrong},
                   {"vs_baseline", row.vs_baseline}});
  if (!print_) return;
  const std::string ratio = row.vs_baseline > 0 ? fmt::format("{:.3f}x", row.vs_baseline) : "-";
  fmt::print("  {:<28} {:>12} {:>12.1f} {:>10.2f} {:>10.2f} {:>8} {:>9}\n", row.op, row.bytes,
             row.time_us, row.algbw, row.busbw, row.wrong, ratio);
  std::fflush(stdout);
}

Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype) {
  Tensor values = Tensor::empty(shape, DType::f32);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 7;
  float* out = values.data<float>();
  for (int64_t i = 0; i < values.numel(); ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    out[i] = static_cast<float>((state >> 40) * 0x1.0p-24 - 0.5);
  }
  return values.to_dtype(dtype);
}

}  // namespace tessera::bench
