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

}  // namespace tessera
