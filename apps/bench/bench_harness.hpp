// The harness every `tessera bench` command goes through: which process reports, how an
// operation is timed (host clock for cpu buffers, CUDA events on the rank's compute stream for
// cuda buffers), and the table each benchmark declares, prints as it measures and emits as one
// JSON document per run. Column formulas are in docs/benchmarks.md.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/bench/bench_inputs.hpp"
#include "core/comm/comm.hpp"
#include "core/comm/launch.hpp"
#include "core/device.hpp"
#include "core/tensor.hpp"

namespace tessera::bench {

/// The reporter rule: true on world rank 0 of the launched job, whatever the backend. Under an
/// MPI launcher that is MPI_COMM_WORLD rank 0 (the mpi backend's world, and the world the nccl
/// backend is bootstrapped over; with the local backend, the launcher's rank 0 process);
/// without one, this process is the whole job. Given the launched `world`, also only its rank 0
/// (one of the local ranks of this process).
bool is_reporter(Backend backend, const Comm* world = nullptr);

/// This process's rank in the launcher's job from its environment (PMI_RANK, PMIX_RANK,
/// OMPI_COMM_WORLD_RANK, MV2_COMM_WORLD_RANK, SLURM_PROCID; the first set wins), 0 when none
/// is set or the value is not a non-negative integer.
int launcher_rank_from_env();

/// Seconds per run of `body` on this rank alone: `warmup` untimed runs, then the mean of
/// `iterations` timed runs, on the host clock for a cpu `device` and with CUDA events on the
/// rank's compute stream for a cuda `device` (bench::GpuTimer).
double time_rank(Device device, int warmup, int iterations, const std::function<void()>& body);

/// Collective over `comm`: `warmup` untimed runs, a barrier, then `iterations` timed runs as
/// time_rank measures them. Returns the slowest rank's mean seconds per run (all_reduce max).
double time_collective(Comm& comm, Device device, int warmup, int iterations,
                       const std::function<void()>& body);

/// One column of a benchmark table: the row field it shows and how.
struct Column {
  std::string key;     ///< field of the row (a JSON object) shown in this column
  std::string name;    ///< header
  std::string unit;    ///< second header line, in parentheses ("" for none)
  int width = 10;      ///< characters (the first column is left-aligned, the others right)
  int precision = -1;  ///< digits after the point of a floating value; -1: the value as it is
  /// The cell's text from the whole row, for cells derived from several fields (optional).
  std::function<std::string(const nlohmann::json& row)> text = {};
};

/// A table of declared columns: prints each row as it is added (when printing) and keeps the
/// rows for the JSON document. A row is a JSON object; fields no column shows go to JSON only.
class BenchTable {
 public:
  /// Prints "# title" and the header when `print`.
  BenchTable(const std::string& title, std::vector<Column> columns, bool print);
  /// Adds `row` and prints it.
  void add(nlohmann::json row);
  /// The rows added so far.
  const nlohmann::json& rows() const { return rows_; }

 private:
  std::string cell(const Column& column, const nlohmann::json& row) const;
  std::vector<Column> columns_;
  bool print_;
  nlohmann::json rows_ = nlohmann::json::array();
};

/// One run of a benchmark: its tables, printed on the reporter, and its JSON document
/// {"benchmark": name, header fields..., "rows": [...], other tables...}, printed by finish()
/// on the reporter when `json`.
class BenchReport {
 public:
  /// `reporter`: is_reporter() of the process (or rank) that holds this report.
  BenchReport(std::string benchmark, bool json, bool reporter);
  /// Sets a header field of the JSON document.
  void set(const std::string& key, nlohmann::json value);
  /// Starts a table whose rows go under `key` of the document ("rows" for the main one).
  BenchTable& table(const std::string& key, const std::string& title, std::vector<Column> columns);
  /// The JSON document as it stands.
  nlohmann::json document() const;
  /// Prints the JSON document (reporter with `json` only).
  void finish() const;
  /// True when this holder prints tables (the reporter without `json`).
  bool printing() const { return reporter_ && !json_; }

 private:
  std::string benchmark_;
  bool json_, reporter_;
  nlohmann::json header_ = nlohmann::json::object();
  std::vector<std::pair<std::string, std::unique_ptr<BenchTable>>> tables_;
};

/// Cell text of a ratio field: "1.234x", or "-" when the field is missing or not positive.
std::string ratio_text(const nlohmann::json& row, const std::string& key, int precision = 3);

}  // namespace tessera::bench
