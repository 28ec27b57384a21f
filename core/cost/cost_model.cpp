// Machine files, op and collective costs (core/cost/cost_model.hpp). The replay is replay.cpp.
#include "core/cost/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/comm/nccl_plan.hpp"
#include "core/errors.hpp"

namespace tessera::cost {

namespace {

constexpr const char* kOp = "estimate";

double positive_number(const nlohmann::json& object, const char* key, const std::string& where,
                       bool allow_zero = false) {
  check_arg(object.is_object() && object.contains(key), kOp, "machine file: {} has no '{}'", where,
            key);
  const nlohmann::json& value = object.at(key);
  check_arg(value.is_number(), kOp, "machine file: {}.{} is not a number", where, key);
  const double number = value.get<double>();
  check_arg(std::isfinite(number) && (allow_zero ? number >= 0 : number > 0), kOp,
            "machine file: {}.{} = {} must be {}", where, key, number,
            allow_zero ? "finite and >= 0" : "finite and > 0");
  return number;
}

/// A bandwidth curve: [[bytes, bytes per second], ...], bytes positive and increasing.
BandwidthCurve curve_from(const nlohmann::json& value, const std::string& where) {
  check_arg(value.is_array(), kOp, "machine file: {} is not an array of [bytes, bytes/s] pairs",
            where);
  BandwidthCurve curve;
  for (size_t i = 0; i < value.size(); ++i) {
    const nlohmann::json& point = value[i];
    const std::string at = fmt::format("{}[{}]", where, i);
    check_arg(point.is_array() && point.size() == 2 && point[0].is_number() && point[1].is_number(),
              kOp, "machine file: {} is not a [bytes, bytes/s] pair", at);
    const double bytes = point[0].get<double>(), rate = point[1].get<double>();
    check_arg(std::isfinite(bytes) && bytes > 0 && std::isfinite(rate) && rate > 0, kOp,
              "machine file: {} = [{}, {}] must be two finite numbers > 0", at, bytes, rate);
    const double previous = curve.empty() ? 0 : curve.back().first;
    check_arg(bytes > previous, kOp,
              "machine file: {} has {} bytes after {}: the working sets must increase", at, bytes,
              previous);
    curve.emplace_back(bytes, rate);
  }
  return curve;
}

nlohmann::json curve_to_json(const BandwidthCurve& curve) {
  nlohmann::json points = nlohmann::json::array();
  for (const auto& [bytes, rate] : curve) points.push_back({bytes, rate});
  return points;
}

Link link_from(const nlohmann::json& object, const std::string& where) {
  check_arg(object.is_object(), kOp, "machine file: {} is not an object", where);
  Link link{positive_number(object, "alpha", where, /*allow_zero=*/true),
            positive_number(object, "beta", where)};
  if (object.contains("beta_by_working_set"))
    link.beta_by_working_set =
        curve_from(object.at("beta_by_working_set"), where + ".beta_by_working_set");
  return link;
}

nlohmann::json link_to_json(const Link& link) {
  nlohmann::json object = {{"alpha", link.alpha}, {"beta", link.beta}};
  if (!link.beta_by_working_set.empty())
    object["beta_by_working_set"] = curve_to_json(link.beta_by_working_set);
  return object;
}

Algorithm algorithm_from(const std::string& name, const std::string& where) {
  if (name == "direct") return Algorithm::direct;
  if (name == "mpi") return Algorithm::mpi;
  if (name == "ring") return Algorithm::ring;
  if (name == "nccl") return Algorithm::nccl;
  throw InvalidArgument(kOp, fmt::format("machine file: {}.algorithm '{}' is not one of direct, "
                                         "mpi, ring, nccl",
                                         where, name));
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::direct: return "direct";
    case Algorithm::mpi: return "mpi";
    case Algorithm::ring: return "ring";
    case Algorithm::nccl: return "nccl";
  }
  return "ring";
}

/// ceil(log2(p)) for p >= 1.
double log2_ceil(int p) {
  int steps = 0;
  while ((1 << steps) < p) ++steps;
  return steps;
}

}  // namespace

