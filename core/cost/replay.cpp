// The replay of a trace on a modeled machine (core/cost/cost_model.hpp): each rank's events
// become a sequence of actions (compute, collective, message batch start and wait, step marks),
// which a discrete-event simulation runs over all ranks at once.
#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "core/cost/cost_model.hpp"
#include "core/errors.hpp"

namespace tessera::cost {

namespace {

constexpr const char* kOp = "estimate";

struct Event {
  std::string name, cat;
  double ts = 0, end = 0;  // microseconds
  const nlohmann::json* args = nullptr;
  std::vector<size_t> children;
};

double number_arg(const Event& event, const char* key, double fallback = 0) {
  if (event.args == nullptr || !event.args->contains(key)) return fallback;
  const nlohmann::json& value = event.args->at(key);
  check_arg(value.is_number(), kOp, "trace: event '{}' has a non-numeric '{}'", event.name, key);
  return value.get<double>();
}

std::string text_arg(const Event& event, const char* key, const std::string& fallback = "") {
  if (event.args == nullptr || !event.args->contains(key)) return fallback;
  const nlohmann::json& value = event.args->at(key);
  check_arg(value.is_string(), kOp, "trace: event '{}' has a non-text '{}'", event.name, key);
  return value.get<std::string>();
}

struct Message {
  bool send = false;
  int peer = 0;  // rank in the batch's communicator
  double bytes = 0;
};

struct Action {
  enum class Kind : uint8_t {
    compute,
    collective,
    collective_wait,
    p2p_start,
    p2p_wait,
    step_begin,
    step_end,
    call_begin,
    call_end
  };
  Kind kind = Kind::compute;
  double seconds = 0;  // compute
  Collective collective = Collective::barrier;
  bool asynchronous = false;
  std::string group{};
  int group_rank = 0, group_size = 1, root = 0;
  double bytes = 0;
  double runs = 0;  // contiguous runs of a strided collective's blocks (all_to_all_w)
  int64_t id = -1;
  std::vector<Message> messages{};
  std::string name{};
};

/// Parses "peers": ">3:4096 <1:2048" (bytes missing in older traces: the batch's totals spread
/// evenly over its sends or receives).
std::vector<Message> parse_peers(const Event& event) {
  std::vector<Message> messages{};
  std::istringstream stream(text_arg(event, "peers"));
  std::string token;
  int unsized_sends = 0, unsized_recvs = 0;
  while (stream >> token) {
    check_arg(token.size() >= 2 && (token[0] == '>' || token[0] == '<'), kOp,
              "trace: '{}' in the peers of '{}' is not >RANK:BYTES or <RANK:BYTES", token,
              event.name);
    Message message;
    message.send = token[0] == '>';
    const size_t colon = token.find(':');
    try {
      message.peer =
          std::stoi(token.substr(1, colon == std::string::npos ? std::string::npos : colon - 1));
      message.bytes = colon == std::string::npos ? -1 : std::stod(token.substr(colon + 1));
    } catch (const std::exception&) {
      throw InvalidArgument(kOp, fmt::format("trace: '{}' in the peers of '{}' is not "
                                             ">RANK:BYTES or <RANK:BYTES",
                                             token, event.name));
    }
    if (message.bytes < 0) (message.send ? unsized_sends : unsized_recvs) += 1;
    messages.push_back(message);
  }
  for (Message& message : messages)
    if (message.bytes < 0)
      message.bytes = message.send ? number_arg(event, "bytes_sent") / unsized_sends
                                   : number_arg(event, "bytes_received") / unsized_recvs;
  return messages;
}

/// One rank's events as a forest (by time containment) and the actions they become.
class RankProgram {
 public:
  RankProgram(std::vector<Event> events, const Machine& machine, double share, double load,
              bool asynchronous)
      : events_(std::move(events)),
        machine_(machine),
        share_(share),
        load_(load),
        asynchronous_(asynchronous) {
    std::stable_sort(events_.begin(), events_.end(), [](const Event& a, const Event& b) {
      return a.ts != b.ts ? a.ts < b.ts : a.end > b.end;
    });
    // A small tolerance: times are printed to the nanosecond.
    constexpr double kSlack = 0.002;
    std::vector<size_t> roots, stack;
    for (size_t i = 0; i < events_.size(); ++i) {
      // Sorted by start, an event lies inside the innermost open one that ends after it.
      while (!stack.empty() && events_[i].end > events_[stack.back()].end + kSlack)
        stack.pop_back();
      (stack.empty() ? roots : events_[stack.back()].children).push_back(i);
      stack.push_back(i);
    }
    for (size_t root : roots) visit(root);
  }

