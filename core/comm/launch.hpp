// Choosing the backend at run time and running a program body on every rank of the world. Every
// rank runs with its RankContext installed (core/runtime/rank_context.hpp): its device comes from
// TESSERA_DEVICE and its local rank (the thread index of a local launch, the launcher's local
// rank under MPI).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "core/comm/comm.hpp"
#include "core/device.hpp"

namespace tessera {

enum class Backend : uint8_t { local, mpi, nccl };

/// True when the environment shows an MPI launcher (mpiexec/mpirun of MPICH or Open MPI, srun).
bool launched_by_mpi_launcher();

/// The backend named by `choice` (local | mpi | nccl | auto; "" is auto): auto is mpi under an
/// MPI launcher in a build with MPI, local otherwise (nccl only when asked). Throws
/// InvalidArgument for an unknown name and NotAvailable for mpi or nccl in a build without it.
/// Pure given its arguments (tested on cpu).
Backend parse_backend(const std::string& choice, bool under_launcher, bool with_mpi,
                      bool with_nccl);

/// parse_backend of TESSERA_BACKEND (default auto) for this build and environment.
Backend backend_from_env();

/// "local", "mpi" or "nccl".
std::string backend_name(Backend backend);

/// This process's rank among the processes of its node, as the MPI launcher tells it
/// (MPI_LOCALRANKID, OMPI_COMM_WORLD_LOCAL_RANK, MV2_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID,
/// PMI_LOCAL_RANK, PALS_LOCAL_RANKID, FLUX_TASK_LOCAL_ID; the first set wins), 0 when none is
/// set. Throws InvalidArgument for a value that is not a non-negative integer.
int local_rank_from_env();

/// The device of the rank with local rank `local_rank`: default_rank_device of TESSERA_DEVICE and
/// the visible CUDA devices (InvalidArgument for an index beyond them or cuda without a GPU).
Device launch_device(int local_rank);

/// Runs `body` on every rank of the world, each with its RankContext installed: under `mpi` once
/// in this process with the MPI world (local_ranks is ignored: the launcher decides the world
/// size); under `local` on `local_ranks` threads of this process; under `nccl` with an NCCL
/// communicator bootstrapped over the MPI world under a launcher, else over `local_ranks` local
/// threads (one GPU per rank).
void launch(Backend backend, int local_ranks,
            const std::function<void(std::shared_ptr<Comm>)>& body);

}  // namespace tessera
