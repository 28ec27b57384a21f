// The plain HDF5 code that `tessera bench io` measures io::BatchReader against: the file and
// dataset opened once, then one H5Dread per sample (a hyperslab of the leading dim) into one
// host buffer. Stubbed without HDF5.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::bench {

/// True when the plain HDF5 baseline can run (built with HDF5).
bool raw_hdf5_available();

/// Reads the samples `order` (indices of the leading dim) of the f32 dataset `dataset` of `file`
/// one H5Dread each, in that order, into one reused buffer; returns the bytes read.
int64_t raw_read_samples(const std::string& file, const std::string& dataset,
                         const std::vector<int64_t>& order);

}  // namespace tessera::bench
