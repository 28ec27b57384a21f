// Stub for builds without HDF5: the version queries answer "none", every file call throws
// NotAvailable naming the file it was asked about.
#include <fmt/format.h>

#include "core/errors.hpp"
#include "io/hdf5/batch_reader.hpp"
#include "io/hdf5/checkpoint.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/hdf5_support.hpp"
#include "io/hdf5/sharded_io.hpp"

namespace tessera::io {

namespace {

[[noreturn]] void not_available(const std::string& file, std::string_view action) {
  throw NotAvailable("hdf5", fmt::format("cannot {} '{}': Tessera was built without HDF5 "
                                         "(reconfigure with TESSERA_WITH_HDF5=ON)",
                                         action, file));
}

}  // namespace

std::string hdf5_version() {
  return "";
}
bool hdf5_is_parallel() {
  return false;
}

std::vector<DatasetInfo> list_datasets(const std::string& file) {
  not_available(file, "list the datasets of");
}

DatasetInfo dataset_info(const std::string& file, const std::string&) {
  not_available(file, "describe a dataset of");
}

Tensor read_dataset(const std::string& file, const std::string&, std::optional<DType>, Device) {
  not_available(file, "read a dataset of");
}

Tensor read_hyperslab(const std::string& file, const std::string&, const Box&, std::optional<DType>,
                      Device) {
  not_available(file, "read a hyperslab of");
}

void write_dataset(const std::string& file, const std::string&, const Tensor&,
                   const WriteOptions&) {
  not_available(file, "write a dataset to");
}

void create_dataset(const std::string& file, const std::string&, const Shape&, DType,
                    const WriteOptions&) {
  not_available(file, "create a dataset in");
}

void write_hyperslab(const std::string& file, const std::string&, const Box&, const Tensor&) {
  not_available(file, "write a hyperslab of");
}

void write_attributes(const std::string& file, const std::string&,
                      const std::map<std::string, std::string>&) {
  not_available(file, "write attributes in");
}

bool holds_only_dataset(const std::string&, const std::string&) {
  return false;
}

bool has_dataset(const std::string& file, const std::string&) {
  not_available(file, "look for a dataset in");
}

bool collective_io_available(const DeviceMesh&) {
  return false;
}

ShardTensor read_sharded(const std::string& file, const std::string&, const DeviceMesh&,
                         std::vector<Placement>, std::vector<std::vector<int64_t>>,
                         std::optional<DType>, bool) {
  not_available(file, "read a sharded dataset of");
}

ShardTensor scatter(const std::string& file, const std::string&, const DeviceMesh&,
                    std::vector<Placement>, std::vector<std::vector<int64_t>>, int, size_t,
                    std::optional<DType>) {
  not_available(file, "scatter a dataset of");
}

void gather_write(const ShardTensor&, const std::string& file, const std::string&, int, size_t,
                  const WriteOptions&) {
  not_available(file, "gather and write a dataset to");
}

void write_sharded(const ShardTensor&, const std::string& file, const std::string&, bool,
                   const WriteOptions&) {
  not_available(file, "write a sharded dataset to");
}

void write_sharded_at(const ShardTensor&, const std::string& file, const std::string&,
                      const std::vector<int64_t>&, bool) {
  not_available(file, "write a sharded dataset to");
}

// The constructor always throws, so no other member is ever reached on an object.
struct DatasetReader::State {};

DatasetReader::DatasetReader(const std::string& file, const std::string&) {
  not_available(file, "read a dataset of");
}
DatasetReader::~DatasetReader() = default;
DatasetReader::DatasetReader(DatasetReader&&) noexcept = default;
DatasetReader& DatasetReader::operator=(DatasetReader&&) noexcept = default;
const Shape& DatasetReader::shape() const {
  not_available("", "read a dataset");
}
Tensor DatasetReader::read(const Box&, std::optional<DType>) const {
  not_available("", "read a dataset");
}
void DatasetReader::read_into(const Box&, DType, void*) const {
  not_available("", "read a dataset");
}

int64_t file_open_count() {
  return 0;
}

// The constructor always throws, so no other member is ever reached on an object.
struct BatchReader::State {};

BatchReader::BatchReader(std::string file, std::string, const DeviceMesh&, BatchReaderOptions) {
  not_available(file, "read training batches from");
}
BatchReader::~BatchReader() = default;
ShardTensor BatchReader::next() {
  not_available("", "read a batch");
}
BatchPosition BatchReader::position() const {
  return {};
}
void BatchReader::seek(BatchPosition) {}
int64_t BatchReader::samples() const {
  return 0;
}
Shape BatchReader::sample_shape() const {
  return {};
}
int64_t BatchReader::steps_per_epoch() const {
  return 0;
}
std::vector<int64_t> BatchReader::batch_samples(BatchPosition) const {
  return {};
}
std::vector<int64_t> BatchReader::epoch_order(int64_t) const {
  return {};
}

void save_checkpoint(const std::string& file,
                     const std::vector<std::pair<std::string, ShardTensor>>&, int, size_t) {
  not_available(file, "save a checkpoint to");
}

std::vector<std::pair<std::string, ShardTensor>> load_checkpoint(
    const std::string& file, const DeviceMesh&, const std::map<std::string, CheckpointLayout>&) {
  not_available(file, "load a checkpoint from");
}

}  // namespace tessera::io
