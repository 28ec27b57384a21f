// Parsing of the CLI's shared argument formats.
#include "apps/tessera/cli_parse.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "core/comm/local_comm.hpp"
#include "core/device.hpp"
#include "core/errors.hpp"
#include "core/estimate/record.hpp"
#include "core/gpu_runtime.hpp"
#include "core/layout.hpp"
#include "core/trace.hpp"

namespace tessera::cli {

void add_trace_option(CLI::App& command) {
  command.add_option_function<std::string>(
      "--trace", [](const std::string& file) { trace::start(file); },
      "Write a Chrome/Perfetto trace of the run to this file (as TESSERA_TRACE=FILE does)");
}

namespace {

std::vector<std::string> split_on(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, separator)) parts.push_back(part);
  return parts;
}

int64_t parse_integer(const std::string& text, const std::string& context) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  check_arg(used == text.size() && !text.empty(), "cli", "'{}' in '{}' is not an integer", text,
            context);
  return value;
}

}  // namespace

std::vector<int> parse_mesh(const std::string& text) {
  constexpr int64_t kMaxMeshRanks = std::numeric_limits<int>::max();
  std::vector<int> shape;
  int64_t ranks = 1;
  for (const std::string& part : split_on(text, 'x')) {
    const int64_t extent = parse_integer(part, text);
    check_arg(extent > 0, "cli", "mesh '{}' has a non-positive dim", text);
    shape.push_back(static_cast<int>(std::min<int64_t>(extent, kMaxMeshRanks + 1)));
    ranks = std::min(ranks * std::min<int64_t>(extent, kMaxMeshRanks + 1), kMaxMeshRanks + 1);
    check_arg(ranks <= kMaxMeshRanks, "cli", "mesh '{}' has more than {} ranks", text,
              kMaxMeshRanks);
  }
  check_arg(!shape.empty(), "cli", "empty mesh '{}' (expected e.g. 2x2)", text);
  return shape;
}

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> values;
  for (const std::string& part : split_on(text, ',')) values.push_back(parse_integer(part, text));
  return values;
}

std::vector<std::vector<int64_t>> parse_extents(const std::string& text) {
  std::vector<std::vector<int64_t>> groups;
  for (const std::string& group : split_on(text, ';')) groups.push_back(parse_list(group));
  return groups;
}

std::vector<int> parse_rank_counts(const std::string& text, const std::string& option) {
  std::vector<int> counts;
  for (const std::string& part : split_on(text, ',')) {
    const int64_t count = parse_integer(part, text);
    check_arg(count >= 1 && count <= kMaxLocalRanks, "cli",
              "{} {}: each local rank count must be 1 to {}", option, text, kMaxLocalRanks);
    counts.push_back(static_cast<int>(count));
  }
  check_arg(!counts.empty(), "cli", "{} is empty (expected rank counts, e.g. 1,2,4)", option);
  return counts;
}

std::string one_line(const std::string& text) {
  std::string line;
  for (char c : text) {
    if (c == '\n') {
      if (!line.empty()) line += "; ";
    } else {
      line += c;
    }
  }
  while (line.size() >= 2 && line.ends_with("; ")) line.resize(line.size() - 2);
  return line;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int MeshOptions::local_ranks() const {
  if (ranks > 0) return ranks;
  const int64_t size = mesh_size(parse_mesh(mesh));
  // Under estimate-record the ranks are simulated (core/estimate/record.hpp): thousands are fine.
  if (estimate::recording_launches()) return static_cast<int>(size);
  check_arg(size <= kMaxLocalRanks, "cli",
            "--mesh {} has {} ranks; without mpiexec at most {} local ranks run (give --ranks or "
            "use mpiexec)",
            mesh, size, kMaxLocalRanks);
  return static_cast<int>(size);
}

void select_device(const std::string& text) {
  const Device device = Device::parse(text);
  if (device.is_cuda()) {
    if (!gpu::compiled())
      throw NotAvailable("device", fmt::format("--device {}: this Tessera was built without CUDA "
                                               "(TESSERA_WITH_CUDA=OFF)",
                                               text));
    const int count = gpu::device_count();
    check_arg(count > 0, "device", "--device {}: no CUDA device is visible on this machine", text);
    check_arg(text == "cuda" || device.index < count, "device",
              "--device {}: device index {} is beyond the {} visible CUDA device(s)", text,
              device.index, count);
  }
  ::setenv("TESSERA_DEVICE", text.c_str(), 1);
}

}  // namespace tessera::cli
