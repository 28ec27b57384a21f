// Collective MPI-IO reads and writes of hyperslabs through parallel HDF5 (H5Pset_fapl_mpio and
// collective transfers). Compiled only when Tessera is built with a parallel HDF5 and MPI;
// no_h5_mpio.cpp stands in otherwise.
#include <fmt/format.h>
#include <hdf5.h>
#include <mpi.h>

#include "core/comm/mpi_comm.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/h5_handle.hpp"
#include "io/hdf5/h5_transfer.hpp"
#include "io/hdf5/sharded_io_detail.hpp"

namespace tessera::io::detail {

namespace {

/// The MPI-IO file access list and a collective transfer list on `comm`'s MPI communicator.
struct MpioLists {
  H5Handle access, transfer;

  MpioLists(const Comm& comm, const std::string& file, bool for_write) {
    MPI_Comm native = MPI_COMM_NULL;
    if (!mpi_handle_of(comm, &native))
      throw IoError("hdf5", fmt::format("file '{}': collective MPI-IO needs the mpi backend, found "
                                        "the {} backend",
                                        file, comm.backend()));
    access = plist_handle(H5Pcreate(H5P_FILE_ACCESS));
    transfer = plist_handle(H5Pcreate(H5P_DATASET_XFER));
    if (!access.valid() || !transfer.valid() ||
        H5Pset_fapl_mpio(access.get(), native, MPI_INFO_NULL) < 0 ||
        H5Pset_dxpl_mpio(transfer.get(), H5FD_MPIO_COLLECTIVE) < 0 ||
        (for_write && H5Pset_libver_bounds(access.get(), H5F_LIBVER_V110, H5F_LIBVER_V110) < 0))
      throw IoError("hdf5", fmt::format("file '{}': cannot set up MPI-IO property lists", file));
  }

  Transfer how() const { return {access.get(), transfer.get(), /*collective=*/true}; }
};

}  // namespace

bool collective_io_available(const Comm& comm) {
  MPI_Comm native = MPI_COMM_NULL;
  return mpi_handle_of(comm, &native);
}

Tensor collective_read(const Comm& comm, const std::string& file, const std::string& dataset,
                       const Box& box, DType dtype, Device device, size_t calls) {
  const MpioLists lists(comm, file, /*for_write=*/false);
  Transfer how = lists.how();
  how.calls = calls;
  return read_hyperslab(file, dataset, box, dtype, how, device);
}

void collective_write(const Comm& comm, const std::string& file, const std::string& dataset,
                      const Box& box, const Tensor& tensor, bool write_nothing, size_t calls) {
  const MpioLists lists(comm, file, /*for_write=*/true);
  Transfer how = lists.how();
  how.calls = calls;
  write_hyperslab(file, dataset, box, tensor, how, write_nothing);
}

}  // namespace tessera::io::detail
