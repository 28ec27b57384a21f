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
/// True once MPI_Init has run in this process.
bool mpi_initialized();

}  // namespace tessera
