// `tessera estimate`: predicts the step time of a run on a modeled machine, either of a command
// run in estimate mode on P simulated ranks (--cluster C --ranks P -- COMMAND ...; --scaling
// for a table over several P) or of a traced run (--cluster C --trace-in TRACE.json), and
// measures this machine into a machine file (--calibrate --out MACHINE.json). The model is
// core/cost/; docs/scaling.md describes it, the shipped cluster files and the validation.
#include "apps/tessera/estimate.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "apps/plot/plot.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/comm/mpi_comm.hpp"
#include "core/cost/cost_model.hpp"
#include "core/errors.hpp"
#include "core/estimate/sim_comm.hpp"
#include "core/tensor.hpp"
#include "io/output_path.hpp"

namespace tessera::cli {

namespace {

constexpr const char* kOp = "estimate";

struct EstimateOptions {
  std::string cluster, trace_in, out, backend, scaling, plot;
  int launch = -1;
  int ranks = 0;  ///< simulated ranks of the COMMAND (estimate mode)
  bool json = false, calibrate = false;
  std::vector<std::string> command;  ///< after --: the command to run in estimate mode
};

nlohmann::json read_json(const std::string& file, const char* what) {
  std::ifstream in(file);
  check_arg(static_cast<bool>(in), kOp, "cannot read the {} '{}'", what, file);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& error) {
    throw InvalidArgument(
        kOp, fmt::format("the {} '{}' is not valid JSON: {}", what, file, one_line(error.what())));
  }
}

/// Where shipped cluster files are looked for: $TESSERA_CLUSTERS, the install's share folder,
/// the source tree's.
std::vector<std::filesystem::path> cluster_dirs() {
  std::vector<std::filesystem::path> dirs;
  if (const char* env = std::getenv("TESSERA_CLUSTERS"); env != nullptr && *env != '\0')
    dirs.emplace_back(env);
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) dirs.push_back(self.parent_path().parent_path() / "share" / "tessera" / "clusters");
  dirs.emplace_back(TESSERA_CLUSTER_DIR);
  return dirs;
}