Machine machine_from_json(const nlohmann::json& document) {
  check_arg(document.is_object(), kOp, "machine file: the document is not a JSON object");
  Machine machine;
  machine.source = document;
  machine.name = document.value("name", std::string("machine"));
  const double per_node = positive_number(document, "ranks_per_node", "machine");
  machine.ranks_per_node = static_cast<int>(per_node);
  check_arg(machine.ranks_per_node == per_node, kOp,
            "machine file: ranks_per_node = {} is not an integer", per_node);
  machine.shared_compute = document.value("shared_compute", false);
  if (document.contains("cores_per_node")) {
    const double cores = positive_number(document, "cores_per_node", "machine");
    machine.cores_per_node = static_cast<int>(cores);
    check_arg(machine.cores_per_node == cores, kOp,
              "machine file: cores_per_node = {} is not an integer", cores);
  }
  check_arg(document.contains("links") && document.at("links").is_object() &&
                !document.at("links").empty(),
            kOp, "machine file: 'links' must be an object with one entry per backend");
  for (const auto& [backend, set] : document.at("links").items()) {
    const std::string where = "links." + backend;
    check_arg(set.is_object(), kOp, "machine file: {} is not an object", where);
    LinkSet links;
    const std::string fallback = backend == "local" ? "direct" : backend == "mpi" ? "mpi" : "ring";
    links.algorithm = algorithm_from(set.value("algorithm", fallback), where);
    check_arg(set.contains("intra"), kOp, "machine file: {} has no 'intra'", where);
    links.intra = link_from(set.at("intra"), where + ".intra");
    links.inter =
        set.contains("inter") ? link_from(set.at("inter"), where + ".inter") : links.intra;
    links.asynchronous = set.value("asynchronous", backend != "local");
    if (set.contains("nvls")) links.nvls = link_from(set.at("nvls"), where + ".nvls");
    machine.links[backend] = links;
  }
  machine.backend = document.value("backend", machine.links.begin()->first);
  check_arg(machine.links.count(machine.backend) == 1, kOp,
            "machine file: backend '{}' has no entry in 'links'", machine.backend);
  check_arg(document.contains("compute") && document.at("compute").is_object(), kOp,
            "machine file: 'compute' must be an object");
  const nlohmann::json& compute = document.at("compute");
  machine.op_overhead = positive_number(compute, "op_overhead", "compute", /*allow_zero=*/true);
  machine.memory_bandwidth = positive_number(compute, "memory_bandwidth", "compute");
  if (compute.contains("copy_run_seconds"))
    machine.copy_run_seconds =
        positive_number(compute, "copy_run_seconds", "compute", /*allow_zero=*/true);
  if (compute.contains("memory_bandwidth_by_working_set"))
    machine.memory_bandwidth_by_working_set = curve_from(
        compute.at("memory_bandwidth_by_working_set"), "compute.memory_bandwidth_by_working_set");
  check_arg(compute.contains("families") && compute.at("families").is_object(), kOp,
            "machine file: compute.families must be an object");
  for (const auto& [family, value] : compute.at("families").items()) {
    const std::string where = "compute.families." + family;
    machine.families[family] = {positive_number(value, "flops", where),
                                positive_number(value, "bytes", where)};
  }
  check_arg(machine.families.count("default") == 1, kOp,
            "machine file: compute.families has no 'default'");
  if (compute.contains("families_alone")) {
    check_arg(compute.at("families_alone").is_object(), kOp,
              "machine file: compute.families_alone must be an object");
    for (const auto& [family, value] : compute.at("families_alone").items()) {
      const std::string where = "compute.families_alone." + family;
      machine.families_alone[family] = {positive_number(value, "flops", where),
                                        positive_number(value, "bytes", where)};
    }
  }
  return machine;
}

nlohmann::json machine_to_json(const Machine& machine) {
  nlohmann::json document = machine.source.is_object() ? machine.source : nlohmann::json::object();
  document["name"] = machine.name;
  document["ranks_per_node"] = machine.ranks_per_node;
  document["shared_compute"] = machine.shared_compute;
  if (machine.cores_per_node > 0) document["cores_per_node"] = machine.cores_per_node;
  document["backend"] = machine.backend;
  nlohmann::json links = nlohmann::json::object();
  for (const auto& [backend, set] : machine.links) {
    links[backend] = {{"algorithm", algorithm_name(set.algorithm)},
                      {"asynchronous", set.asynchronous},
                      {"intra", link_to_json(set.intra)},
                      {"inter", link_to_json(set.inter)}};
    if (set.nvls) links[backend]["nvls"] = link_to_json(*set.nvls);
  }
  document["links"] = links;
  nlohmann::json families = nlohmann::json::object();
  for (const auto& [family, throughput] : machine.families)
    families[family] = {{"flops", throughput.flops}, {"bytes", throughput.bytes}};
  document["compute"] = {{"op_overhead", machine.op_overhead},
                         {"memory_bandwidth", machine.memory_bandwidth},
                         {"families", families}};
  if (!machine.families_alone.empty()) {
    nlohmann::json alone = nlohmann::json::object();
    for (const auto& [family, throughput] : machine.families_alone)
      alone[family] = {{"flops", throughput.flops}, {"bytes", throughput.bytes}};
    document["compute"]["families_alone"] = alone;
  }
  if (machine.copy_run_seconds > 0)
    document["compute"]["copy_run_seconds"] = machine.copy_run_seconds;
  if (!machine.memory_bandwidth_by_working_set.empty())
    document["compute"]["memory_bandwidth_by_working_set"] =
        curve_to_json(machine.memory_bandwidth_by_working_set);
  return document;
}

