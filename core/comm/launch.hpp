// Choosing the backend at run time and running a program body on every rank of the world.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "core/comm/comm.hpp"

namespace tessera {

enum class Backend : uint8_t { local, mpi };

/// True when the environment shows an MPI launcher (mpiexec/mpirun of MPICH or Open MPI, srun).
bool launched_by_mpi_launcher();

/// TESSERA_BACKEND (local | mpi | auto; default auto = mpi when launched by mpiexec/srun and
/// built with MPI, local otherwise).
Backend backend_from_env();

/// "local" or "mpi".
std::string backend_name(Backend backend);

/// Runs `body` on every rank of the world: under `mpi` once in this process with the MPI world
/// (local_ranks is ignored: the launcher decides the world size); under `local` on `local_ranks`
/// threads of this process.
void launch(Backend backend, int local_ranks,
            const std::function<void(std::shared_ptr<Comm>)>& body);

}  // namespace tessera