  std::vector<Action>& actions() { return actions_; }
  double share() const { return share_; }

 private:
  void compute(double seconds, const std::string& name) {
    if (seconds <= 0) return;
    Action action;
    action.kind = Action::Kind::compute;
    action.seconds = seconds;
    action.name = name;
    actions_.push_back(std::move(action));
  }

  double copy_seconds(double bytes, double runs = 0) const {
    return cost::copy_seconds(machine_, bytes, share_, runs);
  }
  /// The bytes and runs a halo or redistribute event copied (`copied_bytes`, `copy_runs`), or
  /// `fallback` bytes in one run per message for a trace that did not record them.
  double recorded_copy(const Event& event, double fallback) const {
    if (event.args == nullptr || !event.args->contains("copied_bytes"))
      return copy_seconds(fallback);
    return copy_seconds(number_arg(event, "copied_bytes"), number_arg(event, "copy_runs"));
  }

  void visit_children(const Event& event, size_t from = 0, size_t to = SIZE_MAX) {
    for (size_t c = from; c < event.children.size() && c < to; ++c) visit(event.children[c]);
  }

  void group_of(const Event& event, Action& action) const {
    action.group = text_arg(event, "group", "w");
    action.group_size = static_cast<int>(number_arg(event, "ranks", 1));
    action.group_rank = static_cast<int>(number_arg(event, "rank", -1));
  }

  void visit(size_t index) {
    const Event& event = events_[index];
    if (event.cat == "step") {
      actions_.push_back({.kind = Action::Kind::step_begin, .name = event.name});
      visit_children(event);
      actions_.push_back({.kind = Action::Kind::step_end, .name = event.name});
      return;
    }
    if (event.cat == "op" && event.args != nullptr &&
        (event.args->contains("flops") || event.args->contains("bytes"))) {
      const double seconds = event_seconds(machine_, event.name, number_arg(event, "flops"),
                                           number_arg(event, "bytes"), share_, load_);
      const double interior = std::clamp(number_arg(event, "interior"), 0.0, 1.0);
      if (interior > 0) {  // the interior runs while the halos travel: before the first halo_end
        size_t split = event.children.size();
        for (size_t c = 0; c < event.children.size(); ++c)
          if (events_[event.children[c]].name == "halo_end") {
            split = c;
            break;
          }
        visit_children(event, 0, split);
        compute(interior * seconds, event.name);
        visit_children(event, split);
        compute((1 - interior) * seconds, event.name);
      } else {
        visit_children(event);
        compute(seconds, event.name);
      }
      return;
    }
    if (event.cat == "halo" && event.name == "halo_begin") {
      double packed = 0;  // the sends are packed before they are posted
      for (size_t child : event.children)
        if (events_[child].name == "send_recv start")
          packed += number_arg(events_[child], "bytes_sent");
      compute(recorded_copy(event, packed), "halo pack");
      visit_children(event);
      return;
    }
    if (event.cat == "halo" && event.name == "halo_fill") {  // an interior copied by its op
      compute(recorded_copy(event, 0), "halo fill");
      return;
    }
    if (event.cat == "halo" && event.name == "halo_end") {
      visit_children(event);
      double unpacked = 0;
      for (size_t child : event.children)
        if (events_[child].name == "send_recv wait")
          if (auto it = received_.find(static_cast<int64_t>(number_arg(events_[child], "id", -1)));
              it != received_.end())
            unpacked += it->second;
      compute(recorded_copy(event, unpacked), "halo unpack");
      return;
    }
    if (event.cat == "redistribute") {
      const std::string call =
          "redistribute " + text_arg(event, "from") + " -> " + text_arg(event, "to");
      actions_.push_back({.kind = Action::Kind::call_begin, .name = call});
      visit_children(event);
      // What the redistribute copied outside its collectives (traces before `copied_bytes`:
      // its local tensor's bytes).
      compute(recorded_copy(event, number_arg(event, "local_bytes")), "redistribute copy");
      actions_.push_back({.kind = Action::Kind::call_end, .name = call});
      return;
    }
    if (event.cat == "comm") {
      Collective collective;
      if (event.name == "send_recv start") {
        Action action{.kind = Action::Kind::p2p_start, .name = event.name};
        group_of(event, action);
        action.id = static_cast<int64_t>(number_arg(event, "id", -1));
        action.messages = parse_peers(event);
        received_[action.id] = number_arg(event, "bytes_received");
        actions_.push_back(std::move(action));
        return;
      }
      if (event.name == "send_recv wait") {
        actions_.push_back({.kind = Action::Kind::p2p_wait,
                            .id = static_cast<int64_t>(number_arg(event, "id", -1)),
                            .name = event.name});
        return;
      }
      if (event.name.ends_with(" wait")) {
        if (asynchronous_)
          actions_.push_back({.kind = Action::Kind::collective_wait,
                              .id = static_cast<int64_t>(number_arg(event, "id", -1)),
                              .name = event.name});
        return;
      }
      if (collective_of(event.name, collective)) {
        Action action{
            .kind = Action::Kind::collective, .collective = collective, .name = event.name};
        action.asynchronous = asynchronous_ && event.name.ends_with(" start");
        group_of(event, action);
        action.bytes = number_arg(event, "bytes");
        action.runs = number_arg(event, "runs");
        action.root = static_cast<int>(number_arg(event, "root", 0));
        action.id = static_cast<int64_t>(number_arg(event, "id", -1));
        actions_.push_back({.kind = Action::Kind::call_begin, .name = event.name});
        actions_.push_back(std::move(action));
        actions_.push_back({.kind = Action::Kind::call_end, .name = event.name});
        return;
      }
    }
    visit_children(event);
  }