double bandwidth_at(const BandwidthCurve& curve, double working_set, double fallback) {
  if (curve.empty()) return fallback;
  if (working_set <= curve.front().first) return curve.front().second;
  if (working_set >= curve.back().first) return curve.back().second;
  const auto above = std::upper_bound(
      curve.begin(), curve.end(), working_set,
      [](double bytes, const std::pair<double, double>& point) { return bytes < point.first; });
  const auto below = std::prev(above);
  const double t = std::log(working_set / below->first) / std::log(above->first / below->first);
  return below->second * std::pow(above->second / below->second, t);
}

double copy_seconds(const Machine& machine, double bytes, double share, double runs) {
  double seconds = 0;
  if (runs > 0 && machine.copy_run_seconds > 0) {
    const double threads =
        machine.cores_per_node > 0 ? std::min(1.0, share * machine.cores_per_node) : 1.0;
    seconds += runs * machine.copy_run_seconds / threads;
  }
  if (bytes <= 0) return seconds;
  const double moved = 2 * bytes;  // read once, written once
  return seconds + moved / (share * bandwidth_at(machine.memory_bandwidth_by_working_set,
                                                 moved / share, machine.memory_bandwidth));
}

std::string op_family(std::string_view event_name) {
  std::string_view base = event_name;
  std::string suffix;
  constexpr std::string_view kBackward = " backward";
  if (base.size() > kBackward.size() && base.ends_with(kBackward)) {
    base.remove_suffix(kBackward.size());
    suffix = "_backward";
  }
  std::string family = "pointwise";
  if (base == "conv" || base == "conv_transpose")
    family = "conv";
  else if (base == "linear" || base == "matmul")
    family = "matmul";
  else if (base == "na")
    family = "na";
  else if (base.find("attention") != std::string_view::npos)
    family = "attention";
  else if (base.ends_with("_norm"))
    family = "norm";
  else if (base.ends_with("_pool"))
    family = "pool";
  else if (base.starts_with("gray_scott"))
    family = "stencil";
  return family + suffix;
}

std::string op_key(std::string_view event_name) {
  std::string key(event_name);
  constexpr std::string_view kBackward = " backward";
  if (key.size() > kBackward.size() && key.ends_with(kBackward))
    key = key.substr(0, key.size() - kBackward.size()) + "_backward";
  std::replace(key.begin(), key.end(), ' ', '_');
  return key;
}

namespace {

/// The entry of `family` in `map`: the family's own, else its forward's (for a `_backward`
/// family), else "default"; null when none of them is there.
const Throughput* find_family(const std::map<std::string, Throughput>& map,
                              const std::string& family) {
  if (auto it = map.find(family); it != map.end()) return &it->second;
  constexpr std::string_view kBackward = "_backward";
  if (family.ends_with(kBackward))
    if (auto it = map.find(family.substr(0, family.size() - kBackward.size())); it != map.end())
      return &it->second;
  if (auto it = map.find("default"); it != map.end()) return &it->second;
  return nullptr;
}

/// The entry of the op event `event_name` in `map`: the op's own, else its family's.
const Throughput* find_op(const std::map<std::string, Throughput>& map,
                          std::string_view event_name) {
  if (auto it = map.find(op_key(event_name)); it != map.end()) return &it->second;
  return find_family(map, op_family(event_name));
}

}  // namespace

Throughput op_throughput(const Machine& machine, std::string_view event_name) {
  if (const Throughput* found = find_op(machine.families, event_name)) return *found;
  return machine.families.at("default");  // throws: a machine without "default"
}

std::optional<Throughput> op_throughput_alone(const Machine& machine, std::string_view event_name) {
  if (const Throughput* found = find_op(machine.families_alone, event_name)) return *found;
  return std::nullopt;
}

