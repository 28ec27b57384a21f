// Backend selection (see launch.hpp).
#include "core/comm/launch.hpp"

#include <cstdlib>

#include "core/comm/local_comm.hpp"
#include "core/comm/mpi_comm.hpp"

namespace tessera {

bool launched_by_mpi_launcher() {
  for (const char* variable : {"PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                               "MV2_COMM_WORLD_SIZE", "SLURM_STEP_ID"})
    if (std::getenv(variable)) return true;
  return false;
}

Backend backend_from_env() {
  const char* text = std::getenv("TESSERA_BACKEND");
  const std::string choice = text ? text : "auto";
  if (choice == "local") return Backend::local;
  if (choice == "mpi") return Backend::mpi;
  check_arg(choice == "auto" || choice.empty(), "backend",
            "TESSERA_BACKEND='{}' (expected local, mpi or auto)", choice);
  return launched_by_mpi_launcher() && mpi_compiled() ? Backend::mpi : Backend::local;
}

std::string backend_name(Backend backend) {
  return backend == Backend::mpi ? "mpi" : "local";
}

void launch(Backend backend, int local_ranks,
            const std::function<void(std::shared_ptr<Comm>)>& body) {
  if (backend == Backend::mpi) {
    body(mpi_world());
    return;
  }
  run_local_ranks(local_ranks, body);
}

}  // namespace tessera
