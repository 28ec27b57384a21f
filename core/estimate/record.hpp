// Recording a program in estimate mode: P simulated ranks run it on shape-only tensors over the
// simulated communicator, each with the trace's recording communicator around it, and every
// rank's events (the Chrome trace events a real traced run writes) and peak tensor bytes come
// back. The cost model replays these events on a modeled cluster.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/comm.hpp"

namespace tessera::estimate {

/// What a recording produced, per rank.
struct Recording {
  int ranks = 0;
  /// Per rank: its trace events (JSON objects, its process_name first), in the order recorded.
  std::vector<std::vector<std::string>> events;
  /// Per rank: the most bytes of tensor storage it held at once (shape-only or real).
  std::vector<size_t> peak_bytes;
  /// {"displayTimeUnit": "ms", "traceEvents": [...], "peak_bytes_per_rank": [...]}.
  std::string json() const;
  /// Adds another launch of `ranks` ranks (events appended, peaks the larger).
  void add(Recording other);
};

/// Runs `program` on `ranks` (1 to kMaxSimulatedRanks) simulated ranks in estimate mode and
/// returns every rank's events and peak tensor bytes. No tensor data is allocated and no payload
/// moves; metadata (counts, shapes, agreed errors) is exchanged for real. A path without an
/// estimate mode raises "[estimate] ... touched tensor data" (on every rank that reached it).
Recording record(int ranks, const std::function<void(std::shared_ptr<Comm>)>& program);

/// The same recording of a real run on `ranks` local ranks (data allocated, kernels run,
/// messages moved), whether or not tracing is on: what record() must reproduce.
Recording record_local(int ranks, const std::function<void(std::shared_ptr<Comm>)>& program);

/// While alive, tessera::launch (core/comm/launch.hpp) does not run its program for real: it
/// records it with record() on the launch's rank count, which must equal `ranks`, and adds the
/// result here. Process-wide; one at a time.
class RecordLaunches {
 public:
  explicit RecordLaunches(int ranks);
  ~RecordLaunches();
  RecordLaunches(const RecordLaunches&) = delete;
  RecordLaunches& operator=(const RecordLaunches&) = delete;
  /// Everything the launches so far recorded.
  const Recording& recording() const { return recording_; }
  /// Number of launches recorded.
  int launches() const { return launches_; }

 private:
  friend bool record_launch(int, const std::function<void(std::shared_ptr<Comm>)>&);
  int ranks_;
  int launches_ = 0;
  Recording recording_;
};

/// True while a RecordLaunches is alive (the CLI then allows worlds of up to kMaxSimulatedRanks).
bool recording_launches();

/// Called by launch(): with a RecordLaunches alive, records `program` on `ranks` simulated ranks
/// and returns true; otherwise returns false (launch runs it for real).
bool record_launch(int ranks, const std::function<void(std::shared_ptr<Comm>)>& program);

}  // namespace tessera::estimate
