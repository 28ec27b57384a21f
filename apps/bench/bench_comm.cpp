// `tessera bench comm`: all_gather_v, all_to_all_v and ShardTensor.redistribute (S(0)->R and
// S(0)->S(1)) on uneven extents over a size sweep, beside the raw MPI code moving the same bytes
// (under mpiexec: MPI_Allgatherv, MPI_Alltoallv, and the hand-written pack + MPI_Alltoallv +
// unpack that S(0)->S(1) is judged against) or Tessera's own collective (local backend). The
// global tensor is [rows, 256] f32; rank r's share of a split is proportional to 2 for even r
// and 1 for odd r.
#include <fmt/format.h>

#include <functional>
#include <nlohmann/json.hpp>

#include "apps/bench/bench_harness.hpp"
#include "apps/bench/mpi_baseline.hpp"
#include "apps/tessera/commands.hpp"
#include "core/tessera.hpp"

namespace tessera::cli {

namespace {

constexpr int64_t kCols = 256;

struct CommBenchOptions {
  size_t min_bytes = size_t{256} << 10;
  size_t max_bytes = size_t{64} << 20;
  int ranks = 4;
  int iterations = 0;  // 0: chosen per size
  bool json = false;
  std::string device = "cpu";  // where the buffers live (every rank's device)
};

/// Uneven split of n over parts with weights 2,1,2,1,... (or 1,2,1,2,... when `flipped`).
std::vector<int64_t> weighted_split(int64_t n, int parts, bool flipped) {
  std::vector<int64_t> weights(parts);
  int64_t total_weight = 0;
  for (int p = 0; p < parts; ++p) total_weight += weights[p] = ((p % 2 == 0) != flipped) ? 2 : 1;
  std::vector<int64_t> extents(parts);
  int64_t assigned = 0;
  for (int p = 0; p < parts; ++p) assigned += extents[p] = n * weights[p] / total_weight;
  extents[0] += n - assigned;
  return extents;
}

float expected_value(int64_t row, int64_t col) {
  return static_cast<float>((row * kCols + col) % 16777213);  // exact in f32
}

/// Elements of `values` (a row-major box [row0, row0+rows) x [col0, col0+cols)) that differ.
int64_t count_wrong(const float* values, int64_t row0, int64_t rows, int64_t col0, int64_t cols) {
  int64_t wrong = 0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      wrong += values[i * cols + j] != expected_value(row0 + i, col0 + j);
  return wrong;
}

int64_t total_wrong(Comm& comm, int64_t wrong) {
  comm.all_reduce(&wrong, &wrong, 1, DType::i64, ReduceOp::sum);
  return wrong;
}

std::vector<int> to_int_counts(const std::vector<size_t>& counts) {
  return std::vector<int>(counts.begin(), counts.end());
}

/// Adds a row of `op` taking `seconds` per iteration on the `bytes` global tensor; `baseline`
/// (0: none) is the seconds of the row named `baseline_op` it is judged against.
void add_row(bench::BenchTable& table, const std::string& op, size_t bytes, double bus_factor,
             double seconds, int64_t wrong, double baseline = 0,
             const std::string& baseline_op = "") {
  const double algbw = static_cast<double>(bytes) / seconds / 1e9;
  nlohmann::json row{{"op", op},
                     {"bytes", bytes},
                     {"time_us", seconds * 1e6},
                     {"algbw_GBps", algbw},
                     {"busbw_GBps", algbw * bus_factor},
                     {"wrong", wrong},
                     {"vs_baseline", baseline > 0 ? seconds / baseline : 0.0}};
  if (baseline > 0) row["baseline_op"] = baseline_op;
  table.add(std::move(row));
}

void bench_size(std::shared_ptr<Comm> world, const DeviceMesh& mesh, size_t bytes,
                const CommBenchOptions& options, bench::BenchTable& table) {
  const int parts = world->size();
  const int me = world->rank();
  const int64_t rows = std::max<int64_t>(parts, static_cast<int64_t>(bytes) / (4 * kCols));
  const size_t global_bytes = static_cast<size_t>(rows * kCols * 4);
  const std::vector<int64_t> row_extents = weighted_split(rows, parts, false);
  const std::vector<int64_t> col_extents = weighted_split(kCols, parts, true);
  const std::vector<int64_t> row_offsets = offsets_of(row_extents);
  const std::vector<int64_t> col_offsets = offsets_of(col_extents);
  const int iterations =
      options.iterations > 0
          ? options.iterations
          : static_cast<int>(std::clamp<size_t>((size_t{256} << 20) / global_bytes, 5, 50));
  const int warmup = std::max(2, iterations / 5);
  const double bus_factor = parts > 1 ? double(parts - 1) / parts : 1.0;

  const Device device = current_rank_context().device();
  auto timed = [&](const std::function<void()>& body) {
    return bench::time_collective(*world, device, warmup, iterations, body);
  };
  auto row = [&](const std::string& op, double seconds, int64_t wrong, double baseline = 0,
                 const std::string& baseline_op = "") {
    add_row(table, op, global_bytes, bus_factor, seconds, wrong, baseline, baseline_op);
  };
  Tensor host_local = Tensor::empty({row_extents[me], kCols}, DType::f32);
  for (int64_t i = 0; i < row_extents[me]; ++i)
    for (int64_t j = 0; j < kCols; ++j)
      host_local.data<float>()[i * kCols + j] = expected_value(row_offsets[me] + i, j);
  const Tensor local = host_local.to(device);
  // Buffers of the raw collectives on the rank's device; checks read host copies of them.
  auto buffer = [&](size_t count) {
    return Tensor::empty({static_cast<int64_t>(count)}, DType::f32, device);
  };
  auto host_floats = [](const Tensor& t) { return t.to(Device::cpu()); };
  const ShardTensor sharded =
      ShardTensor::from_local(local, mesh, {rows, kCols}, {Placement::shard(0)}, {row_extents});
  const bool raw = bench::raw_mpi_available() && device.is_cpu();

  // --- Shard(0) -> Replicate: all_gather_v.
  std::vector<size_t> gather_counts(parts);
  for (int p = 0; p < parts; ++p) gather_counts[p] = static_cast<size_t>(row_extents[p] * kCols);
  Tensor gathered = buffer(static_cast<size_t>(rows * kCols));
  const double comm_gather = timed([&] {
    world->all_gather_v(local.raw_data(), gather_counts[me], gathered.raw_data(), gather_counts,
                        DType::f32);
  });
  row("all_gather_v", comm_gather,
      total_wrong(*world, count_wrong(host_floats(gathered).data<float>(), 0, rows, 0, kCols)));
  double gather_baseline = comm_gather;
  std::string gather_baseline_op = "all_gather_v";
  if (raw) {
    std::vector<float> gathered(static_cast<size_t>(rows * kCols));
    const std::vector<int> counts = to_int_counts(gather_counts);
    const std::vector<int> displs = to_int_counts(displacements_of(gather_counts));
    std::fill(gathered.begin(), gathered.end(), -1.0f);
    gather_baseline = timed([&] {
      bench::raw_all_gather_v(local.data<float>(), counts[me], gathered.data(), counts.data(),
                              displs.data());
    });
    gather_baseline_op = "raw MPI_Allgatherv";
    row(gather_baseline_op, gather_baseline,
        total_wrong(*world, count_wrong(gathered.data(), 0, rows, 0, kCols)));
  }
  ShardTensor replicated = sharded;
  const double redistribute_gather =
      timed([&] { replicated = sharded.redistribute({Placement::replicate()}); });
  row("redistribute S(0)->R", redistribute_gather,
      total_wrong(*world,
                  count_wrong(host_floats(replicated.to_local()).data<float>(), 0, rows, 0, kCols)),
      gather_baseline, gather_baseline_op);

  // --- Shard(0) -> Shard(1): all_to_all_v of the boxes that change owner.
  std::vector<size_t> send_counts(parts), recv_counts(parts);
  for (int p = 0; p < parts; ++p) {
    send_counts[p] = static_cast<size_t>(row_extents[me] * col_extents[p]);
    recv_counts[p] = static_cast<size_t>(row_extents[p] * col_extents[me]);
  }
  const std::vector<size_t> send_displs = displacements_of(send_counts);
  const std::vector<size_t> recv_displs = displacements_of(recv_counts);
  Tensor send_tensor = buffer(send_displs.back() + send_counts.back());
  Tensor recv_tensor = buffer(recv_displs.back() + recv_counts.back());
  for (int p = 0; p < parts; ++p)
    local.pack_box(Box{{0, col_offsets[p]}, {row_extents[me], col_offsets[p + 1]}},
                   static_cast<float*>(send_tensor.raw_data()) + send_displs[p]);
  auto check_received = [&](const float* received) {
    int64_t wrong = 0;
    for (int p = 0; p < parts; ++p)
      wrong += count_wrong(received + recv_displs[p], row_offsets[p], row_extents[p],
                           col_offsets[me], col_extents[me]);
    return total_wrong(*world, wrong);
  };
  // The S(1) result [rows, cols_me] on this rank.
  auto check_transposed = [&](const float* values) {
    return total_wrong(*world, count_wrong(values, 0, rows, col_offsets[me], col_extents[me]));
  };
  const double comm_all_to_all = timed([&] {
    world->all_to_all_v(send_tensor.raw_data(), send_counts, send_displs, recv_tensor.raw_data(),
                        recv_counts, recv_displs, DType::f32);
  });
  row("all_to_all_v", comm_all_to_all, check_received(host_floats(recv_tensor).data<float>()));
  double all_to_all_baseline = comm_all_to_all;
  std::string all_to_all_baseline_op = "all_to_all_v";
  if (raw) {
    // The bare collective on pre-packed buffers, for reference.
    const Tensor host_send = host_floats(send_tensor);
    const float* send_buffer = host_send.data<float>();
    std::vector<float> recv_buffer(recv_displs.back() + recv_counts.back(), -1.0f);
    const auto scounts = to_int_counts(send_counts), sdispls = to_int_counts(send_displs);
    const auto rcounts = to_int_counts(recv_counts), rdispls = to_int_counts(recv_displs);
    const double raw_all_to_all = timed([&] {
      bench::raw_all_to_all_v(send_buffer, scounts.data(), sdispls.data(), recv_buffer.data(),
                              rcounts.data(), rdispls.data());
    });
    row("raw MPI_Alltoallv", raw_all_to_all, check_received(recv_buffer.data()));
    // The baseline: the same bytes from the [rows_me, 256] piece to the [rows, cols_me] piece
    // by hand, buffers made once outside the timed loop.
    bench::RawTranspose transpose = bench::make_raw_transpose(me, row_offsets, col_offsets);
    all_to_all_baseline =
        timed([&] { bench::raw_pack_all_to_all_unpack(local.data<float>(), transpose); });
    all_to_all_baseline_op = "pack+MPI_Alltoallv+unpack";
    row(all_to_all_baseline_op, all_to_all_baseline, check_transposed(transpose.result.data()));
  }
  ShardTensor transposed = sharded;
  const double redistribute_all_to_all =
      timed([&] { transposed = sharded.redistribute({Placement::shard(1)}, {col_extents}); });
  row("redistribute S(0)->S(1)", redistribute_all_to_all,
      check_transposed(host_floats(transposed.to_local()).data<float>()), all_to_all_baseline,
      all_to_all_baseline_op);
}

void run_comm_bench(std::shared_ptr<Comm> world, const CommBenchOptions& options) {
  DeviceMesh mesh(world, {world->size()}, {"ranks"});
  const bool raw = bench::raw_mpi_available();
  bench::BenchReport report("comm", options.json,
                            bench::is_reporter(backend_from_env(), world.get()));
  report.set("backend", world->backend());
  report.set("ranks", world->size());
  report.set("baseline", raw ? "raw_mpi" : "tessera_comm");
  report.set("device", options.device);
  bench::BenchTable& table = report.table(
      "rows",
      fmt::format(
          "tessera bench comm: {} ranks, {} backend, {} buffers, baseline: {}", world->size(),
          world->backend(), current_rank_context().device().str(),
          raw ? "raw MPI (S(0)->S(1): pack+MPI_Alltoallv+unpack)" : "Tessera's own collective"),
      {{"op", "op", "", 28},
       {"bytes", "size", "B", 12},
       {"time_us", "time", "us", 12, 1},
       {"algbw_GBps", "algbw", "GB/s", 10, 2},
       {"busbw_GBps", "busbw", "GB/s", 10, 2},
       {"wrong", "#wrong", "", 8},
       {"vs_baseline", "vs raw", "", 9, -1,
        [](const nlohmann::json& row) { return bench::ratio_text(row, "vs_baseline"); }}});
  for (size_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= 4)
    bench_size(world, mesh, bytes, options, table);
  report.finish();
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks (figures and JSON; no pass/fail)");
  bench->require_subcommand(1);
  auto options = std::make_shared<CommBenchOptions>();
  auto* comm = bench->add_subcommand(
      "comm", "all_gather_v, all_to_all_v and redistribute beside the raw MPI code");
  comm->add_option("--min-bytes", options->min_bytes, "Smallest global tensor (bytes)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  comm->add_option("--max-bytes", options->max_bytes, "Largest global tensor (bytes)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  comm->add_option("--ranks", options->ranks, "Local ranks without mpiexec")
      ->check(CLI::Range(1, kMaxLocalRanks))
      ->capture_default_str();
  comm->add_option("--iterations", options->iterations, "Timed iterations (0: by size)")
      ->check(CLI::Range(0, 1000000));
  comm->add_flag("--json", options->json, "Print JSON instead of the table");
  comm->add_option("--device", options->device,
                   "Where the buffers live: cpu, cuda (ranks round-robin over the GPUs) or "
                   "cuda:N")
      ->capture_default_str();
  comm->callback([options] {
    check_arg(options->min_bytes <= options->max_bytes, "bench",
              "--min-bytes {} is larger than --max-bytes {}", options->min_bytes,
              options->max_bytes);
    select_device(options->device);
    launch(backend_from_env(), options->ranks,
           [&](std::shared_ptr<Comm> world) { run_comm_bench(world, *options); });
  });
  register_conv_bench(*bench);
  register_io_bench(*bench);
  register_na_bench(*bench);
  register_train_bench(*bench);
  register_ops_bench(*bench);
}

}  // namespace tessera::cli