std::vector<std::string> known_clusters() {
  std::vector<std::string> names;
  for (const auto& dir : cluster_dirs()) {
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(dir, error))
      if (entry.path().extension() == ".json") {
        const std::string name = entry.path().stem().string();
        if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
      }
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

/// The machine named `cluster`: a file path (with a '/' or ending in .json) or the name of a
/// shipped cluster file.
cost::Machine load_machine(const std::string& cluster) {
  check_arg(!cluster.empty(), kOp, "--cluster is empty");
  std::string file;
  if (cluster.find('/') != std::string::npos || cluster.ends_with(".json")) {
    file = cluster;
  } else {
    for (const auto& dir : cluster_dirs())
      if (std::filesystem::exists(dir / (cluster + ".json"))) {
        file = (dir / (cluster + ".json")).string();
        break;
      }
    check_arg(!file.empty(), kOp, "unknown cluster '{}' (known: {}; or give a machine file)",
              cluster, fmt::join(known_clusters(), ", "));
  }
  return cost::machine_from_json(read_json(file, "machine file"));
}

namespace {

/// Runs `command` in a shell; throws naming it when it fails.
void run_checked(const std::string& command) {
  const int status = std::system(command.c_str());
  check_arg(status == 0, kOp, "calibration step failed (exit status {}): {}", status, command);
}

double load_average() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

/// Fits a backend's link from the all_gather_v rows of `bench comm --json` at 2 ranks (each
/// row's best time over `runs`): the model's all_gather_v at 2 ranks is alpha + f N / beta, f
/// the share of the gathered buffer N a rank copies (the local backend: 1, its own block too;
/// MPI: 1/2), so a line through (f N, seconds) gives alpha and beta, and each row beta at its
/// working set (P + 1) N = 3 N (cost::collective_working_set).
cost::Link fit_comm(const std::vector<nlohmann::json>& runs, double copied_share,
                    const std::string& what) {
  std::map<double, double> best;  // by global bytes N
  for (const nlohmann::json& document : runs)
    for (const nlohmann::json& row : document.value("rows", nlohmann::json::array()))
      if (row.value("op", std::string()) == "all_gather_v") {
        const double bytes = row.at("bytes").get<double>();
        const double seconds = row.at("time_us").get<double>() * 1e-6;
        const auto [it, fresh] = best.emplace(bytes, seconds);
        if (!fresh) it->second = std::min(it->second, seconds);
      }
  check_arg(best.size() >= 2, kOp, "calibration: {} gave fewer than two all_gather_v rows", what);
  std::vector<double> bytes, seconds, working_sets;
  for (const auto& [global, time] : best) {
    bytes.push_back(copied_share * global);
    seconds.push_back(time);
    working_sets.push_back(3 * global);
  }
  return cost::fit_link_curve(bytes, seconds, working_sets);
}

/// The node's copy bandwidth (bytes read plus written per second, summed over `threads` threads
/// copying at once, what halo packing and redistribute's local copies do) at working sets from
/// 256 KiB to 256 MiB: each thread copies its own source of a size, the best of several rounds.
/// The destinations are cold: each copy writes the next slot of a 64 MiB ring per thread (twice
/// a common last-level cache), as an op writes its output into memory it has just allocated
/// rather than into the buffer it wrote a moment ago.
cost::BandwidthCurve copy_bandwidth_curve(int threads) {
  cost::BandwidthCurve curve;
  for (size_t bytes = size_t{64} << 10; bytes <= (size_t{128} << 20) / static_cast<size_t>(threads);
       bytes *= 4) {
    const size_t slots = std::max<size_t>(2, (size_t{64} << 20) / bytes);
    std::vector<std::vector<char>> from(static_cast<size_t>(threads)),
        to(static_cast<size_t>(threads));
    for (int t = 0; t < threads; ++t) {
      from[static_cast<size_t>(t)].assign(bytes, static_cast<char>(t + 1));
      to[static_cast<size_t>(t)].assign(bytes * slots, 0);  // touched here, out of the timing
    }
    // Enough copies per round to take about 20 ms from memory; the best of 5 rounds.
    const int copies = static_cast<int>(std::clamp<size_t>((size_t{256} << 20) / bytes, 1, 4096));
    double best = 0;
    for (int round = 0; round < 5; ++round) {
      std::vector<double> seconds(static_cast<size_t>(threads), 0);
      std::vector<std::thread> workers;
      for (int t = 0; t < threads; ++t)
        workers.emplace_back([&, t] {
          std::vector<char>& source = from[static_cast<size_t>(t)];
          std::vector<char>& ring = to[static_cast<size_t>(t)];
          const auto start = std::chrono::steady_clock::now();
          for (int c = 0; c < copies; ++c) {
            char* target = ring.data() + (static_cast<size_t>(c) % slots) * bytes;
            std::memcpy(target, source.data(), bytes);
            source[static_cast<size_t>(c) % bytes] =
                target[bytes - 1 - static_cast<size_t>(c) % bytes];
          }
          seconds[static_cast<size_t>(t)] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        });
      for (std::thread& worker : workers) worker.join();
      const double slowest = *std::max_element(seconds.begin(), seconds.end());
      if (slowest > 0)
        best = std::max(best, 2.0 * static_cast<double>(bytes) * copies * threads / slowest);
    }
    curve.emplace_back(2.0 * static_cast<double>(bytes) * threads, best);
  }
  return curve;
}

/// Seconds a strided host copy (copy_strided_host, what packing a halo face or a box does)
/// spends per contiguous run besides its bytes: 32768 runs of 64 bytes out of rows of 128
/// bytes, against one memcpy of the same bytes, both in the cache; the best of 20.
double copy_run_seconds() {
  constexpr int64_t kRuns = 32768, kRun = 16;  // floats per run
  std::vector<float> source(static_cast<size_t>(2 * kRuns * kRun), 1.0f),
      target(static_cast<size_t>(kRuns * kRun), 0.0f);
  const int64_t shape[2] = {kRuns, kRun}, source_strides[2] = {2 * kRun, 1},
                target_strides[2] = {kRun, 1};
  double strided = 1e30, dense = 1e30;
  for (int round = 0; round < 20; ++round) {
    auto start = std::chrono::steady_clock::now();
    copy_strided_host(target.data(), target_strides, source.data(), source_strides, shape, 2,
                      sizeof(float));
    auto middle = std::chrono::steady_clock::now();
    std::memcpy(target.data(), source.data(), target.size() * sizeof(float));
    auto end = std::chrono::steady_clock::now();
    source[static_cast<size_t>(round)] = target[target.size() - 1 - static_cast<size_t>(round)];
    strided = std::min(strided, std::chrono::duration<double>(middle - start).count());
    dense = std::min(dense, std::chrono::duration<double>(end - middle).count());
  }
  return std::max(0.0, strided - dense) / static_cast<double>(kRuns);
}

nlohmann::json run_json(const std::string& command, const std::string& out) {
  run_checked(command + " > " + out);
  return read_json(out, "benchmark output");
}

void calibrate(const EstimateOptions& options) {
  check_arg(!options.out.empty(), kOp, "--calibrate needs --out MACHINE.json");
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("tessera-calibrate-{}", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string exe = self.string();
  const double load_before = load_average();
  const auto at = [&dir](const char* name) { return (dir / name).string(); };
  std::fprintf(stderr, "tessera estimate: calibrating (load %.2f)\n", load_before);

  cost::Machine machine;
  machine.name = "calibrated";
  machine.ranks_per_node = 4096;  // every rank of a run on this machine shares it
  machine.shared_compute = true;
  machine.backend = "local";

  // Links: bench comm's all_gather_v at 2 ranks, 64 KiB .. 64 MiB in steps of 2 (two sweeps of
  // steps of 4; working sets 192 KiB .. 192 MiB: in the caches and out of them), the best of 4
  // rounds per size. The rounds are spread over the calibration (between the compute runs
  // below): MPI ranks that busy-poll on every core lose whole seconds to anything else that
  // wakes up on the machine, and the best of runs seconds apart misses such a spell.
  const bool with_mpi = mpi_compiled() && std::system("command -v mpiexec > /dev/null 2>&1") == 0;
  std::vector<nlohmann::json> local_runs, mpi_runs;
  int round = 0;
  const auto comm_round = [&] {
    const auto sweep = [&](const std::string& launch, const std::string& name,
                           std::vector<nlohmann::json>& runs) {
      for (size_t smallest : {size_t{64} << 10, size_t{128} << 10})
        runs.push_back(run_json(
            fmt::format("{} bench comm --ranks 2 --min-bytes {} --max-bytes {} --iterations 10 "
                        "--json",
                        launch, smallest, size_t{64} << 20),
            at(fmt::format("{}{}-{}.json", name, round, smallest).c_str())));
    };
    sweep("TESSERA_BACKEND=local TESSERA_TRACE= " + exe, "comm_local", local_runs);
    if (with_mpi) sweep("TESSERA_TRACE= mpiexec -n 2 " + exe, "comm_mpi", mpi_runs);
    ++round;
  };

  // Compute: traced runs of the workloads' kernels; throughputs from their op events. One
  // thread a process: one process alone (the rate of one core whose neighbours idle), then one
  // process per core at once, each running the same workloads (the rate of a core among busy
  // ones: ops bound by memory share the caches and the memory bandwidth). The same shapes in
  // both, whatever the core count. Several OpenMP threads on cores that other processes also use
  // stall each other at every barrier; one thread per core is what the ranks of a multi-rank run
  // use too.
  const std::string env = "TESSERA_BACKEND=local TESSERA_THREADS_PER_RANK=1 TESSERA_TRACE=";
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const auto trace_file = [&](const std::string& name, const std::string& tag, int copy) {
    return at(fmt::format("{}{}{}.json", name, tag, copy).c_str());
  };
  // `copies` processes of one workload at once, each traced to its own file.
  const auto run_copies = [&](const std::string& name, const std::string& tag, int copies,
                              const std::function<std::string(int)>& arguments) {
    std::string command = "pids=''; ";
    for (int copy = 0; copy < copies; ++copy)
      command += fmt::format("{}{} {} {} > /dev/null & pids=\"$pids $!\"; ", env,
                             trace_file(name, tag, copy), exe, arguments(copy));
    command += "rc=0; for p in $pids; do wait $p || rc=1; done; exit $rc";
    run_checked(command);
  };
  const auto compute_runs = [&](int copies, const std::string& tag) {
    comm_round();
    run_copies("train", tag, copies, [](int) {
      return std::string(
          "bench train --shape 2,8,24,24,24 --hidden 16 --layers 3 --mesh 1x1 "
          "--steps 2 --json");
    });
    comm_round();
    run_copies("na", tag, copies, [](int) {
      return std::string(
          "bench na --size 32 --heads 2 --dim 32 --kernel 7 --ranks 1 "
          "--iterations 10 --json");
    });
    run_copies("sim", tag, copies, [&](int copy) {
      return fmt::format(
          "simulate gray-scott --size 96,96,96 --steps 10 --every 10 --out {} --json",
          at(fmt::format("gs{}{}.h5", tag, copy).c_str()));
    });
  };
  compute_runs(1, "");
  if (cores > 1) compute_runs(cores, "_loaded");
  comm_round();
  cost::LinkSet local{.algorithm = cost::Algorithm::direct, .asynchronous = false};
  local.intra = local.inter = fit_comm(local_runs, 1.0, "bench comm (local)");
  machine.links["local"] = local;
  if (with_mpi) {
    cost::LinkSet mpi{.algorithm = cost::Algorithm::mpi, .asynchronous = true};
    mpi.intra = mpi.inter = fit_comm(mpi_runs, 0.5, "bench comm (mpiexec -n 2)");
    machine.links["mpi"] = mpi;
  }
  // Per family (for ops these runs did not meet) and per op (each op's own rate: on a CPU the
  // ops of one family differ widely, e.g. gelu's transcendental math against a plain add).
  // Each op's rate per thread (its self time summed over the ranks), times the cores: the
  // node's (its ranks split it).
  const auto samples_of = [&](const std::string& tag, int copies) {
    std::array<std::map<std::string, cost::FamilySample>, 2> maps;  // by family, by op
    for (const char* name : {"train", "na", "sim"})
      for (int copy = 0; copy < copies; ++copy) {
        const nlohmann::json trace = read_json(trace_file(name, tag, copy), "trace");
        for (bool by_op : {false, true})
          for (const auto& [key, sample] : cost::family_samples(trace, by_op)) {
            cost::FamilySample& total = maps[by_op][key];
            total.flops += sample.flops;
            total.bytes += sample.bytes;
            total.seconds += sample.seconds;
            total.count += sample.count;
          }
      }
    for (auto& map : maps)
      for (auto& [key, sample] : map) sample.seconds /= cores;
    return maps;
  };
  const auto alone = samples_of("", 1);
  const auto loaded = cores > 1 ? samples_of("_loaded", cores) : alone;
  machine.memory_bandwidth_by_working_set = copy_bandwidth_curve(cores);
  machine.memory_bandwidth = machine.memory_bandwidth_by_working_set.back().second;
  machine.copy_run_seconds = copy_run_seconds();
  const auto peak_of = [](const std::map<std::string, cost::FamilySample>& samples) {
    double peak = 0;
    for (const auto& [family, sample] : samples)
      if (sample.seconds > 0) peak = std::max(peak, sample.flops / sample.seconds);
    return peak;
  };
  const double peak = peak_of(loaded[0]);
  machine.families["default"] = {peak, machine.memory_bandwidth};
  cost::fit_families(machine, loaded[0], peak);
  cost::fit_families(machine, loaded[1], peak);
  if (cores > 1) {
    const double peak_alone = peak_of(alone[0]);
    machine.families_alone["default"] = {peak_alone, machine.memory_bandwidth};
    cost::fit_families_alone(machine, alone[0], peak_alone);
    cost::fit_families_alone(machine, alone[1], peak_alone);
  }
  const auto& per_op = loaded[1];
  machine.op_overhead = 0;
  machine.cores_per_node = cores;

  nlohmann::json document = cost::machine_to_json(machine);
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  nlohmann::json measured = nlohmann::json::object();
  for (const auto& [family, sample] : per_op)
    measured[family] = {{"flops", sample.flops},
                        {"bytes", sample.bytes},
                        {"seconds", sample.seconds},
                        {"events", sample.count}};
  document["calibration"] = {
      {"date", stamp},
      {"cores", std::thread::hardware_concurrency()},
      {"load_average_before", load_before},
      {"load_average_after", load_average()},
      {"links",
       "bench comm all_gather_v at 2 ranks, 64 KiB..64 MiB, the best of 4 rounds per size spread "
       "over the calibration (local; mpiexec -n 2): alpha and beta fitted on relative error, "
       "beta_by_working_set per size at the working set 3 N"},
      {"memory_bandwidth",
       "memcpy on every core at once, each of its own buffers, 64 KiB..64 MiB per core, the best "
       "of 5 rounds (bytes read + written per second over the node; memory_bandwidth: the "
       "largest size)"},
      {"copy_run_seconds",
       "a strided copy of 32768 runs of 64 bytes against one memcpy of the same bytes, in the "
       "cache, the best of 20: the difference per run"},
      {"compute",
       "per op and per op family, flops or bytes over self time in traced one-rank runs of one "
       "thread: bench train (conv3d 2x8x24^3, hidden 16, 3 layers), bench na (32x32, 2 heads, D "
       "32, k 7), simulate gray-scott 96^3; families: one process per core at once (every core "
       "busy); families_alone: one process (the other cores idle)"},
      {"samples", measured}};
  {
    std::ofstream out(options.out);
    check_arg(static_cast<bool>(out), kOp, "cannot write the machine file '{}'", options.out);
    out << document.dump(2) << "\n";
    check_arg(static_cast<bool>(out), kOp, "cannot write the machine file '{}'", options.out);
  }
  std::filesystem::remove_all(dir);
  std::fprintf(stderr, "tessera estimate: wrote %s\n", options.out.c_str());
}

void estimate_trace(const EstimateOptions& options) {
  check_arg(!options.cluster.empty(), kOp, "--trace-in needs --cluster NAME|FILE");
  const cost::Machine machine = load_machine(options.cluster);
  const nlohmann::json trace = read_json(options.trace_in, "trace");
  const cost::Prediction prediction =
      cost::replay(trace, machine, {.backend = options.backend, .launch = options.launch});
  if (options.json) {
    nlohmann::json document = cost::prediction_to_json(prediction);
    document["trace"] = options.trace_in;
    std::cout << document.dump(2) << "\n";
    return;
  }
  fmt::print(
      "estimate of {} on {} ({} backend, {} ranks, {} steps)\n"
      "  step time         {:10.3f} ms (median over steps, slowest rank)\n"
      "  compute           {:10.3f} ms per step and rank\n"
      "  communication     {:10.3f} ms per step and rank\n"
      "  exposed comm      {:10.3f} ms per step and rank (waiting, not hidden by compute)\n",
      options.trace_in, prediction.machine, prediction.backend, prediction.ranks, prediction.steps,
      prediction.step_seconds * 1e3, prediction.compute_seconds * 1e3,
      prediction.comm_seconds * 1e3, prediction.exposed_comm_seconds * 1e3);
}

/// P's prime factors spread over `dims` mesh dims as evenly as they go (largest first), e.g.
/// 1024 over 3 dims: 16x8x8.
std::vector<int64_t> balanced_mesh(int64_t ranks, int dims) {
  std::vector<int64_t> primes;
  for (int64_t p = 2, rest = ranks; rest > 1; ++p)
    while (rest % p == 0) {
      primes.push_back(p);
      rest /= p;
      if (p * p > rest && rest > 1) {
        primes.push_back(rest);
        rest = 1;
      }
    }
  std::sort(primes.rbegin(), primes.rend());
  std::vector<int64_t> mesh(static_cast<size_t>(dims), 1);
  for (int64_t p : primes) *std::min_element(mesh.begin(), mesh.end()) *= p;
  std::sort(mesh.rbegin(), mesh.rend());
  return mesh;
}

/// The command of one row of a scaling table: {P} is the rank count, {meshK} a balanced K-d
/// mesh of P ranks ("16x8x8"), {weak:N1,N2,..} the extents as given (strong scaling) or, for weak
/// scaling, the first K of them times the mesh's extents (a single N stands for K of them;
/// N*P without a mesh placeholder): {weak:256} with {mesh3} at 1024 ranks is "4096,2048,2048".
std::vector<std::string> scaling_command(const std::vector<std::string>& command, int64_t ranks,
                                         bool weak) {
  int dims = 1;
  for (const std::string& argument : command)
    for (int k = 1; k <= 8; ++k)
      if (argument.find(fmt::format("{{mesh{}}}", k)) != std::string::npos) dims = k;
  const std::vector<int64_t> mesh = balanced_mesh(ranks, dims);
  std::vector<std::string> out;
  for (std::string argument : command) {
    for (size_t at; (at = argument.find("{P}")) != std::string::npos;)
      argument.replace(at, 3, std::to_string(ranks));
    for (int k = 1; k <= 8; ++k) {
      const std::string key = fmt::format("{{mesh{}}}", k);
      for (size_t at; (at = argument.find(key)) != std::string::npos;)
        argument.replace(at, key.size(),
                         fmt::format("{}", fmt::join(balanced_mesh(ranks, k), "x")));
    }
    for (size_t at; (at = argument.find("{weak:")) != std::string::npos;) {
      const size_t close = argument.find('}', at);
      check_arg(close != std::string::npos, kOp, "'{}': {{weak:N}} is not closed", argument);
      std::vector<int64_t> bases;
      try {
        bases = parse_list(argument.substr(at + 6, close - at - 6));
      } catch (const Error&) {
      }
      check_arg(!bases.empty() &&
                    std::all_of(bases.begin(), bases.end(), [](int64_t base) { return base >= 1; }),
                kOp, "'{}': {{weak:N}} needs integers N >= 1 (N or N1,N2,..)", argument);
      // Weak scaling: the first extents grow with the mesh, one per mesh dim (a single N stands
      // for one per mesh dim); the rest stay.
      if (weak) {
        if (bases.size() == 1 && dims > 1) bases.assign(static_cast<size_t>(dims), bases[0]);
        if (dims == 1 && bases.size() == 1) {
          bases[0] *= ranks;
        } else {
          for (size_t d = 0; d < bases.size() && d < mesh.size(); ++d) bases[d] *= mesh[d];
        }
      }
      argument.replace(at, close + 1 - at, fmt::format("{}", fmt::join(bases, ",")));
    }
    out.push_back(argument);
  }
  return out;
}

/// One estimate of a command in estimate mode.
struct CommandEstimate {
  cost::Prediction prediction;
  size_t peak_bytes = 0;  ///< the most any rank held
  double record_seconds = 0;
};

CommandEstimate estimate_command(const std::vector<std::string>& command, int ranks,
                                 const cost::Machine& machine, const EstimateOptions& options) {
  CommandEstimate result;
  const auto start = std::chrono::steady_clock::now();
  // What the command prints goes to stderr, so that this command's own output (the --json
  // document, the table) is all of stdout.
  std::cout.flush();
  std::fflush(stdout);
  const int saved_stdout = dup(STDOUT_FILENO);
  dup2(STDERR_FILENO, STDOUT_FILENO);
  struct Restore {
    int saved;
    ~Restore() {
      std::cout.flush();
      std::fflush(stdout);
      dup2(saved, STDOUT_FILENO);
      close(saved);
    }
  } restore{saved_stdout};
  const estimate::Recording recording = record_command(ranks, command, kOp);
  result.record_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (size_t bytes : recording.peak_bytes) result.peak_bytes = std::max(result.peak_bytes, bytes);
  result.prediction = cost::replay(nlohmann::json::parse(recording.json()), machine,
                                   {.backend = options.backend, .launch = options.launch});
  return result;
}

void estimate_mode(const EstimateOptions& options) {
  check_arg(!options.cluster.empty(), kOp, "a COMMAND needs --cluster NAME|FILE");
  check_arg(options.trace_in.empty(), kOp, "give a COMMAND or --trace-in, not both");
  const cost::Machine machine = load_machine(options.cluster);
  const std::string text = fmt::format("{}", fmt::join(options.command, " "));
  if (options.scaling.empty()) {
    check_arg(options.ranks >= 1, kOp, "a COMMAND needs --ranks P (its mesh's size)");
    const CommandEstimate one = estimate_command(options.command, options.ranks, machine, options);
    const cost::Prediction& p = one.prediction;
    if (options.json) {
      nlohmann::json document = cost::prediction_to_json(p);
      document["command"] = options.command;
      document["peak_bytes_per_rank"] = one.peak_bytes;
      document["record_seconds"] = one.record_seconds;
      std::cout << document.dump(2) << "\n";
      return;
    }
    fmt::print(
        "estimate of `tessera {}` on {} ({} backend, {} ranks, {} steps; recorded in {:.1f} s)\n"
        "  step time         {:10.3f} ms (median over steps, slowest rank)\n"
        "  compute           {:10.3f} ms per step and rank\n"
        "  communication     {:10.3f} ms per step and rank\n"
        "  exposed comm      {:10.3f} ms per step and rank (waiting, not hidden by compute)\n"
        "  peak bytes        {:10.3f} MiB per rank (tensor storage, the most any rank holds)\n",
        text, p.machine, p.backend, p.ranks, p.steps, one.record_seconds, p.step_seconds * 1e3,
        p.compute_seconds * 1e3, p.comm_seconds * 1e3, p.exposed_comm_seconds * 1e3,
        static_cast<double>(one.peak_bytes) / (1 << 20));
    return;
  }
  check_arg(options.ranks == 0, kOp, "--scaling gives the rank counts: drop --ranks");
  std::vector<int64_t> counts;
  for (int64_t count : parse_list(options.scaling)) {
    check_arg(count >= 1 && count <= estimate::kMaxSimulatedRanks, kOp,
              "--scaling {}: {} is not within 1..{}", options.scaling, count,
              estimate::kMaxSimulatedRanks);
    counts.push_back(count);
  }
  check_arg(!counts.empty(), kOp, "--scaling: give rank counts, e.g. 1,8,64");
  const bool has_weak = text.find("{weak:") != std::string::npos;
  nlohmann::json document{{"command", options.command}, {"cluster", machine.name}};
  std::vector<plot::ScalingSeries> series;
  for (const bool weak : {false, true}) {
    if (weak && !has_weak) break;
    const char* kind = weak ? "weak" : "strong";
    plot::ScalingSeries line{.label = fmt::format("{} scaling on {}", kind, machine.name),
                             .points = {}};
    nlohmann::json rows = nlohmann::json::array();
    if (!options.json)
      fmt::print(
          "{} scaling of `tessera {}` on {}:\n{:>6} {:>12} {:>10} {:>12} {:>12} {:>12} "
          "{:>12}\n",
          kind, text, machine.name, "ranks", "step ms", "efficiency", "compute ms", "comm ms",
          "exposed ms", "peak MiB");
    for (int64_t count : counts) {
      const std::vector<std::string> command = scaling_command(options.command, count, weak);
      const CommandEstimate one =
          estimate_command(command, static_cast<int>(count), machine, options);
      const cost::Prediction& p = one.prediction;
      const plot::ScalingPoint point{.ranks = count,
                                     .seconds = p.step_seconds,
                                     .work = weak ? static_cast<double>(count) : 1.0};
      line.points.push_back(point);
      const double efficiency = plot::efficiency(line.points.front(), point);
      rows.push_back({{"ranks", count},
                      {"command", command},
                      {"step_seconds", p.step_seconds},
                      {"efficiency", efficiency},
                      {"compute_seconds", p.compute_seconds},
                      {"comm_seconds", p.comm_seconds},
                      {"exposed_comm_seconds", p.exposed_comm_seconds},
                      {"peak_bytes_per_rank", one.peak_bytes},
                      {"record_seconds", one.record_seconds}});
      if (!options.json)
        fmt::print("{:>6} {:>12.3f} {:>10.3f} {:>12.3f} {:>12.3f} {:>12.3f} {:>12.2f}\n", count,
                   p.step_seconds * 1e3, efficiency, p.compute_seconds * 1e3, p.comm_seconds * 1e3,
                   p.exposed_comm_seconds * 1e3, static_cast<double>(one.peak_bytes) / (1 << 20));
    }
    document[kind] = rows;
    series.push_back(line);
  }
  if (!options.plot.empty()) {
    plot::plot_scaling(series, plot::ImageSize{}, options.plot,
                       fmt::format("estimated on {}", machine.name));
    if (!options.json) fmt::print("plot: {}\n", options.plot);
  }
  if (options.json) std::cout << document.dump(2) << "\n";
}

}  // namespace

void register_estimate(CLI::App& app) {
  auto options = std::make_shared<EstimateOptions>();
  auto* estimate = app.add_subcommand(
      "estimate", "Predict a traced run's step time on a modeled machine, or calibrate this one");
  estimate->add_option("--cluster", options->cluster,
                       "Machine: a shipped cluster (h100-ib, h200-ib) or a machine file");
  estimate->add_option("--trace-in", options->trace_in,
                       "Trace of the run to predict (from --trace or TESSERA_TRACE)");
  estimate->add_option("--backend", options->backend,
                       "Backend to model (default: the trace's if the machine has it, else the "
                       "machine's)");
  estimate->add_option("--launch", options->launch,
                       "Which launch of a trace with several (0, 1, ...; default: the last)");
  estimate->add_flag("--json", options->json, "Print JSON (step_seconds and the breakdown)");
  estimate->add_flag("--calibrate", options->calibrate,
                     "Measure this machine (links and op throughputs) into --out");
  estimate->add_option("--out", options->out, "Machine file written by --calibrate");
  // The hook for estimate mode (a COMMAND run on shape-only tensors at several rank counts):
  // each count's trace goes through cost::replay like --trace-in's does.
  estimate
      ->add_option("--ranks", options->ranks,
                   "Simulated ranks of the COMMAND (its mesh's size), 1 to " +
                       std::to_string(estimate::kMaxSimulatedRanks))
      ->check(CLI::Range(1, estimate::kMaxSimulatedRanks));
  estimate->add_option("--scaling", options->scaling,
                       "Rank counts of a strong (and, with {weak:N} in the COMMAND, weak) scaling "
                       "table, e.g. 1,8,64,512,1024; the COMMAND may use {P}, {mesh1}..{mesh4}, "
                       "{weak:N}");
  estimate->add_option("--plot", options->plot, "With --scaling: a PNG of the table");
  estimate->add_option("command", options->command,
                       "After --: the command to estimate, e.g. -- simulate gray-scott ...");
  estimate->callback([options] {
    if (!options->command.empty()) {
      check_arg(!options->calibrate, kOp, "--calibrate takes no COMMAND");
      if (!options->plot.empty()) {
        check_arg(!options->scaling.empty(), kOp, "--plot draws the --scaling table");
        plot::check_available();
        io::check_output_path(kOp, options->plot);
      }
      estimate_mode(*options);
      return;
    }
    check_arg(options->scaling.empty() && options->ranks == 0, kOp,
              "--scaling and --ranks estimate a COMMAND: give it after --");
    if (options->calibrate) {
      check_arg(options->trace_in.empty(), kOp, "--calibrate and --trace-in exclude each other");
      calibrate(*options);
      return;
    }
    check_arg(!options->trace_in.empty(), kOp, "give --trace-in TRACE.json (or --calibrate)");
    estimate_trace(*options);
  });
}

}  // namespace tessera::cli