double event_seconds(const Machine& machine, std::string_view event_name, double flops,
                     double bytes, double share, double load) {
  const auto seconds = [&](const Throughput& throughput) {
    return std::max(flops / (throughput.flops * share), bytes / (throughput.bytes * share));
  };
  const double loaded = seconds(op_throughput(machine, event_name));
  const std::optional<Throughput> alone = op_throughput_alone(machine, event_name);
  if (!alone) return machine.op_overhead + loaded;
  const double l = std::clamp(load, 0.0, 1.0);
  return machine.op_overhead + seconds(*alone) + l * (loaded - seconds(*alone));
}

Throughput family_throughput(const Machine& machine, const std::string& family) {
  if (const Throughput* found = find_family(machine.families, family)) return *found;
  return machine.families.at("default");  // throws: a machine without "default"
}

double op_seconds(const Machine& machine, const std::string& family, double flops, double bytes,
                  double share) {
  const Throughput throughput = family_throughput(machine, family);
  return machine.op_overhead +
         std::max(flops / (throughput.flops * share), bytes / (throughput.bytes * share));
}

bool collective_of(std::string_view name, Collective& collective) {
  constexpr std::string_view kStart = " start";
  if (name.ends_with(kStart)) name.remove_suffix(kStart.size());
  static const std::pair<std::string_view, Collective> kNames[] = {
      {"all_reduce", Collective::all_reduce},
      {"all_gather_v", Collective::all_gather_v},
      {"reduce_scatter_v", Collective::reduce_scatter_v},
      {"all_to_all_v", Collective::all_to_all_v},
      {"all_to_all_w", Collective::all_to_all_v},
      {"broadcast", Collective::broadcast},
      {"scatter_v", Collective::scatter_v},
      {"gather_v", Collective::gather_v},
      {"barrier", Collective::barrier},
      {"split", Collective::split}};
  for (const auto& [text, value] : kNames)
    if (name == text) {
      collective = value;
      return true;
    }
  return false;
}

double collective_working_set(Collective collective, std::span<const double> bytes) {
  const double p = static_cast<double>(bytes.size());
  if (bytes.empty()) return 0;
  const double largest = *std::max_element(bytes.begin(), bytes.end());
  const double total = std::accumulate(bytes.begin(), bytes.end(), 0.0);
  switch (collective) {
    case Collective::all_gather_v:
    case Collective::reduce_scatter_v: return (p + 1) * largest;  // P whole buffers, P blocks
    case Collective::all_reduce: return 2 * p * largest;          // input and output per member
    case Collective::broadcast: return p * largest;
    case Collective::all_to_all_v:
    case Collective::scatter_v:
    case Collective::gather_v: return 2 * total;  // what is sent, and as much received
    case Collective::barrier:
    case Collective::split: return 0;
  }
  return 0;
}

double collective_seconds(Algorithm algorithm, const Link& link, Collective collective,
                          std::span<const double> bytes, int root, double contention) {
  const int p = static_cast<int>(bytes.size());
  if (p <= 1) return 0;
  const double a = link.alpha, lg = log2_ceil(p), share = (p - 1.0) / p;
  const double b =
      link.beta_at(collective_working_set(collective, bytes)) / std::max(1.0, contention);
  const double largest = *std::max_element(bytes.begin(), bytes.end());
  double others = std::accumulate(bytes.begin(), bytes.end(), 0.0);
  if (root >= 0 && root < p) others -= bytes[static_cast<size_t>(root)];
  switch (algorithm) {
    case Algorithm::direct:  // each rank copies (and reduces) straight from its peers' buffers
      switch (collective) {
        case Collective::all_reduce: return a + (p - 1) * largest / b;
        // Each rank copies its whole result, its own block included (the local backend).
        case Collective::all_gather_v:
        case Collective::reduce_scatter_v:
        case Collective::all_to_all_v: return a + largest / b;
        case Collective::broadcast: return a + largest / b;
        case Collective::scatter_v: return a + largest / b;
        case Collective::gather_v: return a + others / b;
        case Collective::barrier:
        case Collective::split: return a;
      }
      break;
    case Algorithm::mpi:
      switch (collective) {
        case Collective::all_reduce:  // recursive doubling vs Rabenseifner (reduce-scatter +
                                      // gather)
          return std::min(lg * (a + largest / b), 2 * lg * a + 2 * share * largest / b);
        case Collective::all_gather_v:
        case Collective::reduce_scatter_v: return lg * a + share * largest / b;
        case Collective::all_to_all_v: return (p - 1) * a + share * largest / b;  // pairwise
        case Collective::broadcast:  // binomial tree vs scatter + ring all-gather
          return std::min(lg * (a + largest / b), (lg + p - 1) * a + 2 * share * largest / b);
        case Collective::scatter_v:
        case Collective::gather_v: return lg * a + others / b;  // binomial tree, root's link
        case Collective::barrier:
        case Collective::split: return lg * a;
      }
      break;
    case Algorithm::ring:
    case Algorithm::nccl:  // on one link class NCCL's choice is priced as its ring
      switch (collective) {
        case Collective::all_reduce: return 2 * (p - 1) * a + 2 * share * largest / b;
        case Collective::all_gather_v:
        case Collective::reduce_scatter_v: return (p - 1) * a + share * largest / b;
        case Collective::all_to_all_v: return (p - 1) * a + share * largest / b;
        case Collective::broadcast: return (p - 1) * a + largest / b;  // pipelined chain
        case Collective::scatter_v:
        case Collective::gather_v: return (p - 1) * a + others / b;  // the root's sends in turn
        case Collective::barrier: return 2 * (p - 1) * a;
        case Collective::split: return lg * a;
      }
      break;
  }
  return 0;
}

