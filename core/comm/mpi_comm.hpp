// The `mpi` backend's entry points. Built from mpi_comm.cpp when TESSERA_WITH_MPI is on and
// from no_mpi.cpp otherwise, where mpi_world() throws NotAvailable.
#pragma once

#include <memory>
#include <string>

#include "core/comm/comm.hpp"

namespace tessera {

/// True when Tessera was built with MPI.
bool mpi_compiled();
/// MPI_COMM_WORLD as a Comm (initializes MPI on first use; finalized at exit).
std::shared_ptr<Comm> mpi_world();
/// MPI_Get_library_version's first line, or "" without MPI.
std::string mpi_library_version();
/// Ends every process of the MPI job (used when an error was not agreed by all ranks).
[[noreturn]] void mpi_abort(int code);
/// When `comm` is an mpi-backend communicator, copies its MPI_Comm into `*handle` (which must
/// point to an MPI_Comm) and returns true; false for any other backend. For code that calls MPI
/// libraries directly (MPI-IO through parallel HDF5).
bool mpi_handle_of(const Comm& comm, void* handle);
/// True once MPI_Init has run in this process.
bool mpi_initialized();
/// The MPI library's own answer to "are you CUDA-aware?" (MPIX_Query_cuda_support, valid after
/// MPI_Init): 1 yes, 0 no, -1 when the library has no way to tell (or without MPI).
int mpi_library_cuda_support();
/// Whether the mpi backend hands device buffers to MPI directly (CUDA-aware) or stages them
/// through pinned host memory: choose_mpi_cuda_aware of TESSERA_MPI_CUDA_AWARE and the library's
/// answer (false without MPI).
bool mpi_cuda_aware();

}  // namespace tessera
