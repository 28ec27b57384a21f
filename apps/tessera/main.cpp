// The tessera command-line tool. Errors print one line, "tessera: error: [op] ...", and exit
// with code 2 (CLI11's own parse errors too, tagged [cli]); an error that not every rank raised
// ends the whole MPI job, so no rank is left waiting.
#include <fmt/format.h>

#include <cstdio>
#include <new>
#include <string>

#include "apps/tessera/commands.hpp"
#include "core/agree.hpp"
#include "core/comm/mpi_comm.hpp"
#include "core/config.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Tessera: domain decomposition of scientific tensors"};
  app.set_version_flag("--version", TESSERA_VERSION);
  app.require_subcommand(1);
  tessera::cli::register_info(app);
  tessera::cli::register_demo(app);
  tessera::cli::register_run_op(app);
  tessera::cli::register_infer(app);
  tessera::cli::register_train(app);
  tessera::cli::register_ops_list(app);
  tessera::cli::register_io_commands(app);
  tessera::cli::register_generate(app);
  tessera::cli::register_simulate(app);
  tessera::cli::register_plot(app);
  tessera::cli::register_estimate(app);
  tessera::cli::register_bench(app);
  tessera::cli::register_estimate_record(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return app.exit(error);  // --help, --version
    std::fprintf(stderr, "tessera: error: [cli] %s (see --help)\n",
                 tessera::cli::one_line(error.what()).c_str());
    return 2;
  } catch (const tessera::AgreedError& error) {
    // Every rank raised it: one line from the first rank is enough.
    if (!tessera::mpi_initialized() || tessera::mpi_world()->rank() == 0)
      std::fprintf(stderr, "tessera: error: %s\n", error.what());
    return 2;
  } catch (const tessera::Error& error) {
    std::fprintf(stderr, "tessera: error: %s\n", error.what());
    if (tessera::mpi_initialized()) tessera::mpi_abort(2);
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "tessera: error: [tessera] out of memory (an allocation failed)\n");
    if (tessera::mpi_initialized()) tessera::mpi_abort(2);
    return 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tessera: error: %s\n", error.what());
    if (tessera::mpi_initialized()) tessera::mpi_abort(2);
    return 2;
  }
  return 0;
}