const char* nccl_algorithm_name(NcclAlgorithm algorithm) {
  switch (algorithm) {
    case NcclAlgorithm::ring: return "ring";
    case NcclAlgorithm::tree: return "tree";
    case NcclAlgorithm::nvls: return "nvls";
  }
  return "ring";
}

// The shapes of NCCL's own cost model (src/graph/tuning.cc, ncclTopoTuneModel): a ring of P
// ranks over N nodes takes `steps` hops of which only the ones leaving a node cross the network
// (2(N-1) for an all-reduce, N-1 for the all-gather / reduce-scatter family), so its latency is
// (steps - inter) alpha_intra + inter alpha_inter and its bandwidth that of the slowest link;
// the tree is a chain inside each node and a double binary tree across nodes, latency
// 2 ((P/N - 1) alpha_intra + log2 N alpha_inter), and moves each byte up and down once: 2n/beta;
// NVLS is one trip through the node's switch.
double nccl_algorithm_seconds(const LinkSet& links, NcclAlgorithm algorithm, Collective collective,
                              std::span<const double> bytes, int nodes, int root) {
  constexpr double kNever = std::numeric_limits<double>::infinity();
  const int p = static_cast<int>(bytes.size());
  if (p <= 1) return 0;
  nodes = std::clamp(nodes, 1, p);
  const Link& slowest = nodes > 1 ? links.inter : links.intra;
  const double largest = *std::max_element(bytes.begin(), bytes.end());
  const double share = (p - 1.0) / p;
  // Latency of `steps` ring hops of which `inter` leave a node.
  const auto hops = [&](int steps, int inter) {
    inter = nodes > 1 ? std::min(inter, steps) : 0;
    return (steps - inter) * links.intra.alpha + inter * links.inter.alpha;
  };
  switch (algorithm) {
    case NcclAlgorithm::ring:
      switch (collective) {
        case Collective::all_reduce:
          return hops(2 * (p - 1), 2 * (nodes - 1)) + 2 * share * largest / slowest.beta;
        case Collective::all_gather_v:
        case Collective::reduce_scatter_v:
          return hops(p - 1, nodes - 1) + share * largest / slowest.beta;
        case Collective::broadcast:  // pipelined chain
          return hops(p - 1, nodes - 1) + largest / slowest.beta;
        default:  // not NCCL rings (all_to_all: grouped p2p; rooted: the root's sends in turn)
          return collective_seconds(Algorithm::ring, slowest, collective, bytes, root);
      }
    case NcclAlgorithm::tree: {
      if (collective != Collective::all_reduce || nodes <= 1) return kNever;
      const int per_node = (p + nodes - 1) / nodes;
      return 2 * ((per_node - 1) * links.intra.alpha + log2_ceil(nodes) * links.inter.alpha) +
             2 * largest / slowest.beta;
    }
    case NcclAlgorithm::nvls:
      if (collective != Collective::all_reduce || nodes > 1 || !links.nvls) return kNever;
      return links.nvls->alpha + largest / links.nvls->beta;
  }
  return kNever;
}

