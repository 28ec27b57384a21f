// Tracing (core/trace.hpp): per-rank event buffers, the recording communicator, and the gather
// of every rank's events to world rank 0, which writes the Chrome trace.
#include "core/trace.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <numeric>

#include "core/backend/strided_plan.hpp"
#include "core/comm/comm.hpp"
#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/gpu_runtime.hpp"
#include "core/tensor.hpp"

namespace tessera::trace {

namespace {

std::atomic<bool> on{false};
std::atomic<int> capturing{0};  // threads inside capture(): spans record there with tracing off

struct Settings {
  std::mutex mutex;
  std::string file;
  std::vector<std::string> written;  // events of the finished launches, as JSON objects
};

Settings& settings() {
  static Settings* instance = [] {
    auto* created = new Settings;  // never destroyed: spans may run during exit
    if (const char* file = std::getenv("TESSERA_TRACE"); file != nullptr && *file != '\0') {
      created->file = file;
      on.store(true);
    }
    return created;
  }();
  return *instance;
}

/// The events of the rank the calling thread runs (null: not a traced rank).
struct RankEvents {
  int pid = 0;
  std::vector<std::string> events;  // JSON objects
  int64_t next_async = 0;           // ids pairing a started batch or collective with its wait
};
thread_local RankEvents* current = nullptr;

int thread_id() {
  static std::atomic<int> next{0};
  thread_local const int id = next.fetch_add(1);
  return id;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// `text` as a JSON string literal.
std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          out += fmt::format("\\u{:04x}", static_cast<int>(c));
        else
          out += c;
    }
  }
  return out + "\"";
}

/// Writes `events` of every launch so far as the trace file (through a temporary file, renamed).
void write_file(const std::string& file, const std::vector<std::string>& events) {
  const std::string temporary = file + ".partial";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    check_arg(static_cast<bool>(out), "trace", "cannot write the trace file '{}'", file);
    out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
    for (size_t i = 0; i < events.size(); ++i)
      out << events[i] << (i + 1 < events.size() ? ",\n" : "\n");
    out << "]}\n";
    check_arg(static_cast<bool>(out), "trace", "cannot write the trace file '{}'", file);
  }
  std::filesystem::rename(temporary, file);
}

/// Throws unless `file` can be written (its directory exists and is writable, it is not a
/// directory): checked when tracing starts, where every process sees the same name, not only
/// when rank 0 writes at the end.
void check_file(const std::string& file) {
  const std::filesystem::path parent = std::filesystem::absolute(file).parent_path();
  check_arg(std::filesystem::is_directory(parent) && ::access(parent.c_str(), W_OK) == 0, "trace",
            "cannot write the trace file '{}': '{}' is not a writable directory", file,
            parent.string());
  check_arg(!std::filesystem::is_directory(file), "trace",
            "cannot write the trace file '{}': it is a directory", file);
}

/// The buffer of the calling thread's rank while alive.
class RankScope {
 public:
  RankScope(int pid, int ranks, const std::string& backend) : previous_(current) {
    events_.pid = pid;
    events_.events.push_back(fmt::format(
        "{{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": {}, \"tid\": 0, \"args\": "
        "{{\"name\": \"rank {}\"}}}}",
        pid, pid));
    // What the cost model needs to place the rank: the world's size and backend.
    events_.events.push_back(fmt::format(
        "{{\"name\": \"process_labels\", \"ph\": \"M\", \"pid\": {}, \"tid\": 0, \"args\": "
        "{{\"labels\": \"backend={} ranks={}\", \"backend\": {}, \"ranks\": {}}}}}",
        pid, backend, ranks, json_string(backend), ranks));
    current = &events_;
  }
  ~RankScope() { current = previous_; }
  /// Ends the rank's events: the threads its kernels used when the user chose them (read at the
  /// end, since a command may choose them inside its body); an estimate of the trace prices the
  /// rank with them (without, the rank gets its even share of the node's cores).
  void finish() {
    if (const int threads = chosen_compute_threads(); threads > 0)
      events_.events.push_back(fmt::format(
          "{{\"name\": \"rank_threads\", \"ph\": \"M\", \"pid\": {}, \"tid\": 0, \"args\": "
          "{{\"threads\": {}}}}}",
          events_.pid, threads));
  }
  RankScope(const RankScope&) = delete;
  RankScope& operator=(const RankScope&) = delete;
  std::vector<std::string>& events() { return events_.events; }

 private:
  RankEvents events_;
  RankEvents* previous_;
};