  std::vector<Event> events_;
  const Machine& machine_;
  double share_;
  double load_;  // how busy the rank's node is (event_seconds)
  bool asynchronous_;
  std::vector<Action> actions_;
  std::map<int64_t, double> received_;  // bytes received by each started batch
};

struct Launch {
  std::map<int, std::vector<Event>> events;  // by pid
  std::map<int, std::string> backends;
  std::map<int, int> threads;  // by pid: the threads the rank chose (absent: its default share)
};

std::vector<Launch> launches_of(const nlohmann::json& trace) {
  const nlohmann::json* list = &trace;
  if (trace.is_object()) {
    check_arg(trace.contains("traceEvents") && trace.at("traceEvents").is_array(), kOp,
              "trace: no 'traceEvents' array (not a Chrome trace written by --trace?)");
    list = &trace.at("traceEvents");
  }
  check_arg(list->is_array(), kOp, "trace: neither an object with 'traceEvents' nor an array");
  std::vector<Launch> launches(1);
  for (const nlohmann::json& entry : *list) {
    check_arg(entry.is_object() && entry.contains("ph") && entry.at("ph").is_string() &&
                  entry.contains("pid") && entry.at("pid").is_number_integer(),
              kOp, "trace: an event without 'ph' or an integer 'pid': {}", entry.dump());
    const std::string ph = entry.at("ph").get<std::string>();
    const int pid = entry.at("pid").get<int>();
    check_arg(pid >= 0, kOp, "trace: negative pid {}", pid);
    const std::string name = entry.value("name", std::string());
    if (ph == "M") {
      if (name == "process_name") {
        // Each launch lists every rank again: a rank seen before starts the next launch.
        if (launches.back().events.count(pid) == 1) launches.emplace_back();
        launches.back().events[pid];
      } else if (name == "process_labels" && entry.contains("args")) {
        launches.back().backends[pid] = entry.at("args").value("backend", std::string());
      } else if (name == "rank_threads" && entry.contains("args")) {
        const int threads = entry.at("args").value("threads", 0);
        check_arg(threads > 0, kOp, "trace: rank_threads of pid {} is not a positive count", pid);
        launches.back().threads[pid] = threads;
      }
      continue;
    }
    if (ph != "X") continue;
    check_arg(entry.contains("ts") && entry.at("ts").is_number() && entry.contains("dur") &&
                  entry.at("dur").is_number(),
              kOp, "trace: a complete event without numeric 'ts' and 'dur': {}", entry.dump());
    Event event;
    event.name = name;
    event.cat = entry.value("cat", std::string());
    event.ts = entry.at("ts").get<double>();
    event.end = event.ts + entry.at("dur").get<double>();
    if (entry.contains("args")) {
      check_arg(entry.at("args").is_object(), kOp, "trace: 'args' of '{}' is not an object", name);
      event.args = &entry.at("args");
    }
    launches.back().events[pid].push_back(std::move(event));
  }
  return launches;
}

/// Collective instances: the n-th call on a group by each of its members.
struct Instance {
  Collective collective = Collective::barrier;
  std::string name{};
  int expected = 0, arrived = 0, root = 0;
  std::vector<double> bytes;  // by group rank
  std::vector<int> members;   // world ranks by group rank
  double runs = 0;            // the most contiguous runs of one member's strided blocks
  double last = 0, done = -1, seconds = 0;
};

struct Post {
  double time = 0, bytes = 0, offset = 0;  // offset: the sender's earlier bytes in its batch
  size_t batch = 0;
  int world = 0;
};

struct Batch {
  int pending = 0;
  double posted = 0, done = 0;
};

struct RankState {
  size_t pc = 0;
  double t = 0;
  bool arrived = false;  // registered at the blocking collective it stands at
  std::pair<std::string, int64_t> at_instance;
  std::map<std::string, int64_t> sequence;                                 // per group
  std::map<int64_t, std::pair<std::string, int64_t>> pending_collectives;  // by id
  std::map<int64_t, size_t> batches;                                       // by id
  std::vector<double> step_begin_stack, call_begin_stack;
  std::vector<double> steps;
  int step_depth = 0;
  RankTimes total, in_steps;
};

}  // namespace

Prediction replay(const nlohmann::json& trace, const Machine& machine,
                  const ReplayOptions& options) {
  std::vector<Launch> launches = launches_of(trace);
  while (launches.size() > 1 && launches.back().events.empty()) launches.pop_back();
  const int which = options.launch < 0 ? static_cast<int>(launches.size()) - 1 : options.launch;
  check_arg(which >= 0 && which < static_cast<int>(launches.size()), kOp,
            "trace: launch {} does not exist (the trace holds {})", options.launch,
            launches.size());
  Launch& launch = launches[static_cast<size_t>(which)];
  check_arg(!launch.events.empty(), kOp, "trace: no rank recorded any event");
  const int ranks = static_cast<int>(launch.events.size());
  check_arg(launch.events.rbegin()->first == ranks - 1, kOp,
            "trace: the ranks' pids are not 0..{} (pid {} present)", ranks - 1,
            launch.events.rbegin()->first);

  std::string backend = options.backend;
  if (backend.empty()) {
    const std::string traced = launch.backends.empty() ? "" : launch.backends.begin()->second;
    backend = machine.links.count(traced) == 1 ? traced : machine.backend;
  }
  check_arg(machine.links.count(backend) == 1, kOp, "machine '{}' has no links for backend '{}'",
            machine.name, backend);
  const LinkSet& links = machine.links.at(backend);
  const auto node_of = [&](int world) { return world / machine.ranks_per_node; };
  const auto link_between = [&](int a, int b) -> const Link& {
    return node_of(a) == node_of(b) ? links.intra : links.inter;
  };
  std::map<int, int> per_node;
  for (int r = 0; r < ranks; ++r) ++per_node[node_of(r)];
  // Within a node of a machine whose ranks share its cores, the local and MPI backends copy
  // with the ranks' cores: k ranks on c < k cores copy c at a time.
  const bool cores_copy =
      machine.shared_compute && machine.cores_per_node > 0 &&
      (links.algorithm == Algorithm::direct || links.algorithm == Algorithm::mpi);
  const auto contention_on = [&](int node) {
    return cores_copy ? std::max(1.0, static_cast<double>(per_node[node]) / machine.cores_per_node)
                      : 1.0;
  };

  // Who is in which communicator: the world, and each split as its members recorded it.
  std::map<std::string, std::vector<int>> members;
  members["w"].resize(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) members["w"][static_cast<size_t>(r)] = r;
  for (const auto& [pid, events] : launch.events)
    for (const Event& event : events) {
      if (event.cat != "comm" || event.args == nullptr) continue;
      const auto note = [&, pid = pid](const std::string& group, double rank, double size) {
        if (group.empty() || group == "w" || rank < 0 || size < 1) return;
        std::vector<int>& list = members[group];
        if (list.size() < static_cast<size_t>(size)) list.resize(static_cast<size_t>(size), -1);
        if (rank < size) list[static_cast<size_t>(rank)] = pid;
      };
      note(text_arg(event, "group"), number_arg(event, "rank", -1), number_arg(event, "ranks", 0));
      note(text_arg(event, "child"), number_arg(event, "child_rank", -1),
           number_arg(event, "child_ranks", 0));
    }
  const auto world_of = [&](const std::string& group, int rank) {
    const auto it = members.find(group);
    if (it == members.end() || rank < 0 || rank >= static_cast<int>(it->second.size())) return -1;
    return it->second[static_cast<size_t>(rank)];
  };

  // Ranks per node share its compute on a machine whose ranks share cores. How busy a node is
  // (its cores in use: the threads its ranks chose, else all of them) picks, per op, between the
  // rate of one core alone and that of a full node (event_seconds).
  const int cores = machine.cores_per_node;
  std::map<int, double> busy;  // by node: the cores its ranks' threads occupy
  for (const auto& [pid, events] : launch.events) {
    const auto chosen = launch.threads.find(pid);
    busy[node_of(pid)] += chosen != launch.threads.end()
                              ? chosen->second
                              : std::max(1.0, static_cast<double>(cores) / per_node[node_of(pid)]);
  }
  std::vector<RankProgram> programs;
  programs.reserve(static_cast<size_t>(ranks));
  for (auto& [pid, events] : launch.events) {
    double share = machine.shared_compute ? 1.0 / per_node[node_of(pid)] : 1.0;
    double load = 1;
    if (const auto chosen = launch.threads.find(pid);
        machine.shared_compute && cores > 0 && chosen != launch.threads.end())
      share = std::min(share, static_cast<double>(chosen->second) / cores);
    if (machine.shared_compute && cores > 1)
      load = (std::min<double>(cores, busy[node_of(pid)]) - 1) / (cores - 1);
    programs.emplace_back(std::move(events), machine, share, load, links.asynchronous);
  }

  std::map<std::pair<std::string, int64_t>, Instance> instances;
  std::map<std::tuple<std::string, int, int>, std::pair<std::deque<Post>, std::deque<Post>>>
      channels;
  std::vector<Batch> batches;
  std::vector<RankState> states(static_cast<size_t>(ranks));
  std::map<std::string, CallTimes> calls;
  std::map<std::string, int64_t> algorithms;

  const auto complete = [&](Instance& instance) {
    const int p = instance.expected;
    bool crosses = false;
    for (int m : instance.members)
      crosses = crosses || m < 0 || node_of(m) != node_of(instance.members[0]);
    const std::span<const double> bytes(instance.bytes.data(), static_cast<size_t>(p));
    if (links.algorithm == Algorithm::nccl) {
      // NCCL's tuner sees how many nodes the communicator spans (a member not recorded counts
      // as one more node, as `crosses` does).
      std::set<int> nodes;
      int unknown = 0;
      for (int m : instance.members)
        if (m < 0)
          ++unknown;
        else
          nodes.insert(node_of(m));
      const NcclChoice choice =
          nccl_collective(links, instance.collective, bytes,
                          static_cast<int>(nodes.size()) + unknown, instance.root);
      instance.seconds = choice.seconds;
      if (p > 1) {
        std::string_view collective = instance.name;
        if (collective.ends_with(" start")) collective.remove_suffix(6);
        ++algorithms[fmt::format("{} {}", collective, nccl_algorithm_name(choice.algorithm))];
      }
    } else {
      const double contention = crosses ? 1.0 : contention_on(node_of(instance.members[0]));
      instance.seconds = collective_seconds(links.algorithm, crosses ? links.inter : links.intra,
                                            instance.collective, bytes, instance.root, contention);
      // Strided blocks (all_to_all_w) are copied by the cores one run at a time.
      if (links.algorithm == Algorithm::direct || links.algorithm == Algorithm::mpi)
        instance.seconds += instance.runs * machine.copy_run_seconds * contention;
    }
    instance.done = instance.last + instance.seconds;
  };
  const auto arrive = [&](int rank, RankState& state, const Action& action) {
    const int64_t n = state.sequence[action.group]++;
    const auto key = std::make_pair(action.group, n);
    Instance& instance = instances[key];
    if (instance.expected == 0) {
      instance.expected = std::max(1, action.group_size);
      instance.collective = action.collective;
      instance.name = action.name;
      instance.root = action.root;
      instance.bytes.assign(static_cast<size_t>(instance.expected), 0);
      instance.members.assign(static_cast<size_t>(instance.expected), -1);
    }
    check_arg(instance.collective == action.collective, kOp,
              "trace: rank {} calls {} where another member of its communicator called {} "
              "(call {} on group {})",
              rank, action.name, instance.name, n, action.group);
    const int at = action.group_rank >= 0 ? action.group_rank : instance.arrived;
    instance.runs = std::max(instance.runs, action.runs);
    if (at < instance.expected) {
      instance.bytes[static_cast<size_t>(at)] = action.bytes;
      instance.members[static_cast<size_t>(at)] = rank;
    }
    instance.last = std::max(instance.last, state.t);
    if (++instance.arrived == instance.expected) complete(instance);
    return key;
  };
  const auto match = [&](const std::tuple<std::string, int, int>& channel_key) {
    auto& [sends, recvs] = channels[channel_key];
    while (!sends.empty() && !recvs.empty()) {
      const Post send = sends.front(), recv = recvs.front();
      sends.pop_front();
      recvs.pop_front();
      double transfer = 0;
      if (send.world == recv.world) {
        transfer =
            copy_seconds(machine, send.bytes, programs[static_cast<size_t>(send.world)].share());
      } else {
        const Link& link = link_between(send.world, recv.world);
        const double contention =
            node_of(send.world) == node_of(recv.world) ? contention_on(node_of(send.world)) : 1.0;
        transfer =
            link.alpha + contention * send.bytes / link.beta_at(2 * send.bytes) + send.offset;
      }
      const double arrival = std::max(send.time, recv.time) + transfer;
      for (size_t b : {send.batch, recv.batch}) {
        batches[b].done = std::max(batches[b].done, arrival);
        --batches[b].pending;
      }
    }
  };

  // Runs rank `r` as far as it can; returns whether it moved.
  const auto advance = [&](int r) {
    RankState& state = states[static_cast<size_t>(r)];
    std::vector<Action>& actions = programs[static_cast<size_t>(r)].actions();
    bool moved = false;
    const auto add = [&state](double RankTimes::*field, double seconds) {
      state.total.*field += seconds;
      if (state.step_depth > 0) state.in_steps.*field += seconds;
    };
    while (state.pc < actions.size()) {
      const Action& action = actions[state.pc];
      switch (action.kind) {
        case Action::Kind::compute:
          state.t += action.seconds;
          add(&RankTimes::compute, action.seconds);
          break;
        case Action::Kind::step_begin:
          state.step_begin_stack.push_back(state.t);
          ++state.step_depth;
          break;
        case Action::Kind::step_end:
          if (!state.step_begin_stack.empty()) {
            state.steps.push_back(state.t - state.step_begin_stack.back());
            state.step_begin_stack.pop_back();
          }
          --state.step_depth;
          break;
        case Action::Kind::call_begin: state.call_begin_stack.push_back(state.t); break;
        case Action::Kind::call_end:
          if (!state.call_begin_stack.empty()) {
            CallTimes& times = calls[action.name];
            ++times.calls;
            times.seconds += state.t - state.call_begin_stack.back();
            state.call_begin_stack.pop_back();
          }
          break;
        case Action::Kind::collective: {
          if (action.asynchronous) {
            state.pending_collectives[action.id] = arrive(r, state, action);
            break;
          }
          if (!state.arrived) {
            state.at_instance = arrive(r, state, action);
            state.arrived = true;
          }
          const Instance& instance = instances.at(state.at_instance);
          if (instance.done < 0) return moved;
          state.arrived = false;
          add(&RankTimes::comm, instance.seconds);
          add(&RankTimes::exposed_comm, std::max(0.0, instance.done - state.t));
          state.t = std::max(state.t, instance.done);
          break;
        }
        case Action::Kind::collective_wait: {
          const auto it = state.pending_collectives.find(action.id);
          if (it == state.pending_collectives.end()) break;  // started before the trace began
          const Instance& instance = instances.at(it->second);
          if (instance.done < 0) return moved;
          add(&RankTimes::comm, instance.seconds);
          add(&RankTimes::exposed_comm, std::max(0.0, instance.done - state.t));
          state.t = std::max(state.t, instance.done);
          state.pending_collectives.erase(it);
          break;
        }
        case Action::Kind::p2p_start: {
          const size_t b = batches.size();
          batches.push_back({static_cast<int>(action.messages.size()), state.t, state.t});
          state.batches[action.id] = b;
          const int self = action.group_rank >= 0 ? action.group_rank : r;
          std::map<int, double> sent_on_link;  // earlier bytes of this batch per link class
          for (const Message& message : action.messages) {
            int peer_world = world_of(action.group, message.peer);
            if (peer_world < 0) peer_world = action.group == "w" ? message.peer : r;
            Post post{state.t, message.bytes, 0, b, r};
            std::tuple<std::string, int, int> key;
            if (message.send) {
              const Link& link = link_between(r, peer_world);
              const int klass = node_of(r) == node_of(peer_world) ? 0 : 1;
              post.offset = sent_on_link[klass] / link.beta_at(2 * sent_on_link[klass]);
              sent_on_link[klass] += message.bytes;
              key = {action.group, self, message.peer};
              channels[key].first.push_back(post);
            } else {
              key = {action.group, message.peer, self};
              channels[key].second.push_back(post);
            }
            match(key);
          }
          break;
        }
        case Action::Kind::p2p_wait: {
          const auto it = state.batches.find(action.id);
          if (it == state.batches.end()) break;
          const Batch& batch = batches[it->second];
          if (batch.pending > 0) return moved;
          add(&RankTimes::comm, batch.done - batch.posted);
          add(&RankTimes::exposed_comm, std::max(0.0, batch.done - state.t));
          state.t = std::max(state.t, batch.done);
          state.batches.erase(it);
          break;
        }
      }
      ++state.pc;
      moved = true;
    }
    return moved;
  };

  for (;;) {
    bool moved = false, finished = true;
    for (int r = 0; r < ranks; ++r) {
      moved = advance(r) || moved;
      finished = finished && states[static_cast<size_t>(r)].pc ==
                                 programs[static_cast<size_t>(r)].actions().size();
    }
    if (finished) break;
    if (!moved) {
      for (int r = 0; r < ranks; ++r) {
        const RankState& state = states[static_cast<size_t>(r)];
        const auto& actions = programs[static_cast<size_t>(r)].actions();
        if (state.pc < actions.size())
          throw InvalidArgument(
              kOp, fmt::format("trace: the replay is stuck: rank {} waits in '{}' (event {} of "
                               "{}) for ranks that never get there (an incomplete trace?)",
                               r, actions[state.pc].name, state.pc, actions.size()));
      }
    }
  }

  Prediction prediction;
  prediction.machine = machine.name;
  prediction.backend = backend;
  prediction.ranks = ranks;
  size_t steps = SIZE_MAX;
  for (const RankState& state : states) steps = std::min(steps, state.steps.size());
  prediction.steps = static_cast<int>(steps);
  for (const RankState& state : states) {
    RankTimes times = state.total;
    times.end = state.t;
    prediction.per_rank.push_back(times);
  }
  if (steps > 0) {
    for (size_t k = 0; k < steps; ++k) {
      double slowest = 0;
      for (const RankState& state : states) slowest = std::max(slowest, state.steps[k]);
      prediction.step_times.push_back(slowest);
    }
  } else {
    double end = 0;
    for (const RankState& state : states) end = std::max(end, state.t);
    prediction.step_times.push_back(end);
  }
  prediction.step_seconds = median(prediction.step_times);
  prediction.calls = std::move(calls);
  prediction.algorithms = std::move(algorithms);
  const double per = static_cast<double>(std::max<size_t>(steps, 1)) * ranks;
  for (const RankState& state : states) {
    const RankTimes& times = steps > 0 ? state.in_steps : state.total;
    prediction.compute_seconds += times.compute / per;
    prediction.comm_seconds += times.comm / per;
    prediction.exposed_comm_seconds += times.exposed_comm / per;
  }
  return prediction;
}

std::map<std::string, FamilySample> family_samples(const nlohmann::json& trace, bool by_op) {
  std::map<std::string, FamilySample> samples;
  for (Launch& launch : launches_of(trace))
    for (auto& [pid, events] : launch.events) {
      std::stable_sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
        return a.ts != b.ts ? a.ts < b.ts : a.end > b.end;
      });
      // Self time: each event's duration less that of its direct children.
      std::vector<double> self(events.size());
      std::vector<size_t> stack;
      for (size_t i = 0; i < events.size(); ++i) {
        while (!stack.empty() && events[i].end > events[stack.back()].end + 0.002) stack.pop_back();
        const double duration = events[i].end - events[i].ts;
        self[i] = duration;
        if (!stack.empty()) self[stack.back()] -= duration;
        stack.push_back(i);
      }
      // The first call of a signature (name, flops, bytes: in effect, an op on given shapes)
      // pays what later calls do not (plans, allocations, first touch of fresh memory); it is
      // left out when the signature recurs, as a program's steady steps never pay it.
      using Signature = std::tuple<std::string, double, double>;
      std::map<Signature, int> calls;
      const auto signature = [](const Event& event) {
        return Signature{event.name, number_arg(event, "flops"), number_arg(event, "bytes")};
      };
      const auto sampled = [](const Event& event) {
        return event.cat == "op" && event.args != nullptr && event.args->contains("flops");
      };
      for (const Event& event : events)
        if (sampled(event)) ++calls[signature(event)];
      std::set<Signature> seen;
      for (size_t i = 0; i < events.size(); ++i) {
        const Event& event = events[i];
        if (!sampled(event)) continue;
        const Signature key = signature(event);
        if (calls[key] > 1 && seen.insert(key).second) continue;
        FamilySample& sample = samples[by_op ? op_key(event.name) : op_family(event.name)];
        sample.flops += number_arg(event, "flops");
        sample.bytes += number_arg(event, "bytes");
        sample.seconds += std::max(0.0, self[i]) * 1e-6;
        ++sample.count;
      }
    }
  return samples;
}

nlohmann::json prediction_to_json(const Prediction& prediction) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankTimes& times : prediction.per_rank)
    ranks.push_back({{"compute_seconds", times.compute},
                     {"comm_seconds", times.comm},
                     {"exposed_comm_seconds", times.exposed_comm},
                     {"end_seconds", times.end}});
  nlohmann::json calls = nlohmann::json::object();
  for (const auto& [name, times] : prediction.calls)
    calls[name] = {{"calls", times.calls}, {"mean_seconds", times.mean()}};
  return {{"machine", prediction.machine},
          {"backend", prediction.backend},
          {"ranks", prediction.ranks},
          {"steps", prediction.steps},
          {"step_seconds", prediction.step_seconds},
          {"compute_seconds", prediction.compute_seconds},
          {"comm_seconds", prediction.comm_seconds},
          {"exposed_comm_seconds", prediction.exposed_comm_seconds},
          {"step_times", prediction.step_times},
          {"calls", calls},
          {"algorithms", prediction.algorithms},
          {"per_rank", ranks}};
}

}  // namespace tessera::cost
