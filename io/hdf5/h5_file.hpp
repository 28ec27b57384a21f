// The minimal HDF5 layer: list, describe, read (whole or a hyperslab box) and write single
// datasets of one file from one process. Later layers (sharded scatter/gather, checkpoints, the
// run-op CLI) build on these calls; docs/io.md describes the stored types and the errors.
//
// Element types in the file (little-endian, h5py/numpy compatible):
//   f32, f64   IEEE binary32 / binary64 (H5T_IEEE_F32LE / H5T_IEEE_F64LE)
//   i32, i64   signed integers (H5T_STD_I32LE / H5T_STD_I64LE)
//   u8         unsigned byte (H5T_STD_U8LE)
//   f16        16-bit IEEE float: sign bit 15, exponent bits 10..14 (bias 15), mantissa bits 0..9,
//              the layout h5py and numpy use for float16
//   bf16       16-bit float: sign bit 15, exponent bits 7..14 (bias 127), mantissa bits 0..6,
//              plus a string attribute tessera_dtype="bf16" on the dataset for other readers
// A file type is recognised by its class, size and bit layout (any byte order); anything else
// (strings, compounds, 128-bit floats, other integer sizes, ...) is reported by DatasetInfo and
// refused by the readers.
//
// Every call is serialised by one process-wide lock (HDF5 builds are usually not thread-safe, and
// the local Comm backend runs ranks as threads) and opens the file with the default serial driver,
// even with parallel HDF5. Failures throw IoError; HDF5's automatic error printing is turned off
// (and stays off), so HDF5's own error stack is never printed.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/box.hpp"
#include "core/dtype.hpp"
#include "core/errors.hpp"
#include "core/tensor.hpp"

namespace tessera::io {

/// A file or dataset that cannot be read or written as asked (missing, not HDF5, truncated or
/// corrupted, wrong object kind, element type or box); the message starts with "[hdf5]".
class IoError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

/// What the metadata of one dataset says (no element is read).
struct DatasetInfo {
  std::string path;       // absolute path in the file, e.g. "/fields/u"
  Shape shape;            // {} for a scalar dataset, {0} for a null dataspace (h5py.Empty)
  std::string file_type;  // "f32", "f64", "f16", "bf16", "i32", "i64", "u8", or a description
                          // of an unsupported type ("string", "compound", "128-bit float", "u16")
  std::optional<DType> dtype;   // the dtype read_dataset returns; empty when unsupported
  std::optional<Shape> chunks;  // chunk extents of a chunked dataset
  std::string compression;      // "" or the filters in order, e.g. "gzip(4)", "shuffle+gzip(6)"
  std::map<std::string, std::string> attributes;  // every attribute, rendered as text
};

/// How write_dataset stores a tensor.
struct WriteOptions {
  // Start from an empty file even when the file exists.
  bool truncate_file = false;
  // Chunked storage with these extents (clamped to the shape).
  std::optional<Shape> chunks = std::nullopt;
  // 0..9: gzip-compress (chunked; without `chunks`, chunks of at most 1 MiB are chosen).
  int gzip_level = -1;
  // A Fletcher-32 checksum per chunk (chunked as for gzip): damaged elements raise IoError on
  // read instead of passing unnoticed.
  bool checksum = false;
};

/// Every dataset of `file`, found recursively through its groups, sorted by path.
std::vector<DatasetInfo> list_datasets(const std::string& file);

/// The metadata of one dataset of `file`.
DatasetInfo dataset_info(const std::string& file, const std::string& dataset);

/// The whole dataset as a contiguous tensor on `device`; with `as`, HDF5 converts the elements on
/// read. A cuda tensor is filled through pinned host slabs (io/host_staging.hpp), never through a
/// whole host copy.
Tensor read_dataset(const std::string& file, const std::string& dataset,
                    std::optional<DType> as = std::nullopt, Device device = Device::cpu());

/// The index box `box` of the dataset (box within the dataset's shape) as a contiguous tensor on
/// `device` (cuda: through pinned host slabs).
Tensor read_hyperslab(const std::string& file, const std::string& dataset, const Box& box,
                      std::optional<DType> as = std::nullopt, Device device = Device::cpu());

/// Writes `tensor` (any device: a cuda tensor crosses to the host in pinned slabs) as `dataset`,
/// creating the file and intermediate groups as needed and replacing an existing dataset of that
/// name.
void write_dataset(const std::string& file, const std::string& dataset, const Tensor& tensor,
                   const WriteOptions& options = {});

/// Creates (or replaces) `dataset` of `shape` and `dtype` without writing elements (unwritten
/// elements read as 0); the file and intermediate groups are created as needed.
void create_dataset(const std::string& file, const std::string& dataset, const Shape& shape,
                    DType dtype, const WriteOptions& options = {});

/// Writes `tensor` (of shape box.shape(), any device: cuda through pinned slabs) into the index
/// box `box` of an existing dataset of an existing file; HDF5 converts the elements to the
/// dataset's numeric element type.
void write_hyperslab(const std::string& file, const std::string& dataset, const Box& box,
                     const Tensor& tensor);

/// Writes (or replaces) scalar fixed-length string attributes of an existing dataset of an
/// existing file.
void write_attributes(const std::string& file, const std::string& dataset,
                      const std::map<std::string, std::string>& attributes);

/// True when `file` is readable HDF5 whose only object is `dataset` (one link in the whole file,
/// and no attribute on the root group), so replacing that dataset loses nothing when the file is
/// started afresh; false otherwise, also for a missing or unreadable file.
bool holds_only_dataset(const std::string& file, const std::string& dataset);

/// True when `file` exists and holds a dataset at `dataset` (false for a missing file or path,
/// or a group); throws IoError when the file is not readable HDF5.
bool has_dataset(const std::string& file, const std::string& dataset);

/// One dataset of one file opened for reading once and kept open: hyperslab reads without
/// reopening the file each time (io::BatchReader reads every sample through one). Reads are
/// serialised with every other call of this layer; the file stays open (and read-only locked)
/// until the reader is destroyed.
class DatasetReader {
 public:
  /// Opens `dataset` of `file` (IoError as for read_hyperslab when it cannot be read).
  DatasetReader(const std::string& file, const std::string& dataset);
  ~DatasetReader();
  DatasetReader(DatasetReader&&) noexcept;
  DatasetReader& operator=(DatasetReader&&) noexcept;
  /// The dataset's shape.
  const Shape& shape() const;
  /// The index box `box` of the dataset as a contiguous cpu tensor (elements converted to `as`).
  Tensor read(const Box& box, std::optional<DType> as = std::nullopt) const;
  /// Reads the index box `box` as `as` straight into `out` (box.volume() contiguous elements of
  /// `as`, row-major): one H5Dread, no staging copy.
  void read_into(const Box& box, DType as, void* out) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// How many times this process has opened an HDF5 file through this layer (every read, write,
/// description and DatasetReader counts its opens): for tests and benchmarks of file reuse.
int64_t file_open_count();

}  // namespace tessera::io