/// Total bytes of `counts` elements of `dtype`.
int64_t bytes_of(std::span<const size_t> counts, DType dtype) {
  return static_cast<int64_t>(std::accumulate(counts.begin(), counts.end(), size_t{0}) *
                              dtype_size(dtype));
}

/// ">3:4096 <1:2048": a send of 4096 bytes to rank 3 and a receive of 2048 from rank 1 (ranks
/// of the batch's communicator), in the order of the batch.
std::string peers_text(std::span<const P2POp> ops) {
  std::string text;
  for (const P2POp& op : ops)
    text += fmt::format("{}{}{}:{}", text.empty() ? "" : " ",
                        op.kind == P2POp::Kind::send ? ">" : "<", op.peer, op.bytes);
  return text;
}

/// A new id for a started batch or collective of the calling rank (-1 outside a traced rank).
int64_t next_async_id() {
  return current != nullptr ? current->next_async++ : -1;
}

/// A Comm that records each call as a comm event and forwards it.
class RecordingComm final : public Comm {
 public:
  /// `group`: the communicator's id, the same on every member ("w" for the world; a split's
  /// id is its parent's, the parent's split count and the color, e.g. "w.0c1").
  RecordingComm(std::shared_ptr<Comm> inner, std::string group)
      : inner_(std::move(inner)), group_(std::move(group)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  const Comm& underlying() const override { return inner_->underlying(); }

  std::unique_ptr<P2PBatch> start_send_recv(std::span<const P2POp> ops) override {
    Span span("comm", "send_recv start");
    const int64_t id = span.recording() ? next_async_id() : -1;
    if (span.recording()) {
      int64_t sent = 0, received = 0;
      for (const P2POp& op : ops) (op.kind == P2POp::Kind::send ? sent : received) += op.bytes;
      span.arg("bytes_sent", sent);
      span.arg("bytes_received", received);
      span.arg("peers", peers_text(ops));
      note_group(span);
      span.arg("id", id);
    }
    return std::make_unique<RecordingBatch>(inner_->start_send_recv(ops), id);
  }
  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    Span span("comm", "all_reduce");
    note(span, static_cast<int64_t>(count * dtype_size(dtype)));
    inner_->all_reduce(send, recv, count, dtype, op);
  }
  std::unique_ptr<PendingCollective> start_all_reduce(const void* send, void* recv, size_t count,
                                                      DType dtype, ReduceOp op) override {
    Span span("comm", "all_reduce start");
    note(span, static_cast<int64_t>(count * dtype_size(dtype)));
    const int64_t id = span.recording() ? next_async_id() : -1;
    span.arg("id", id);
    return std::make_unique<RecordingPending>(
        inner_->start_all_reduce(send, recv, count, dtype, op), "all_reduce wait", id);
  }
  std::unique_ptr<PendingCollective> start_all_gather_v(const void* send, size_t send_count,
                                                        void* recv,
                                                        std::span<const size_t> recv_counts,
                                                        DType dtype) override {
    Span span("comm", "all_gather_v start");
    note(span, bytes_of(recv_counts, dtype));
    const int64_t id = span.recording() ? next_async_id() : -1;
    span.arg("id", id);
    return std::make_unique<RecordingPending>(
        inner_->start_all_gather_v(send, send_count, recv, recv_counts, dtype), "all_gather_v wait",
        id);
  }
  void all_gather_v(const void* send, size_t send_count, void* recv,
                    std::span<const size_t> recv_counts, DType dtype) override {
    Span span("comm", "all_gather_v");
    note(span, bytes_of(recv_counts, dtype));
    inner_->all_gather_v(send, send_count, recv, recv_counts, dtype);
  }
  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                        DType dtype, ReduceOp op) override {
    Span span("comm", "reduce_scatter_v");
    note(span, bytes_of(recv_counts, dtype));
    inner_->reduce_scatter_v(send, recv, recv_counts, dtype, op);
  }
  void all_to_all_v(const void* send, std::span<const size_t> send_counts,
                    std::span<const size_t> send_displs, void* recv,
                    std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                    DType dtype) override {
    Span span("comm", "all_to_all_v");
    note(span, bytes_of(send_counts, dtype));
    span.arg("bytes_received", bytes_of(recv_counts, dtype));
    inner_->all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  }
  void all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                    void* recv_base, std::span<const StridedBlock> recv_blocks,
                    DType dtype) override {
    int64_t sent = 0, send_runs = 0, recv_runs = 0;
    const auto runs_of = [](const StridedBlock& block) {
      return strided_copy_runs(block.shape.data(), static_cast<int>(block.shape.size()),
                               block.strides.data(), nullptr);
    };
    for (const StridedBlock& block : send_blocks) {
      sent += static_cast<int64_t>(block.count() * dtype_size(dtype));
      send_runs += runs_of(block);
    }
    for (const StridedBlock& block : recv_blocks) recv_runs += runs_of(block);
    Span span("comm", "all_to_all_w");
    note(span, sent);
    // The contiguous runs of the strided blocks on the side that has more of them.
    span.arg("runs", std::max(send_runs, recv_runs));
    inner_->all_to_all_w(send_base, send_blocks, recv_base, recv_blocks, dtype);
  }
  void broadcast(void* buffer, size_t count, DType dtype, int root) override {
    Span span("comm", "broadcast");
    note(span, static_cast<int64_t>(count * dtype_size(dtype)));
    span.arg("root", root);
    inner_->broadcast(buffer, count, dtype, root);
  }
  void scatter_v(const void* send, std::span<const size_t> send_counts, void* recv,
                 size_t recv_count, DType dtype, int root) override {
    Span span("comm", "scatter_v");
    note(span, static_cast<int64_t>(recv_count * dtype_size(dtype)));
    span.arg("root", root);
    inner_->scatter_v(send, send_counts, recv, recv_count, dtype, root);
  }
  void gather_v(const void* send, size_t send_count, void* recv,
                std::span<const size_t> recv_counts, DType dtype, int root) override {
    Span span("comm", "gather_v");
    note(span, static_cast<int64_t>(send_count * dtype_size(dtype)));
    span.arg("root", root);
    inner_->gather_v(send, send_count, recv, recv_counts, dtype, root);
  }
  void barrier() override {
    Span span("comm", "barrier");
    note(span, 0);
    inner_->barrier();
  }
  std::shared_ptr<Comm> split(int color, int key) override {
    Span span("comm", "split");
    note(span, 0);
    // Every member of this communicator splits it in the same order, so the count and the color
    // name the part alike on each of its members.
    const std::string child = fmt::format("{}.{}c{}", group_, splits_++, color);
    std::shared_ptr<Comm> part = inner_->split(color, key);
    if (part && span.recording()) {
      span.arg("child", child);
      span.arg("child_rank", part->rank());
      span.arg("child_ranks", part->size());
    }
    return part ? std::make_shared<RecordingComm>(std::move(part), child) : nullptr;
  }

 private:
  /// The wait of a send/recv batch, recorded when it happens.
  class RecordingBatch final : public P2PBatch {
   public:
    RecordingBatch(std::unique_ptr<P2PBatch> inner, int64_t id)
        : inner_(std::move(inner)), id_(id) {}
    void wait() override {
      Span span("comm", "send_recv wait");
      span.arg("id", id_);
      inner_->wait();
    }

   private:
    std::unique_ptr<P2PBatch> inner_;
    int64_t id_;
  };

  /// The wait of a started collective, recorded when it happens (or when dropped unwaited).
  class RecordingPending final : public PendingCollective {
   public:
    RecordingPending(std::unique_ptr<PendingCollective> inner, const char* name, int64_t id)
        : inner_(std::move(inner)), name_(name), id_(id) {}
    ~RecordingPending() override {
      if (!waited_) {
        Span span("comm", name_);
        span.arg("id", id_);
        inner_.reset();  // the inner one waits when destroyed
      }
    }
    void wait() override {
      Span span("comm", name_);
      span.arg("id", id_);
      waited_ = true;
      inner_->wait();
    }

   private:
    std::unique_ptr<PendingCollective> inner_;
    const char* name_;
    int64_t id_;
    bool waited_ = false;
  };

  /// The communicator's id, size and this rank's rank in it: what matches a collective across
  /// its members and places them on the modeled machine.
  void note_group(Span& span) const {
    span.arg("group", group_);
    span.arg("ranks", inner_->size());
    span.arg("rank", inner_->rank());
  }

  void note(Span& span, int64_t bytes) const {
    if (!span.recording()) return;
    span.arg("bytes", bytes);
    note_group(span);
  }

  std::shared_ptr<Comm> inner_;
  std::string group_;
  int splits_ = 0;
};

}  // namespace

