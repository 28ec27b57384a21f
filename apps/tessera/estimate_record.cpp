// `tessera estimate-record --ranks P --out EVENTS.json -- COMMAND ARGS...`: runs any tessera
// command in estimate mode (core/estimate/record.hpp): its launch starts P simulated ranks that
// run the real code path on shape-only tensors, and the events every rank records (the trace's
// format) are written with each rank's peak tensor bytes. The command's own --ranks / --mesh
// decide its world, which must have P ranks.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "apps/tessera/commands.hpp"
#include "apps/tessera/estimate.hpp"
#include "core/errors.hpp"
#include "core/estimate/record.hpp"
#include "core/estimate/sim_comm.hpp"

namespace tessera::cli {

namespace {

struct EstimateRecordOptions {
  int ranks = 1;
  std::string out;
  std::vector<std::string> command;
};

/// The subcommands a recording may run, on a fresh app (the same ones `tessera` has).
void register_recordable(CLI::App& app) {
  app.require_subcommand(1);
  register_demo(app);
  register_run_op(app);
  register_infer(app);
  register_simulate(app);
  register_train(app);
}

/// Refuses, in one line naming why, a command that estimate mode does not run: the ones whose work
/// is not a sharded program on ranks (they only read or write files, or measure this machine).
void check_recordable(const std::string& name, const std::string& op) {
  static const std::set<std::string> recordable{"demo", "run-op", "infer", "simulate", "train"};
  if (recordable.count(name) > 0) return;
  static const std::map<std::string, std::string> reasons{
      {"info", "it prints this build's configuration and runs no ranks"},
      {"ops", "it lists the registered ops and runs no ranks"},
      {"inspect", "it reads a file's metadata and runs no ranks"},
      {"plot", "it draws files into PNGs and runs no ranks"},
      {"scatter", "its work is reading a file's data, which estimate mode never does"},
      {"convert", "its work is reading and writing file data, which estimate mode never does"},
      {"compare", "its work is reading two files' data, which estimate mode never does"},
      {"generate", "its work is writing a sample data file, which estimate mode never does"},
      {"bench",
       "it measures this machine's real run times (trace a benchmark with --trace and give the "
       "trace to --trace-in)"},
      {"estimate", "it is an estimate already"},
      {"estimate-record", "it is an estimate already"}};
  const auto reason = reasons.find(name);
  throw InvalidArgument(
      op,
      fmt::format("'{}' cannot be estimated: {}; estimate mode runs demo, run-op, infer, "
                  "simulate and train",
                  name, reason != reasons.end() ? reason->second : "it is not a tessera command"));
}

void write_recording(const std::string& file, const std::string& text) {
  const std::string temporary = file + ".partial";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    check_arg(static_cast<bool>(out), "estimate-record", "cannot write '{}'", file);
    out << text;
    check_arg(static_cast<bool>(out), "estimate-record", "cannot write '{}'", file);
  }
  std::filesystem::rename(temporary, file);
}

}  // namespace

estimate::Recording record_command(int ranks, const std::vector<std::string>& command,
                                   const std::string& op) {
  check_arg(!command.empty(), op, "no command given (e.g. -- simulate gray-scott --mesh 2x2 ...)");
  check_recordable(command.front(), op);
  CLI::App inner{"tessera " + command.front()};
  register_recordable(inner);
  std::vector<std::string> arguments(command.rbegin(),
                                     command.rend());  // CLI11 parses from the back
  estimate::RecordLaunches recording(ranks);
  try {
    inner.parse(arguments);
  } catch (const CLI::ParseError& error) {
    throw InvalidArgument(op, fmt::format("{}: {}", command.front(), one_line(error.what())));
  }
  check_arg(recording.launches() > 0, op, "'{}' launched no ranks: nothing was recorded",
            fmt::join(command, " "));
  return recording.recording();
}

void register_estimate_record(CLI::App& app) {
  auto options = std::make_shared<EstimateRecordOptions>();
  CLI::App* command = app.add_subcommand("estimate-record",
                                         "Run a command (simulate, run-op, train, infer, demo) on "
                                         "P simulated ranks without data and write every rank's "
                                         "events and peak tensor bytes");
  command
      ->add_option("--ranks", options->ranks,
                   "Simulated ranks, 1 to " + std::to_string(estimate::kMaxSimulatedRanks) +
                       " (the command's own mesh must have as many)")
      ->required()
      ->check(CLI::Range(1, estimate::kMaxSimulatedRanks));
  command->add_option("--out", options->out, "Events JSON to write")->required();
  command->add_option("command", options->command,
                      "The command and its arguments, after --: e.g. -- simulate gray-scott ...");
  command->callback([options] {
    const std::vector<std::string>& rest = options->command;
    check_arg(!rest.empty(), "estimate-record",
              "no command given (e.g. -- simulate gray-scott --mesh 2x2 ...)");
    check_recordable(rest.front(), "estimate-record");
    // Checked before anything runs, so a bad path costs nothing.
    const std::filesystem::path parent = std::filesystem::absolute(options->out).parent_path();
    check_arg(std::filesystem::is_directory(parent), "estimate-record",
              "--out {}: '{}' is not a directory", options->out, parent.string());
    CLI::App inner{"tessera " + rest.front()};
    register_recordable(inner);
    std::vector<std::string> arguments(rest.rbegin(), rest.rend());  // CLI11 parses from the back
    estimate::RecordLaunches recording(options->ranks);
    try {
      inner.parse(arguments);
    } catch (const CLI::ParseError& error) {
      if (error.get_exit_code() == 0) {  // the command's --help
        inner.exit(error);
        return;
      }
      throw InvalidArgument("estimate-record",
                            fmt::format("{}: {}", rest.front(), one_line(error.what())));
    }
    check_arg(recording.launches() > 0, "estimate-record",
              "'{}' launched no ranks: nothing was recorded", fmt::join(rest, " "));
    write_recording(options->out, recording.recording().json());
    std::printf("recorded %d ranks (%d launch%s) into %s\n", options->ranks, recording.launches(),
                recording.launches() == 1 ? "" : "es", options->out.c_str());
  });
}

}  // namespace tessera::cli
