// The plain HDF5 baseline of `tessera bench io` (h5_baseline.hpp): H5Fopen, H5Dopen2, then per
// sample H5Sselect_hyperslab and H5Dread.
#include "apps/bench/h5_baseline.hpp"

#include <hdf5.h>

#include <stdexcept>

namespace tessera::bench {

bool raw_hdf5_available() {
  return true;
}

int64_t raw_read_samples(const std::string& file, const std::string& dataset,
                         const std::vector<int64_t>& order) {
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) throw std::runtime_error("H5Fopen failed: " + file);
  const hid_t d = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
  const hid_t file_space = H5Dget_space(d);
  const int ndim = H5Sget_simple_extent_ndims(file_space);
  std::vector<hsize_t> dims(static_cast<size_t>(ndim));
  H5Sget_simple_extent_dims(file_space, dims.data(), nullptr);
  std::vector<hsize_t> start(dims.size(), 0), count = dims;
  count[0] = 1;
  hsize_t sample = 1;
  for (size_t i = 1; i < dims.size(); ++i) sample *= dims[i];
  const hid_t memory_space = H5Screate_simple(ndim, count.data(), nullptr);
  std::vector<float> buffer(sample);
  int64_t bytes = 0;
  for (int64_t index : order) {
    start[0] = static_cast<hsize_t>(index);
    H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
    if (H5Dread(d, H5T_NATIVE_FLOAT, memory_space, file_space, H5P_DEFAULT, buffer.data()) < 0)
      throw std::runtime_error("H5Dread failed: " + file);
    bytes += static_cast<int64_t>(sample * sizeof(float));
  }
  H5Sclose(memory_space);
  H5Sclose(file_space);
  H5Dclose(d);
  H5Fclose(f);
  return bytes;
}

}  // namespace tessera::bench
