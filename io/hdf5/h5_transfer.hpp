// Private to io/hdf5 (includes <hdf5.h>): hyperslab reads and writes through caller-made HDF5
// property lists. The public calls of h5_file.hpp use the defaults (serial driver, independent
// transfer); parallel_io.cpp passes the MPI-IO driver and collective transfers.
#pragma once

#include <hdf5.h>

#include <optional>
#include <string>

#include "core/box.hpp"
#include "core/tensor.hpp"

namespace tessera::io::detail {

/// How a file is opened and its elements are moved.
struct Transfer {
  hid_t file_access = H5P_DEFAULT;  ///< file access property list (e.g. with H5Pset_fapl_mpio)
  hid_t transfer = H5P_DEFAULT;     ///< dataset transfer property list (e.g. collective MPI-IO)
  /// Every rank of the file's communicator takes part in each H5Dread/H5Dwrite, even with an
  /// empty box (it then selects nothing) or, on write, with `write_nothing` set.
  bool collective = false;
  /// Collective transfers: the H5Dread/H5Dwrite calls every rank makes, at least as many as the
  /// slabs (io/host_staging.hpp) of any rank's box; a rank past its own slabs selects nothing.
  size_t calls = 1;
};

/// read_hyperslab of h5_file.hpp through `how`, into a tensor on `device`.
Tensor read_hyperslab(const std::string& file, const std::string& dataset, const Box& box,
                      std::optional<DType> as, const Transfer& how, Device device);

/// write_hyperslab of h5_file.hpp through `how`; with `write_nothing` this rank joins a
/// collective write with an empty selection (`tensor` is then ignored).
void write_hyperslab(const std::string& file, const std::string& dataset, const Box& box,
                     const Tensor& tensor, const Transfer& how, bool write_nothing = false);

}  // namespace tessera::io::detail
