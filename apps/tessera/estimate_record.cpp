// `tessera estimate-record --ranks P --out EVENTS.json -- COMMAND ARGS...`: runs any tessera
// command in estimate mode (core/estimate/record.hpp): its launch starts P simulated ranks that
// run the real code path on shape-only tensors, and the events every rank records (the trace's
// format) are written with each rank's peak tensor bytes. The command's own --ranks / --mesh
// decide its world, which must have P ranks.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>

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
