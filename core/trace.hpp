// Tracing: with TESSERA_TRACE=FILE in the environment (or trace::start(FILE), which the CLI's
// --trace calls), every rank records what it does as complete events of a Chrome / Perfetto
// trace (JSON {"traceEvents": [...]}: open it in ui.perfetto.dev or chrome://tracing): one pid
// per rank (its world rank), one tid per thread, and the categories
//   op (forward and backward of each op), halo (begin, end, adjoint), comm (each collective and
//   send/recv batch, with bytes and peers in args), redistribute, io, optimizer, step.
// Off, a Span costs two relaxed atomic loads (tracing on? a capture() of estimate mode running?).
// On, the launcher runs each rank's body under trace::traced: the rank's events are kept in
// memory, its communicator is wrapped so that every collective is recorded, and when the body
// returns the events of every rank are gathered to world rank 0, which (re)writes FILE with all
// the launches of the process so far.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tessera {
class Comm;
class Tensor;
}  // namespace tessera

namespace tessera::trace {

/// True while tracing is on.
bool enabled();

/// Turns tracing on, writing to `file` (the ranks launched from now on are traced).
void start(const std::string& file);

/// Turns tracing off (what was written stays).
void stop();

/// The trace file ("" when off).
std::string file();

/// One complete event: a category, a name, and `args` (key, JSON value text) recorded from
/// construction to destruction on the calling rank. Does nothing when tracing is off or the
/// calling thread runs no traced rank.
class Span {
 public:
  Span(const char* category, std::string_view name);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  /// Adds an integer argument.
  void arg(std::string_view key, int64_t value);
  /// Adds a floating argument (finite values only: JSON has no inf or nan).
  void real_arg(std::string_view key, double value);
  /// Adds a text argument.
  void arg(std::string_view key, std::string_view value);
  /// True when this span records.
  bool recording() const { return start_ns_ >= 0; }

 private:
  const char* category_;
  std::string name_;
  std::vector<std::pair<std::string, std::string>> args_;
  int64_t start_ns_ = -1;
};

/// The local copies of one traced step of work (a halo exchange, a redistribute): bytes copied
/// (read once, written once) and their contiguous runs (one memcpy each, as copy_strided_host
/// makes them), recorded as `copied_bytes` and `copy_runs` for the cost model. Counts nothing
/// unless its span records, so untraced runs pay no bookkeeping.
class CopyTally {
 public:
  explicit CopyTally(const Span& span) : on_(span.recording()) {}
  /// Counts copying `to` from `from` (same shape; a dense buffer when null).
  void copy(const Tensor& to, const Tensor* from = nullptr);
  /// Counts filling `to`: written, not read, so half a copy's traffic.
  void fill(const Tensor& to);
  /// Adds `copied_bytes` and `copy_runs` to `span`.
  void record(Span& span) const;

 private:
  bool on_;
  int64_t bytes_ = 0, runs_ = 0;
};

/// Runs `body` as traced rank `world->rank()`: with tracing on, on a communicator that records
/// every collective (splits included), then gathers every rank's events to world rank 0, which
/// writes the file. Collective over `world`. With tracing off, just body(world).
void traced(const std::shared_ptr<Comm>& world,
            const std::function<void(std::shared_ptr<Comm>)>& body);

/// The communicator that records each call of `comm` as a comm event (the wrapped one with
/// tracing off).
std::shared_ptr<Comm> recording_comm(std::shared_ptr<Comm> comm);

/// Runs `body` as rank `pid` on `comm` wrapped in the recording communicator, recording its
/// events whether or not tracing is on, and returns them (JSON objects in the trace's format, the
/// rank's process_name first) instead of writing them. Not collective: estimate mode records its
/// simulated ranks this way and writes the events itself.
std::vector<std::string> capture(int pid, std::shared_ptr<Comm> comm,
                                 const std::function<void(std::shared_ptr<Comm>)>& body);

}  // namespace tessera::trace
