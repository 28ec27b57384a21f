// The cost model behind `tessera estimate`: a machine description (links per backend and link
// class, per-op-family throughputs), the alpha-beta cost of every collective and message as the
// backends implement them, the roofline cost of an op, and the replay of a trace (one recorded
// by a real run or by estimate mode) on a modeled machine. Plain functions over nlohmann::json,
// tested on cpu (docs/scaling.md has the formulas and the validation).
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::cost {

/// A bandwidth measured at several working sets: (bytes touched, bytes per second) points with
/// the bytes strictly increasing. Between two points the bandwidth is interpolated linearly in
/// log(bytes) and log(bandwidth); outside them it is the nearest point's. On a CPU the same copy
/// runs several times faster while its buffers fit the caches than when they stream from memory.
using BandwidthCurve = std::vector<std::pair<double, double>>;

/// The bandwidth of `curve` at `working_set` bytes; `fallback` when the curve is empty.
double bandwidth_at(const BandwidthCurve& curve, double working_set, double fallback);

/// One link class: a message of n bytes takes alpha + n / beta seconds, beta taken from
/// `beta_by_working_set` at the bytes the transfer touches when the link has that curve.
struct Link {
  double alpha = 0;  ///< seconds per message (latency and software overhead)
  double beta = 1;   ///< bytes per second
  /// Measured beta by working set (the bytes a transfer's buffers take on the node: a
  /// collective's every member's send and receive buffers); empty: `beta` at every size.
  BandwidthCurve beta_by_working_set{};
  double beta_at(double working_set) const {
    return bandwidth_at(beta_by_working_set, working_set, beta);
  }
  /// A message of `bytes` whose send and receive buffers are the working set.
  double seconds(double bytes) const { return alpha + bytes / beta_at(2 * bytes); }
};

/// How a backend runs its collectives (the formulas are in collective_seconds).
enum class Algorithm : uint8_t {
  direct,  ///< shared memory: every rank reads its peers' buffers (the local backend)
  mpi,     ///< MPICH / Open MPI: recursive doubling for small messages, ring-like for large ones
  ring,    ///< NCCL restricted to rings (and pipelined chains for rooted collectives)
  nccl,    ///< NCCL's tuner: per call the cheapest of ring, tree and NVLS (nccl_collective)
};

/// The links of one backend.
struct LinkSet {
  Algorithm algorithm = Algorithm::ring;
  Link intra{};  ///< between ranks of one node
  Link inter{};  ///< between ranks of different nodes
  /// Whether a started collective (start_all_reduce, start_all_gather_v) proceeds while its rank
  /// computes (mpi, nccl) or completes before returning (local).
  bool asynchronous = true;
  /// NVLink SHARP (NVLS) within a node, when the node's switch has it (Algorithm::nccl only):
  /// an all-reduce of n bytes takes alpha + n / beta, beta being the algorithm bandwidth.
  std::optional<Link> nvls{};
};

/// Sustained throughput of one op family on one rank's device (or on the whole node for a
/// machine whose ranks share it).
struct Throughput {
  double flops = 1;  ///< floating-point operations per second
  double bytes = 1;  ///< bytes read plus written per second
};

/// A modeled machine: nodes of `ranks_per_node` ranks.
struct Machine {
  std::string name;
  int ranks_per_node = 1;
  /// True when the ranks of a node share its compute (cpu cores): each gets 1/k of the
  /// throughputs with k ranks on the node. False: one device per rank (GPUs).
  bool shared_compute = false;
  /// Cores of a node whose ranks share them (0: not known). With it, a rank whose trace records
  /// the threads it ran with gets min(threads, cores / k) of the node's cores rather than 1/k.
  int cores_per_node = 0;
  std::string backend;                   ///< the backend modeled unless the caller names one
  std::map<std::string, LinkSet> links;  ///< by backend name
  double op_overhead = 0;                ///< seconds added to every op (launch, dispatch)
  /// Bytes read plus written per second of local copies (halo packing, redistribute) on the
  /// whole node, when the copy streams from memory.
  double memory_bandwidth = 1;
  /// The same by the node's working set (every rank's source and destination); empty:
  /// memory_bandwidth at every size.
  BandwidthCurve memory_bandwidth_by_working_set{};
  /// Seconds a cpu copy spends per contiguous run besides its bytes (a strided copy is one
  /// memcpy per run: halo faces, box exchanges); 0: not modeled.
  double copy_run_seconds = 0;
  std::map<std::string, Throughput> families;  ///< by op family; "default" for the rest
  /// The same measured with one core of the node busy and the others idle, as the node's rate
  /// (the one core's times the cores): on a CPU an op bound by memory runs faster per core when
  /// the other cores leave it the caches and the memory bandwidth. `families` then holds the
  /// rates with every core busy. Empty: `families` at any load.
  std::map<std::string, Throughput> families_alone;
  nlohmann::json source = nlohmann::json::object();  ///< the file as read (sources, notes)
};

/// Seconds of a local copy of `bytes` (read once, written once) in `runs` contiguous runs by a
/// rank that has `share` of its node: 2 bytes / (share * the node's copy bandwidth at the
/// working set 2 bytes / share, every rank of the node copying alike), plus runs *
/// copy_run_seconds on the rank's copying thread (stretched by k / c when the node's k ranks
/// share c < k cores: share * cores_per_node < 1).
double copy_seconds(const Machine& machine, double bytes, double share = 1, double runs = 0);

/// Parses a machine file; throws InvalidArgument("estimate", ...) naming what is wrong.
Machine machine_from_json(const nlohmann::json& document);
/// The machine file of `machine` (what --calibrate writes).
nlohmann::json machine_to_json(const Machine& machine);

/// The op family of a trace event's name ("conv backward" -> "conv_backward"; families: conv,
/// matmul, na, attention, norm, pool, stencil, pointwise).
std::string op_family(std::string_view event_name);

/// The key of one op in a machine file's families: its name, " backward" as "_backward"
/// ("gelu backward" -> "gelu_backward").
std::string op_key(std::string_view event_name);

/// The throughput `machine` models for `family` (its backward falls back to the forward's,
/// then to "default").
Throughput family_throughput(const Machine& machine, const std::string& family);

/// The throughput of the op event `event_name`: the machine's entry for the op itself (a
/// calibrated machine measures each op it ran), else its family's.
Throughput op_throughput(const Machine& machine, std::string_view event_name);

/// The same from `families_alone`, when the machine has that map and an entry for the op, its
/// family, its forward or "default".
std::optional<Throughput> op_throughput_alone(const Machine& machine, std::string_view event_name);

/// Roofline seconds of one op: overhead + max(flops / F, bytes / B), the throughputs scaled by
/// `share` (the part of the node's compute the rank has).
double op_seconds(const Machine& machine, const std::string& family, double flops, double bytes,
                  double share = 1);
/// The same for an op event by its name (op_throughput). `load` (0..1) says how busy the rank's
/// node is: (busy cores - 1) / (cores - 1). Where the machine has `families_alone`, the seconds
/// are interpolated between that rate (load 0) and `families` (load 1).
double event_seconds(const Machine& machine, std::string_view event_name, double flops,
                     double bytes, double share = 1, double load = 1);

enum class Collective : uint8_t {
  all_reduce,
  all_gather_v,
  reduce_scatter_v,
  all_to_all_v,
  broadcast,
  scatter_v,
  gather_v,
  barrier,
  split,
};

/// The collective of a trace event's name ("all_reduce start" -> all_reduce); false if none.
bool collective_of(std::string_view event_name, Collective& collective);

/// The bytes one collective's buffers take over all its members (each member's send and receive
/// buffers; `bytes` as in collective_seconds): all_gather_v and reduce_scatter_v (P + 1) N,
/// all_reduce 2 P n, broadcast P n, all_to_all_v, scatter_v and gather_v twice the members'
/// bytes. What a link's beta_by_working_set is looked up at.
double collective_working_set(Collective collective, std::span<const double> bytes);

/// Seconds of one collective over `bytes.size()` members with `link` and `algorithm`. `bytes`
/// holds each member's recorded bytes: all_reduce, broadcast: the buffer; all_gather_v,
/// reduce_scatter_v: the whole (gathered / reduced) buffer; all_to_all: what the member sends;
/// scatter_v, gather_v: the member's block. `root` is the member rank of a rooted collective.
/// `contention` multiplies the bandwidth term: k ranks of a node with c < k cores copy with
/// c cores at a time (direct and mpi within a node: the cores do the copies), k / c.
double collective_seconds(Algorithm algorithm, const Link& link, Collective collective,
                          std::span<const double> bytes, int root = 0, double contention = 1);

/// The algorithms NCCL chooses between (src/graph/tuning.cc; docs/scaling.md has the formulas).
enum class NcclAlgorithm : uint8_t {
  ring,  ///< a ring through every member, NVLink within a node and one NIC hop between nodes
  tree,  ///< double binary tree across nodes, a chain within each (all-reduce only)
  nvls,  ///< NVLink SHARP: the node's switch reduces (all-reduce within one node only)
};

/// "ring", "tree", "nvls".
const char* nccl_algorithm_name(NcclAlgorithm algorithm);

/// Seconds of one collective run with NCCL's `algorithm` over members spread evenly over
/// `nodes` nodes (`links.intra` within a node, `links.inter` between nodes; `bytes` and `root`
/// as in collective_seconds); +infinity when NCCL has no such algorithm for the call (tree is
/// all-reduce only, across nodes; NVLS all-reduce within one node whose links have `nvls`).
double nccl_algorithm_seconds(const LinkSet& links, NcclAlgorithm algorithm, Collective collective,
                              std::span<const double> bytes, int nodes, int root = 0);

/// What NCCL's tuner picks for one call: the cheapest algorithm (ring on ties) and its seconds.
struct NcclChoice {
  NcclAlgorithm algorithm = NcclAlgorithm::ring;
  double seconds = 0;
};

/// The cheapest of nccl_algorithm_seconds over ring, tree and NVLS, as NCCL's tuner chooses.
NcclChoice nccl_collective(const LinkSet& links, Collective collective,
                           std::span<const double> bytes, int nodes, int root = 0);

/// The prediction of a replayed trace.
struct RankTimes {
  double compute = 0;       ///< seconds of op kernels and local copies
  double comm = 0;          ///< seconds of the rank's collectives and messages (hidden or not)
  double exposed_comm = 0;  ///< seconds the rank waited in communication
  double end = 0;           ///< when the rank finished
};

/// Modeled time of the calls of one kind (a collective, or a redistribute between two layouts):
/// from the call's start on its rank to its end there, waiting for peers included.
struct CallTimes {
  int64_t calls = 0;
  double seconds = 0;  ///< summed over calls and ranks
  double mean() const { return calls > 0 ? seconds / static_cast<double>(calls) : 0; }
};

struct Prediction {
  std::string machine, backend;
  int ranks = 0;
  int steps = 0;               ///< step events per rank (0: the whole trace is one step)
  double step_seconds = 0;     ///< median over steps of the slowest rank's step time
  double compute_seconds = 0;  ///< per step: the mean over ranks
  double comm_seconds = 0;
  double exposed_comm_seconds = 0;
  std::vector<double> step_times;   ///< each step's time
  std::vector<RankTimes> per_rank;  ///< over the whole trace
  /// By call kind: the event's name ("all_gather_v"), for a redistribute "redistribute FROM ->
  /// TO" (the layouts as recorded).
  std::map<std::string, CallTimes> calls;
  /// With Algorithm::nccl: how many collective calls (counted once per call, not per member)
  /// ran with each algorithm, by "COLLECTIVE ALGORITHM" ("all_reduce tree").
  std::map<std::string, int64_t> algorithms;
};

struct ReplayOptions {
  std::string backend{};  ///< the backend to model ("": the machine's, else the trace's)
  /// Which launch of the trace (a process that launches several times records them all);
  /// -1: the last one.
  int launch = -1;
};

/// Replays every rank's events of `trace` (a Chrome trace as core/trace.cpp writes it) on
/// `machine`: each rank runs its ops, copies and communication in order; a collective starts
/// when every member has reached it; a message arrives alpha + n / beta after both of its ends
/// are posted; a halo_begin..halo_end window lets the compute inside it overlap the messages.
/// Throws InvalidArgument("estimate", ...) on a malformed or incomplete trace.
Prediction replay(const nlohmann::json& trace, const Machine& machine,
                  const ReplayOptions& options = {});

/// The prediction as JSON (step_seconds, the breakdown, per-rank times).
nlohmann::json prediction_to_json(const Prediction& prediction);

/// What a trace's op events of one family cost and took.
struct FamilySample {
  double flops = 0, bytes = 0;
  double seconds = 0;  ///< self time: the events' durations less the events nested in them
  int64_t count = 0;
};

/// Per op family (or per op, `by_op`: keys of op_key), the summed cost args and self times of
/// the op events of `trace` (every launch, every rank): what calibration fits throughputs to.
/// The first event of each signature (name, flops, bytes) on a rank is left out when the
/// signature recurs there: it pays one-time costs (plans, allocations, first touch).
std::map<std::string, FamilySample> family_samples(const nlohmann::json& trace, bool by_op = false);

/// Sets `machine`'s throughputs from `samples` (by family or by op key): flops/s for the
/// families that compute (conv, matmul, na, attention, and their backward), bytes/s for the
/// others; the unmeasured part of each roofline gets `peak_flops` or the machine's memory
/// bandwidth.
void fit_families(Machine& machine, const std::map<std::string, FamilySample>& samples,
                  double peak_flops);
/// The same into `families_alone` (samples measured with the other cores idle).
void fit_families_alone(Machine& machine, const std::map<std::string, FamilySample>& samples,
                        double peak_flops);

/// The median of `values` (0 when empty).
double median(std::vector<double> values);

/// Least-squares fit of seconds = alpha + bytes / beta over (bytes, seconds) samples (alpha
/// clamped at 0; beta positive).
Link fit_link(std::span<const double> bytes, std::span<const double> seconds);

/// fit_link, and the link's beta_by_working_set from the same samples: at each sample whose
/// time is at least twice alpha, bytes / (seconds - alpha) at that sample's working set
/// (`working_sets`, increasing; a later sample at the same working set is skipped).
Link fit_link_curve(std::span<const double> bytes, std::span<const double> seconds,
                    std::span<const double> working_sets);

}  // namespace tessera::cost
