// The pure parts of launching: reading the backend choice and the launcher's environment (no
// communication library; compiled into tessera_unit_tests too).
#include <cstdlib>

#include "core/comm/launch.hpp"

namespace tessera {

bool launched_by_mpi_launcher() {
  for (const char* variable : {"PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                               "MV2_COMM_WORLD_SIZE", "SLURM_STEP_ID"})
    if (std::getenv(variable)) return true;
  return false;
}

Backend parse_backend(const std::string& choice, bool under_launcher, bool with_mpi,
                      bool with_nccl) {
  if (choice == "local") return Backend::local;
  if (choice == "mpi") {
    if (!with_mpi)
      throw NotAvailable("backend",
                         "TESSERA_BACKEND=mpi, but this Tessera was built without MPI "
                         "(TESSERA_WITH_MPI=OFF); use local");
    return Backend::mpi;
  }
  if (choice == "nccl") {
    if (!with_nccl)
      throw NotAvailable("backend",
                         "TESSERA_BACKEND=nccl, but this Tessera was built without NCCL "
                         "(TESSERA_WITH_NCCL=OFF or NCCL not found); use local or mpi");
    return Backend::nccl;
  }
  check_arg(choice == "auto" || choice.empty(), "backend",
            "TESSERA_BACKEND='{}' (expected local, mpi, nccl or auto)", choice);
  return under_launcher && with_mpi ? Backend::mpi : Backend::local;
}

std::string backend_name(Backend backend) {
  switch (backend) {
    case Backend::local: return "local";
    case Backend::mpi: return "mpi";
    case Backend::nccl: return "nccl";
  }
  return "local";
}

int local_rank_from_env() {
  for (const char* variable :
       {"MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "FLUX_TASK_LOCAL_ID"}) {
    const char* text = std::getenv(variable);
    if (text == nullptr) continue;
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    check_arg(end != text && *end == '\0' && value >= 0 && value < (1L << 30), "launch",
              "{}='{}' is not a local rank (a non-negative integer)", variable, text);
    return static_cast<int>(value);
  }
  return 0;
}

}  // namespace tessera