bool enabled() {
  settings();  // reads TESSERA_TRACE once
  return on.load(std::memory_order_relaxed);
}

void start(const std::string& file) {
  check_arg(!file.empty(), "trace", "the trace file name is empty");
  check_file(file);
  Settings& s = settings();
  std::lock_guard lock(s.mutex);
  s.file = file;
  s.written.clear();
  on.store(true);
}

void stop() {
  Settings& s = settings();
  std::lock_guard lock(s.mutex);
  on.store(false);
  s.written.clear();
}

std::string file() {
  Settings& s = settings();
  std::lock_guard lock(s.mutex);
  return on.load() ? s.file : std::string();
}

Span::Span(const char* category, std::string_view name) : category_(category) {
  if ((!on.load(std::memory_order_relaxed) && capturing.load(std::memory_order_relaxed) == 0) ||
      current == nullptr)
    return;
  name_ = name;
  gpu::range_push(name_.c_str());  // the same range for Nsight Systems on cuda builds
  start_ns_ = now_ns();
}

Span::~Span() {
  if (start_ns_ < 0) return;
  const int64_t end = now_ns();
  gpu::range_pop();
  if (current == nullptr) return;
  std::string args;
  for (const auto& [key, value] : args_)
    args += fmt::format("{}{}: {}", args.empty() ? "" : ", ", json_string(key), value);
  current->events.push_back(fmt::format(
      "{{\"name\": {}, \"cat\": \"{}\", \"ph\": \"X\", \"ts\": {:.3f}, \"dur\": {:.3f}, \"pid\": "
      "{}, \"tid\": {}, \"args\": {{{}}}}}",
      json_string(name_), category_, static_cast<double>(start_ns_) / 1e3,
      static_cast<double>(end - start_ns_) / 1e3, current->pid, thread_id(), args));
}