NcclChoice nccl_collective(const LinkSet& links, Collective collective,
                           std::span<const double> bytes, int nodes, int root) {
  if (collective == Collective::all_gather_v && !bytes.empty()) {
    // NcclComm runs a small all-gather over many ranks as an all-reduce of the gathered buffer.
    const double gathered = *std::max_element(bytes.begin(), bytes.end());
    if (nccl_plan::gather_by_all_reduce(static_cast<int>(bytes.size()), gathered)) {
      const std::vector<double> whole(bytes.size(), gathered);
      return nccl_collective(links, Collective::all_reduce, whole, nodes, root);
    }
  }
  NcclChoice best{NcclAlgorithm::ring, nccl_algorithm_seconds(links, NcclAlgorithm::ring,
                                                              collective, bytes, nodes, root)};
  for (NcclAlgorithm other : {NcclAlgorithm::tree, NcclAlgorithm::nvls}) {
    const double seconds = nccl_algorithm_seconds(links, other, collective, bytes, nodes, root);
    if (seconds < best.seconds) best = {other, seconds};
  }
  return best;
}

namespace {

void fit_into(std::map<std::string, Throughput>& into, double memory_bandwidth,
              const std::map<std::string, FamilySample>& samples, double peak_flops) {
  const auto computes = [](const std::string& key) {
    // An op key names its family through the event name it came from.
    std::string name = key;
    if (name.ends_with("_backward")) name = name.substr(0, name.size() - 9) + " backward";
    const std::string family = op_family(name);
    for (const std::string& known : {family, key})
      for (const char* compute : {"conv", "matmul", "na", "attention"})
        if (known == compute || known == std::string(compute) + "_backward") return true;
    return false;
  };
  for (const auto& [family, sample] : samples) {
    if (sample.seconds <= 0 || sample.count == 0) continue;
    if (computes(family) && sample.flops > 0)
      into[family] = {sample.flops / sample.seconds, memory_bandwidth};
    else if (sample.bytes > 0)
      into[family] = {peak_flops, sample.bytes / sample.seconds};
  }
}

}  // namespace

void fit_families(Machine& machine, const std::map<std::string, FamilySample>& samples,
                  double peak_flops) {
  fit_into(machine.families, machine.memory_bandwidth, samples, peak_flops);
}

void fit_families_alone(Machine& machine, const std::map<std::string, FamilySample>& samples,
                        double peak_flops) {
  fit_into(machine.families_alone, machine.memory_bandwidth, samples, peak_flops);
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 ? values[middle] : 0.5 * (values[middle - 1] + values[middle]);
}

Link fit_link(std::span<const double> bytes, std::span<const double> seconds) {
  check_arg(bytes.size() == seconds.size() && bytes.size() >= 2, kOp,
            "fitting a link needs two or more samples");
  // Least squares of the relative error (weights 1/t^2): the sizes span decades, and an
  // absolute fit would let the largest messages' noise set alpha.
  double sw = 0, swx = 0, swy = 0, swxx = 0, swxy = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    check_arg(seconds[i] > 0, kOp, "fitting a link: a sample of {} seconds", seconds[i]);
    const double w = 1 / (seconds[i] * seconds[i]);
    sw += w;
    swx += w * bytes[i];
    swy += w * seconds[i];
    swxx += w * bytes[i] * bytes[i];
    swxy += w * bytes[i] * seconds[i];
  }
  const double det = sw * swxx - swx * swx;
  double slope = det > 0 ? (sw * swxy - swx * swy) / det : 0;
  double alpha = det > 0 ? (swy - slope * swx) / sw : 0;
  if (alpha < 0 || slope <= 0) {  // through the origin instead
    alpha = 0;
    slope = swxx > 0 ? swxy / swxx : 0;
  }
  return {alpha, slope > 0 ? 1 / slope : 1e30};
}

Link fit_link_curve(std::span<const double> bytes, std::span<const double> seconds,
                    std::span<const double> working_sets) {
  check_arg(working_sets.size() == bytes.size(), kOp,
            "fitting a link: {} working sets for {} samples", working_sets.size(), bytes.size());
  Link link = fit_link(bytes, seconds);
  for (size_t i = 0; i < bytes.size(); ++i) {
    // Where alpha is most of the time, the difference says little about the bandwidth.
    if (seconds[i] < 2 * link.alpha || bytes[i] <= 0) continue;
    if (!link.beta_by_working_set.empty() &&
        working_sets[i] <= link.beta_by_working_set.back().first)
      continue;
    link.beta_by_working_set.emplace_back(working_sets[i], bytes[i] / (seconds[i] - link.alpha));
  }
  return link;
}

}  // namespace tessera::cost
