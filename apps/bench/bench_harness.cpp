// The bench harness: the reporter rule, timing, and the declared-column tables (see
// bench_harness.hpp).
#include "apps/bench/bench_harness.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "apps/bench/gpu_timer.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "core/comm/mpi_comm.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera::bench {

int launcher_rank_from_env() {
  for (const char* variable :
       {"PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID"}) {
    const char* text = std::getenv(variable);
    if (text == nullptr) continue;
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    return end != text && *end == '\0' && value >= 0 ? static_cast<int>(value) : 0;
  }
  return 0;
}

bool is_reporter(Backend backend, const Comm* world) {
  if (world != nullptr && world->rank() != 0) return false;
  if (!launched_by_mpi_launcher()) return true;  // this process is the whole job
  // The mpi backend's world, and the MPI world the nccl backend is bootstrapped over, decide;
  // with local ranks in every launched process the launcher's rank does.
  if (backend != Backend::local && mpi_compiled()) return mpi_world()->rank() == 0;
  return launcher_rank_from_env() == 0;
}

double time_rank(Device device, int warmup, int iterations, const std::function<void()>& body) {
  for (int i = 0; i < warmup; ++i) body();
  if (device.is_cpu()) {
    const double start = cli::now_seconds();
    for (int i = 0; i < iterations; ++i) body();
    return (cli::now_seconds() - start) / iterations;
  }
  const Stream stream = compute_stream_for(device);
  synchronize(stream);
  GpuTimer timer(stream);
  timer.start();
  for (int i = 0; i < iterations; ++i) body();
  return timer.stop() / iterations;
}

double time_collective(Comm& comm, Device device, int warmup, int iterations,
                       const std::function<void()>& body) {
  for (int i = 0; i < warmup; ++i) body();
  if (device.is_cuda()) synchronize(compute_stream_for(device));
  comm.barrier();
  double seconds = time_rank(device, 0, iterations, body);
  comm.all_reduce(&seconds, &seconds, 1, DType::f64, ReduceOp::max);
  return seconds;
}

namespace {

/// `text` padded to `width`: left-aligned for the first column, right-aligned otherwise.
std::string aligned(const std::string& text, int width, bool left) {
  return left ? fmt::format("{:<{}}", text, width) : fmt::format("{:>{}}", text, width);
}

void print_line(const std::string& lead, const std::vector<std::string>& cells,
                const std::vector<Column>& columns) {
  std::string line = lead;
  for (size_t c = 0; c < cells.size(); ++c) {
    if (c > 0) line += ' ';
    line += aligned(cells[c], columns[c].width, c == 0);
  }
  while (!line.empty() && line.back() == ' ') line.pop_back();
  fmt::print("{}\n", line);
}

}  // namespace

BenchTable::BenchTable(const std::string& title, std::vector<Column> columns, bool print)
    : columns_(std::move(columns)), print_(print) {
  if (!print_) return;
  fmt::print("# {}\n", title);
  std::vector<std::string> names, units;
  bool any_unit = false;
  for (const Column& column : columns_) {
    names.push_back(column.name);
    units.push_back(column.unit.empty() ? "" : "(" + column.unit + ")");
    any_unit = any_unit || !column.unit.empty();
  }
  print_line("# ", names, columns_);
  if (any_unit) print_line("# ", units, columns_);
  std::fflush(stdout);
}

std::string BenchTable::cell(const Column& column, const nlohmann::json& row) const {
  if (column.text) return column.text(row);
  const auto it = row.find(column.key);
  if (it == row.end() || it->is_null()) return "-";
  const nlohmann::json& value = *it;
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "yes" : "no";
  if (value.is_number_float()) {
    const double number = value.get<double>();
    return column.precision >= 0 ? fmt::format("{:.{}f}", number, column.precision)
                                 : fmt::format("{}", number);
  }
  if (value.is_array()) {
    std::string text;
    for (const nlohmann::json& element : value) {
      if (!text.empty()) text += ',';
      text += element.is_string() ? element.get<std::string>() : element.dump();
    }
    return text;
  }
  return value.dump();  // integers
}

void BenchTable::add(nlohmann::json row) {
  if (print_) {
    std::vector<std::string> cells;
    for (const Column& column : columns_) cells.push_back(cell(column, row));
    print_line("  ", cells, columns_);
    std::fflush(stdout);
  }
  rows_.push_back(std::move(row));
}

BenchReport::BenchReport(std::string benchmark, bool json, bool reporter)
    : benchmark_(std::move(benchmark)), json_(json), reporter_(reporter) {}

void BenchReport::set(const std::string& key, nlohmann::json value) {
  header_[key] = std::move(value);
}

BenchTable& BenchReport::table(const std::string& key, const std::string& title,
                               std::vector<Column> columns) {
  tables_.emplace_back(key, std::make_unique<BenchTable>(title, std::move(columns), printing()));
  return *tables_.back().second;
}

nlohmann::json BenchReport::document() const {
  nlohmann::json document = header_;
  document["benchmark"] = benchmark_;
  for (const auto& [key, table] : tables_) document[key] = table->rows();
  return document;
}

void BenchReport::finish() const {
  if (json_ && reporter_) std::cout << document().dump(2) << "\n" << std::flush;
}

std::string ratio_text(const nlohmann::json& row, const std::string& key, int precision) {
  const auto it = row.find(key);
  if (it == row.end() || !it->is_number() || it->get<double>() <= 0) return "-";
  return fmt::format("{:.{}f}x", it->get<double>(), precision);
}

}  // namespace tessera::bench