void CopyTally::copy(const Tensor& to, const Tensor* from) {
  if (!on_) return;
  bytes_ += static_cast<int64_t>(to.nbytes());
  runs_ += strided_copy_runs(to.shape().data(), to.ndim(), to.strides().data(),
                             from ? from->strides().data() : nullptr);
}

void CopyTally::fill(const Tensor& to) {
  if (!on_) return;
  bytes_ += static_cast<int64_t>(to.nbytes()) / 2;
  runs_ += strided_copy_runs(to.shape().data(), to.ndim(), to.strides().data(), nullptr);
}

void CopyTally::record(Span& span) const {
  if (!on_) return;
  span.arg("copied_bytes", bytes_);
  span.arg("copy_runs", runs_);
}

void Span::arg(std::string_view key, int64_t value) {
  if (recording()) args_.emplace_back(std::string(key), fmt::format("{}", value));
}

void Span::real_arg(std::string_view key, double value) {
  if (recording()) args_.emplace_back(std::string(key), fmt::format("{:.9g}", value));
}

void Span::arg(std::string_view key, std::string_view value) {
  if (recording()) args_.emplace_back(std::string(key), json_string(value));
}

std::shared_ptr<Comm> recording_comm(std::shared_ptr<Comm> comm) {
  if (!enabled() || comm == nullptr) return comm;
  return std::make_shared<RecordingComm>(std::move(comm), "w");
}

std::vector<std::string> capture(int pid, std::shared_ptr<Comm> comm,
                                 const std::function<void(std::shared_ptr<Comm>)>& body) {
  capturing.fetch_add(1);
  struct Release {
    ~Release() { capturing.fetch_sub(1); }
  } release;
  RankScope scope(pid, comm->size(), comm->backend());
  body(std::make_shared<RecordingComm>(std::move(comm), "w"));
  scope.finish();
  return std::move(scope.events());
}

void traced(const std::shared_ptr<Comm>& world,
            const std::function<void(std::shared_ptr<Comm>)>& body) {
  if (!enabled()) {
    body(world);
    return;
  }
  check_file(file());  // TESSERA_TRACE is read here first: a bad name fails before any work
  RankScope scope(world->rank(), world->size(), world->backend());
  body(recording_comm(world));
  scope.finish();
  // Every rank's events, as one text each, to world rank 0 (outside any span).
  std::string mine;
  for (size_t i = 0; i < scope.events().size(); ++i)
    mine += scope.events()[i] + (i + 1 < scope.events().size() ? ",\n" : "");
  const size_t length = mine.size();
  std::vector<size_t> lengths(static_cast<size_t>(world->size()));
  world->all_gather_v(&length, 1, lengths.data(), std::vector<size_t>(world->size(), 1),
                      DType::i64);
  std::string all(
      world->rank() == 0 ? std::accumulate(lengths.begin(), lengths.end(), size_t{0}) : 0, '\0');
  world->gather_v(mine.data(), length, all.data(), lengths, DType::u8, 0);
  if (world->rank() != 0) return;
  Settings& s = settings();
  std::lock_guard lock(s.mutex);
  size_t offset = 0;
  for (size_t length_of_rank : lengths) {
    if (length_of_rank > 0) s.written.push_back(all.substr(offset, length_of_rank));
    offset += length_of_rank;
  }
  write_file(s.file, s.written);
}

}  // namespace tessera::trace
