// Recording programs in estimate mode (see record.hpp).
#include "core/estimate/record.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>

#include "core/comm/local_comm.hpp"
#include "core/errors.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/estimate/sim_comm.hpp"
#include "core/trace.hpp"

namespace tessera::estimate {

namespace {

std::atomic<RecordLaunches*> active_launches{nullptr};

/// Slots for every rank's results, each written by its own rank thread only.
Recording empty_recording(int ranks) {
  Recording recording;
  recording.ranks = ranks;
  recording.events.resize(ranks);
  recording.peak_bytes.assign(ranks, 0);
  return recording;
}

}  // namespace

std::string Recording::json() const {
  std::string text = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  for (const std::vector<std::string>& rank_events : events) {
    for (const std::string& event : rank_events) {
      text += first ? "" : ",\n";
      text += event;
      first = false;
    }
  }
  text += fmt::format("\n],\n\"peak_bytes_per_rank\": [{}]}}\n", fmt::join(peak_bytes, ", "));
  return text;
}

void Recording::add(Recording other) {
  if (events.empty()) {
    *this = std::move(other);
    return;
  }
  check_arg(other.ranks == ranks, "estimate", "a launch of {} ranks after one of {}", other.ranks,
            ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    // The rank's process_name (its first event) is already there.
    auto& mine = events[rank];
    auto& theirs = other.events[rank];
    mine.insert(mine.end(), std::make_move_iterator(theirs.begin() + (theirs.empty() ? 0 : 1)),
                std::make_move_iterator(theirs.end()));
    peak_bytes[rank] = std::max(peak_bytes[rank], other.peak_bytes[rank]);
  }
}

Recording record(int ranks, const std::function<void(std::shared_ptr<Comm>)>& program) {
  Recording recording = empty_recording(ranks);
  run_simulated_ranks(ranks, [&](int rank, std::shared_ptr<Comm> world) {
    auto bytes = std::make_shared<TensorBytes>();
    {
      Scope estimating(bytes);
      recording.events[rank] = trace::capture(rank, std::move(world), program);
    }
    recording.peak_bytes[rank] = bytes->peak.load();
  });
  return recording;
}

Recording record_local(int ranks, const std::function<void(std::shared_ptr<Comm>)>& program) {
  Recording recording = empty_recording(ranks);
  run_local_ranks(ranks, [&](std::shared_ptr<Comm> world) {
    const int rank = world->rank();
    auto bytes = std::make_shared<TensorBytes>();
    {
      CountScope counting(bytes);
      recording.events[rank] = trace::capture(rank, std::move(world), program);
    }
    recording.peak_bytes[rank] = bytes->peak.load();
  });
  return recording;
}

RecordLaunches::RecordLaunches(int ranks) : ranks_(ranks) {
  check_arg(ranks > 0 && ranks <= kMaxSimulatedRanks, "estimate", "--ranks {} (expected 1 to {})",
            ranks, kMaxSimulatedRanks);
  RecordLaunches* expected = nullptr;
  check_arg(active_launches.compare_exchange_strong(expected, this), "estimate",
            "launches are already being recorded");
}

RecordLaunches::~RecordLaunches() {
  active_launches.store(nullptr);
}

bool recording_launches() {
  return active_launches.load() != nullptr;
}

bool record_launch(int ranks, const std::function<void(std::shared_ptr<Comm>)>& program) {
  RecordLaunches* launches = active_launches.load();
  if (launches == nullptr) return false;
  check_arg(ranks == launches->ranks_, "estimate",
            "the command runs on {} ranks (its --ranks or --mesh), the estimate asks for {}: "
            "give both the same count",
            ranks, launches->ranks_);
  launches->recording_.add(record(ranks, program));
  ++launches->launches_;
  return true;
}

}  // namespace tessera::estimate
