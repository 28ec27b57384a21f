// Tests of the HDF5 layer (io/hdf5/h5_file.hpp): bit-exact round trips of every dtype and rank,
// chunked and gzip storage, hyperslab reads and writes, conversions on read, groups, metadata,
// files written by h5py, and that every bad file or argument is an IoError naming the file and
// dataset (never a crash, never HDF5's error stack on stderr).
#include "io/hdf5/h5_file.hpp"

#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/tensor.hpp"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                DType::i32, DType::i64, DType::u8};

/// A contiguous tensor whose bytes are random bits (NaN payloads and subnormals included).
Tensor random_bits_tensor(const Shape& shape, DType dtype, uint64_t seed) {
  Tensor tensor = Tensor::empty(shape, dtype);
  std::mt19937_64 generator(seed);
  auto* bytes = static_cast<unsigned char*>(tensor.raw_data());
  for (size_t i = 0; i < tensor.nbytes(); ++i) bytes[i] = static_cast<unsigned char>(generator());
  return tensor;
}

/// The multi-index of row-major flat index `flat` in `shape`.
std::vector<int64_t> unflatten(int64_t flat, const Shape& shape) {
  std::vector<int64_t> index(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

/// A random box within `shape` (sometimes empty along a dim).
Box random_box(const Shape& shape, std::mt19937_64& generator) {
  Box box;
  for (int64_t extent : shape) {
    std::uniform_int_distribution<int64_t> pick(0, extent);
    int64_t a = pick(generator), b = pick(generator);
    if (a > b) std::swap(a, b);
    box.lo.push_back(a);
    box.hi.push_back(b);
  }
  return box;
}

/// Runs `call`, expects an IoError whose message starts with "[hdf5]" and contains every string of
/// `needles`, and that nothing was printed to stderr (HDF5's stack dump is off).
template <typename Call>
void expect_io_error(Call&& call, const std::vector<std::string>& needles) {
  testing::internal::CaptureStderr();
  std::string message;
  bool threw_io_error = false;
  try {
    call();
  } catch (const IoError& error) {
    threw_io_error = true;
    message = error.what();
  } catch (const std::exception& error) {
    message = std::string("unexpected exception type: ") + error.what();
  }
  const std::string printed = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(threw_io_error) << (message.empty() ? "no exception" : message);
  EXPECT_EQ(message.rfind("[hdf5] ", 0), 0u) << message;
  for (const std::string& needle : needles)
    EXPECT_NE(message.find(needle), std::string::npos) << "'" << needle << "' not in: " << message;
  EXPECT_EQ(printed, "") << "stderr was written";
}

/// A per-test scratch directory under the system temp directory, removed at the end.
class H5File : public testing::Test {
 protected:
  void SetUp() override {
    const auto* test = testing::UnitTest::GetInstance()->current_test_info();
    directory_ = fs::temp_directory_path() / ("tessera_io_" + std::to_string(getpid()) + "_" +
                                              test->test_suite_name() + "_" + test->name());
    fs::remove_all(directory_);
    fs::create_directories(directory_);
  }
  void TearDown() override { remove_directory(); }
  /// Removes the scratch directory (also called by death-test children, which skip TearDown).
  void remove_directory() {
    std::error_code error;
    fs::remove_all(directory_, error);
  }
  /// A path inside the scratch directory.
  std::string path(const std::string& name) const { return (directory_ / name).string(); }

 private:
  fs::path directory_;
};

class H5FileErrors : public H5File {};

TEST_F(H5File, RoundTripIsBitExactForEveryDtypeAndRank) {
  const std::string file = path("round_trip.h5");
  const Shape dims = {3, 2, 4, 1, 2, 3};
  std::vector<std::pair<std::string, Tensor>> written;
  uint64_t seed = 1;
  for (DType dtype : all_dtypes) {
    const std::string prefix = "/" + std::string(dtype_name(dtype));
    written.emplace_back(prefix + "/scalar", random_bits_tensor({}, dtype, seed++));
    for (size_t rank = 1; rank <= 6; ++rank) {
      Shape shape(dims.begin(), dims.begin() + static_cast<std::ptrdiff_t>(rank));
      written.emplace_back(prefix + "/rank" + std::to_string(rank),
                           random_bits_tensor(shape, dtype, seed++));
      shape[rank / 2] = 0;  // a zero extent somewhere in the middle
      written.emplace_back(prefix + "/rank" + std::to_string(rank) + "_empty",
                           random_bits_tensor(shape, dtype, seed++));
    }
  }
  for (const auto& [name, tensor] : written) write_dataset(file, name, tensor);
  for (const auto& [name, tensor] : written) {
    const Tensor read = read_dataset(file, name);
    EXPECT_EQ(read.dtype(), tensor.dtype()) << name;
    EXPECT_EQ(read.shape(), tensor.shape()) << name;
    EXPECT_TRUE(read.is_contiguous()) << name;
    EXPECT_TRUE(bitwise_equal(read, tensor)) << name;
  }
  EXPECT_EQ(list_datasets(file).size(), written.size());
}

/// Writes random bits of `shape` and `dtype` with `options`, reads them back bit-exact, and checks
/// the chunks and filters dataset_info reports.
void expect_storage_round_trip(const std::string& file, const std::string& name, const Shape& shape,
                               DType dtype, const WriteOptions& options,
                               const std::optional<Shape>& expected_chunks,
                               const std::string& expected_compression) {
  SCOPED_TRACE(name);
  const Tensor tensor = random_bits_tensor(shape, dtype, std::hash<std::string>()(name));
  write_dataset(file, name, tensor, options);
  EXPECT_TRUE(bitwise_equal(read_dataset(file, name), tensor));
  const DatasetInfo info = dataset_info(file, name);
  EXPECT_EQ(info.chunks, expected_chunks);
  EXPECT_EQ(info.compression, expected_compression);
}

TEST_F(H5File, ChunkedAndGzipDatasetsRoundTrip) {
  const std::string file = path("chunked.h5");
  expect_storage_round_trip(file, "/chunked", {10, 12}, DType::f32, {.chunks = Shape{4, 5}},
                            Shape{4, 5}, "");
  expect_storage_round_trip(file, "/chunked_gzip", {9, 7, 5}, DType::f64,
                            {.chunks = Shape{3, 7, 2}, .gzip_level = 6}, Shape{3, 7, 2}, "gzip(6)");
  // Without chunks, gzip picks them: the shape halved along leading dims down to <= 1 MiB.
  expect_storage_round_trip(file, "/gzip_auto_chunks", {300, 1000}, DType::f32, {.gzip_level = 1},
                            Shape{150, 1000}, "gzip(1)");
  expect_storage_round_trip(file, "/gzip_u8", {1000}, DType::u8, {.gzip_level = 0}, Shape{1000},
                            "gzip(0)");
  // Chunks larger than the dataset are clamped to it.
  expect_storage_round_trip(file, "/chunks_clamped", {3, 4}, DType::i64,
                            {.chunks = Shape{100, 2}, .gzip_level = 9}, Shape{3, 2}, "gzip(9)");
  expect_storage_round_trip(file, "/gzip_bf16", {33, 17}, DType::bf16,
                            {.chunks = Shape{8, 8}, .gzip_level = 4}, Shape{8, 8}, "gzip(4)");
  expect_storage_round_trip(file, "/checksum", {10, 10}, DType::i32, {.checksum = true},
                            Shape{10, 10}, "fletcher32");
  expect_storage_round_trip(file, "/gzip_checksum", {40, 3}, DType::f16,
                            {.chunks = Shape{16, 3}, .gzip_level = 4, .checksum = true},
                            Shape{16, 3}, "gzip(4)+fletcher32");
  // A zero-element tensor has nothing to chunk: stored contiguous.
  expect_storage_round_trip(file, "/empty_chunked", {0, 5}, DType::f16,
                            {.chunks = Shape{2, 2}, .gzip_level = 4}, std::nullopt, "");
}

TEST_F(H5File, GzipActuallyCompresses) {
  const std::string plain = path("plain.h5"), compressed = path("compressed.h5");
  const Tensor zeros = Tensor::zeros({256, 256}, DType::f64);
  write_dataset(plain, "x", zeros);
  write_dataset(compressed, "x", zeros, {.gzip_level = 6});
  EXPECT_LT(fs::file_size(compressed) * 10, fs::file_size(plain));
  EXPECT_TRUE(bitwise_equal(read_dataset(compressed, "x"), zeros));
}

TEST_F(H5File, HyperslabOfRandomBoxesMatchesFullRead) {
  const std::string file = path("hyperslab.h5");
  std::mt19937_64 generator(7);
  auto check_random_boxes = [&](const std::string& name, const Shape& shape, DType dtype,
                                const WriteOptions& options) {
    write_dataset(file, name, random_bits_tensor(shape, dtype, generator()), options);
    const Tensor full = read_dataset(file, name);
    for (int trial = 0; trial < 40; ++trial) {
      const Box box = trial == 0 ? Box::of_shape(shape) : random_box(shape, generator);
      const Tensor slab = read_hyperslab(file, name, box);
      EXPECT_EQ(slab.shape(), box.shape()) << name << " " << box.str();
      EXPECT_TRUE(slab.is_contiguous());
      EXPECT_TRUE(bitwise_equal(slab, full.view_box(box).contiguous())) << name << box.str();
    }
  };
  check_random_boxes("/a3", {7, 5, 6}, DType::f32, {});
  check_random_boxes("/b4", {3, 4, 5, 6}, DType::i64, {});
  check_random_boxes("/c2_chunked_gzip", {31, 17}, DType::f16,
                     {.chunks = Shape{8, 4}, .gzip_level = 5});
  check_random_boxes("/d1", {50}, DType::u8, {});
  check_random_boxes("/e5_bf16", {2, 3, 2, 4, 3}, DType::bf16, {.chunks = Shape{1, 2, 2, 2, 2}});
  // With a conversion: the box of the converted full read.
  write_dataset(file, "/f64",
                Tensor::from_values<double>({2, 3}, std::vector<double>{1.5, -2.25, 3, 4, 5.5, 6}));
  const Box box{{0, 1}, {2, 3}};
  const Tensor slab = read_hyperslab(file, "/f64", box, DType::i32);
  EXPECT_EQ(slab.dtype(), DType::i32);
  EXPECT_TRUE(
      bitwise_equal(slab, read_dataset(file, "/f64", DType::i32).view_box(box).contiguous()));
}

TEST_F(H5File, HyperslabWritesIntoACreatedDatasetRoundTrip) {
  const std::string file = path("boxes.h5");
  std::mt19937_64 generator(11);
  for (DType dtype : all_dtypes) {
    const std::string name = std::string("/g/") + std::string(dtype_name(dtype));
    const Shape shape{6, 5, 4};
    const Tensor full = random_bits_tensor(shape, dtype, generator());
    create_dataset(file, name, shape, dtype, {.chunks = Shape{2, 5, 3}});
    EXPECT_EQ(dataset_info(file, name).dtype, dtype);
    // Row blocks of uneven heights (an empty one included) cover the dataset.
    for (auto [lo, hi] : {std::pair<int64_t, int64_t>{0, 1}, {1, 1}, {1, 4}, {4, 6}}) {
      const Box box{{lo, 0, 0}, {hi, 5, 4}};
      write_hyperslab(file, name, box, full.view_box(box));
    }
    EXPECT_TRUE(bitwise_equal(read_dataset(file, name), full)) << dtype_name(dtype);
  }
  // Unwritten elements read as zero; a scalar dataset takes its one element.
  create_dataset(file, "/zeros", {3, 2}, DType::f64);
  write_hyperslab(file, "/zeros", Box{{1, 0}, {2, 2}},
                  Tensor::from_values<double>({1, 2}, std::vector<double>{7, 8}));
  EXPECT_TRUE(
      bitwise_equal(read_dataset(file, "/zeros"),
                    Tensor::from_values<double>({3, 2}, std::vector<double>{0, 0, 7, 8, 0, 0})));
  create_dataset(file, "/scalar", {}, DType::i64);
  write_hyperslab(file, "/scalar", Box{},
                  Tensor::from_values<int64_t>({}, std::vector<int64_t>{42}));
  EXPECT_EQ(read_dataset(file, "/scalar").item_as_double({}), 42.0);
}

// Device tensors cross to and from the host in slabs (io/host_staging.hpp); with
// TESSERA_IO_SLAB_BYTES set, cpu tensors take the same slab loop, so it is checked here on cpu:
// slab-by-slab reads and writes of every box equal the whole-tensor ones, whatever the slab size.
TEST_F(H5File, SlabbedReadsAndWritesEqualWholeOnes) {
  const std::string file = path("slabs.h5");
  std::mt19937_64 generator(13);
  const Shape shape{5, 7, 6};
  for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::u8}) {
    const std::string name = std::string("/") + std::string(dtype_name(dtype));
    const Tensor full = random_bits_tensor(shape, dtype, generator());
    for (const char* slab_bytes : {"1", "7", "40", "100", "1000"}) {
      ::setenv("TESSERA_IO_SLAB_BYTES", slab_bytes, 1);
      write_dataset(file, name, full, {.chunks = Shape{2, 3, 6}});
      EXPECT_TRUE(bitwise_equal(read_dataset(file, name), full)) << name << " " << slab_bytes;
      for (int trial = 0; trial < 10; ++trial) {
        const Box box = random_box(shape, generator);
        EXPECT_TRUE(bitwise_equal(read_hyperslab(file, name, box), full.view_box(box).contiguous()))
            << name << box.str() << " " << slab_bytes;
      }
      // Boxes written slab by slab into a fresh dataset.
      create_dataset(file, name + "_boxes", shape, dtype);
      for (auto [lo, hi] : {std::pair<int64_t, int64_t>{0, 2}, {2, 2}, {2, 5}}) {
        const Box box{{lo, 0, 0}, {hi, 7, 6}};
        write_hyperslab(file, name + "_boxes", box, full.view_box(box));
      }
      ::unsetenv("TESSERA_IO_SLAB_BYTES");
      EXPECT_TRUE(bitwise_equal(read_dataset(file, name + "_boxes"), full))
          << name << " " << slab_bytes;
    }
  }
  // A conversion on read applies to every slab alike.
  write_dataset(file, "/f64",
                Tensor::from_values<double>({2, 3}, std::vector<double>{1.5, -2.25, 3, 4, 5.5, 6}));
  const Tensor whole = read_dataset(file, "/f64", DType::f32);
  ::setenv("TESSERA_IO_SLAB_BYTES", "4", 1);
  EXPECT_TRUE(bitwise_equal(read_dataset(file, "/f64", DType::f32), whole));
  ::unsetenv("TESSERA_IO_SLAB_BYTES");
}

TEST_F(H5FileErrors, HyperslabWriteRefusesBadBoxesTensorsAndFiles) {
  const std::string file = path("data.h5");
  create_dataset(file, "/x", {4, 5}, DType::f32);
  expect_io_error(
      [&] {
        write_hyperslab(file, "/x", Box{{0, 0}, {5, 5}}, Tensor::zeros({5, 5}, DType::f32));
      },
      {file, "/x", "within the dataset shape (4, 5)"});
  expect_io_error(
      [&] {
        write_hyperslab(file, "/x", Box{{0, 0}, {2, 2}}, Tensor::zeros({2, 3}, DType::f32));
      },
      {file, "/x", "expected a tensor of shape (2, 2)"});
  expect_io_error(
      [&] {
        write_hyperslab(file, "/missing", Box{{0}, {1}}, Tensor::zeros({1}, DType::f32));
      },
      {file, "/missing", "no object of that name"});
  const std::string missing = path("missing.h5");
  expect_io_error(
      [&] {
        write_hyperslab(missing, "/x", Box{{0}, {1}}, Tensor::zeros({1}, DType::f32));
      },
      {missing, "no such file"});
  EXPECT_FALSE(fs::exists(missing));
  expect_io_error([&] { create_dataset(path("no_dir/a.h5"), "/x", {2}, DType::f32); },
                  {"no_dir/a.h5", "cannot create the file"});
}

TEST_F(H5File, F64ReadAsF32EqualsRoundedValues) {
  const std::string file = path("convert.h5");
  std::mt19937_64 generator(3);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(-60, 60);
  std::vector<double> values(4096);
  for (double& value : values)
    value = std::ldexp(mantissa(generator), exponent(generator)) * (generator() % 2 ? 1 : -1);
  values[0] = 0.0;
  values[1] = -0.0;
  values[2] = 1.0 + std::ldexp(1.0, -24);      // a tie: rounds to even (1.0)
  values[3] = 1.0 + 3 * std::ldexp(1.0, -24);  // a tie: rounds to even (1 + 2^-22)
  const Tensor f64 = Tensor::from_values<double>({64, 64}, values);
  write_dataset(file, "f64", f64);
  const Tensor f32 = read_dataset(file, "f64", DType::f32);
  ASSERT_EQ(f32.dtype(), DType::f32);
  ASSERT_EQ(f32.shape(), f64.shape());
  const float* read = f32.data<float>();
  for (size_t i = 0; i < values.size(); ++i) {
    const float rounded = static_cast<float>(values[i]);
    ASSERT_EQ(std::memcmp(&read[i], &rounded, sizeof rounded), 0)
        << "element " << i << ": " << values[i] << " read as " << read[i];
  }
  // Widening reads are exact: f16 and bf16 to f32, f32 to f64, i32 to f64.
  const Tensor f16 = random_bits_tensor({4096}, DType::f16, 11);
  const Tensor bf16 = random_bits_tensor({4096}, DType::bf16, 12);
  const Tensor f32_values = Tensor::from_values<float>(
      {4, 3}, std::vector<float>{0.1f, -2.5f, 1e30f, -1e-30f, 7, 8, 9, 10, 11, 12, 13, 14});
  write_dataset(file, "f16", f16);
  write_dataset(file, "bf16", bf16);
  write_dataset(file, "f32", f32_values);
  const Tensor f16_wide = read_dataset(file, "f16", DType::f32);
  const Tensor bf16_wide = read_dataset(file, "bf16", DType::f32);
  for (int64_t i = 0; i < 4096; ++i) {
    const float half = static_cast<float>(f16.data<Half>()[i]);
    const float brain = static_cast<float>(bf16.data<BFloat16>()[i]);
    if (std::isnan(half)) {
      EXPECT_TRUE(std::isnan(f16_wide.data<float>()[i])) << "f16 element " << i;
    } else {
      EXPECT_EQ(f16_wide.data<float>()[i], half) << "f16 element " << i;
    }
    if (std::isnan(brain)) {
      EXPECT_TRUE(std::isnan(bf16_wide.data<float>()[i])) << "bf16 element " << i;
    } else {
      EXPECT_EQ(bf16_wide.data<float>()[i], brain) << "bf16 element " << i;
    }
  }
  const Tensor f32_wide = read_dataset(file, "f32", DType::f64);
  for (int64_t i = 0; i < 12; ++i)
    EXPECT_EQ(f32_wide.data<double>()[i], static_cast<double>(f32_values.data<float>()[i]));
}

TEST_F(H5File, NestedGroupPathsAreCreatedReplacedAndListed) {
  const std::string file = path("groups.h5");
  const Tensor a = random_bits_tensor({3, 4}, DType::f32, 1);
  const Tensor b = random_bits_tensor({5}, DType::i64, 2);
  write_dataset(file, "/fields/velocity/u", a);
  write_dataset(file, "fields//velocity/v/", b);  // normalised to /fields/velocity/v
  write_dataset(file, "top", a);
  EXPECT_TRUE(has_dataset(file, "/fields/velocity/u"));
  EXPECT_TRUE(has_dataset(file, "fields/velocity/v"));
  EXPECT_FALSE(has_dataset(file, "/fields/velocity"));    // a group
  EXPECT_FALSE(has_dataset(file, "/fields/velocity/w"));  // missing
  EXPECT_FALSE(has_dataset(file, "/nowhere/at/all"));     // missing groups
  EXPECT_FALSE(has_dataset(file, "/top/below"));          // below a dataset
  EXPECT_FALSE(has_dataset(path("missing.h5"), "/x"));    // missing file
  EXPECT_TRUE(bitwise_equal(read_dataset(file, "fields/velocity/u"), a));
  EXPECT_TRUE(bitwise_equal(read_dataset(file, "/fields/velocity/v"), b));

  std::vector<std::string> paths;
  for (const DatasetInfo& info : list_datasets(file)) paths.push_back(info.path);
  EXPECT_EQ(paths, (std::vector<std::string>{"/fields/velocity/u", "/fields/velocity/v", "/top"}));

  // Replacing changes dtype and shape; the other datasets stay.
  const Tensor replacement = random_bits_tensor({2, 2, 2}, DType::bf16, 3);
  write_dataset(file, "/fields/velocity/u", replacement);
  EXPECT_TRUE(bitwise_equal(read_dataset(file, "/fields/velocity/u"), replacement));
  EXPECT_TRUE(bitwise_equal(read_dataset(file, "/top"), a));
  EXPECT_EQ(list_datasets(file).size(), 3u);

  // truncate_file starts from an empty file.
  write_dataset(file, "/only", b, {.truncate_file = true});
  ASSERT_EQ(list_datasets(file).size(), 1u);
  EXPECT_EQ(list_datasets(file)[0].path, "/only");
}

TEST_F(H5File, NonContiguousTensorIsWrittenAsItsValues) {
  const std::string file = path("view.h5");
  const Tensor full = random_bits_tensor({6, 8}, DType::i32, 5);
  const Box box{{1, 2}, {5, 7}};
  write_dataset(file, "view", full.view_box(box));
  EXPECT_TRUE(bitwise_equal(read_dataset(file, "view"), full.view_box(box).contiguous()));
}

TEST_F(H5File, ListAndInfoReportShapeTypeChunksCompression) {
  const std::string file = path("info.h5");
  write_dataset(file, "/a/f16", random_bits_tensor({2, 3}, DType::f16, 1));
  write_dataset(file, "/a/bf16", random_bits_tensor({4}, DType::bf16, 2), {.chunks = Shape{2}});
  write_dataset(file, "/b/u8", random_bits_tensor({5, 6, 7}, DType::u8, 3),
                {.chunks = Shape{5, 3, 7}, .gzip_level = 2});
  write_dataset(file, "/scalar", random_bits_tensor({}, DType::f64, 4));
  write_dataset(file, "/i32", random_bits_tensor({0}, DType::i32, 5));

  const std::vector<DatasetInfo> infos = list_datasets(file);
  ASSERT_EQ(infos.size(), 5u);
  EXPECT_EQ(infos[0].path, "/a/bf16");
  EXPECT_EQ(infos[0].shape, (Shape{4}));
  EXPECT_EQ(infos[0].file_type, "bf16");
  EXPECT_EQ(infos[0].dtype, DType::bf16);
  EXPECT_EQ(infos[0].chunks, (Shape{2}));
  EXPECT_EQ(infos[0].compression, "");
  EXPECT_EQ(infos[0].attributes, (std::map<std::string, std::string>{{"tessera_dtype", "bf16"}}));
  EXPECT_EQ(infos[1].path, "/a/f16");
  EXPECT_EQ(infos[1].file_type, "f16");
  EXPECT_EQ(infos[1].dtype, DType::f16);
  EXPECT_EQ(infos[1].chunks, std::nullopt);
  EXPECT_TRUE(infos[1].attributes.empty());
  EXPECT_EQ(infos[2].path, "/b/u8");
  EXPECT_EQ(infos[2].shape, (Shape{5, 6, 7}));
  EXPECT_EQ(infos[2].file_type, "u8");
  EXPECT_EQ(infos[2].chunks, (Shape{5, 3, 7}));
  EXPECT_EQ(infos[2].compression, "gzip(2)");
  EXPECT_EQ(infos[3].path, "/i32");
  EXPECT_EQ(infos[3].shape, (Shape{0}));
  EXPECT_EQ(infos[3].dtype, DType::i32);
  EXPECT_EQ(infos[4].path, "/scalar");
  EXPECT_EQ(infos[4].shape, (Shape{}));
  EXPECT_EQ(infos[4].file_type, "f64");

  const DatasetInfo single = dataset_info(file, "b/u8");
  EXPECT_EQ(single.path, "/b/u8");
  EXPECT_EQ(single.compression, "gzip(2)");
}

TEST_F(H5File, ConcurrentCallsFromThreadsAreSerialised) {
  const std::string file = path("threads.h5");
  const Tensor full = random_bits_tensor({64, 32}, DType::f32, 9);
  write_dataset(file, "x", full);
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        const Box box{{t * 16, 0}, {t * 16 + 16, 32}};
        if (!bitwise_equal(read_hyperslab(file, "x", box), full.view_box(box).contiguous()))
          ++mismatches;
        write_dataset(path("own_" + std::to_string(t) + ".h5"), "y", full);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(H5File, HdfAutomaticErrorPrintingIsTurnedOff) {
  EXPECT_THROW(read_dataset(path("missing.h5"), "x"), IoError);
  H5E_auto2_t printer = nullptr;
  void* data = nullptr;
  ASSERT_GE(H5Eget_auto2(H5E_DEFAULT, &printer, &data), 0);
  EXPECT_EQ(printer, nullptr);
}

TEST_F(H5File, NullDataspaceReadsAsZeroElements) {
  // h5py.Empty writes a dataset with a null dataspace: no elements, no shape.
  const std::string file = path("null.h5");
  const hid_t handle = H5Fcreate(file.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(handle, 0);
  const hid_t space = H5Screate(H5S_NULL);
  const hid_t dataset =
      H5Dcreate2(handle, "empty", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(dataset, 0);
  H5Dclose(dataset);
  H5Sclose(space);
  H5Fclose(handle);
  EXPECT_EQ(dataset_info(file, "empty").shape, (Shape{0}));
  const Tensor read = read_dataset(file, "empty");
  EXPECT_EQ(read.shape(), (Shape{0}));
  EXPECT_EQ(read.dtype(), DType::f32);
  EXPECT_EQ(read_hyperslab(file, "empty", Box{{0}, {0}}).numel(), 0);
}

// ---- files written by h5py -------------------------------------------------------------------

TEST_F(H5File, ReadsFilesWrittenByH5py) {
  const std::string directory = TESSERA_IO_FIXTURE_DIR;
  const std::string file = directory + "/sample.h5";
  std::ifstream json_stream(directory + "/expected.json");
  ASSERT_TRUE(json_stream) << "missing " << directory << "/expected.json";
  const nlohmann::json expected = nlohmann::json::parse(json_stream);

  std::vector<std::string> expected_paths, listed_paths;
  for (const auto& [name, entry] : expected.items()) expected_paths.push_back(name);
  for (const DatasetInfo& info : list_datasets(file)) listed_paths.push_back(info.path);
  EXPECT_EQ(listed_paths, expected_paths);

  for (const auto& [name, entry] : expected.items()) {
    SCOPED_TRACE(name);
    const DatasetInfo info = dataset_info(file, name);
    const Shape shape = entry["shape"].get<Shape>();
    const DType dtype = dtype_from_name(entry["dtype"].get<std::string>());
    EXPECT_EQ(info.shape, shape);
    EXPECT_EQ(info.dtype, dtype);
    EXPECT_EQ(info.file_type, entry["dtype"].get<std::string>());
    const std::optional<Shape> chunks = entry.contains("chunks")
                                            ? std::optional<Shape>(entry["chunks"].get<Shape>())
                                            : std::nullopt;
    EXPECT_EQ(info.chunks, chunks);
    EXPECT_EQ(info.compression, entry.value("compression", std::string()));
    EXPECT_EQ(info.attributes, entry.value("attributes", std::map<std::string, std::string>()));

    const Tensor tensor = read_dataset(file, name);
    ASSERT_EQ(tensor.shape(), shape);
    ASSERT_EQ(tensor.dtype(), dtype);
    for (const auto& pick : entry["values"]) {
      const int64_t flat = pick[0].get<int64_t>();
      EXPECT_EQ(tensor.item_as_double(unflatten(flat, shape)), pick[1].get<double>())
          << "flat index " << flat;
    }
    // The same values through a conversion to f64.
    const Tensor wide = read_dataset(file, name, DType::f64);
    for (const auto& pick : entry["values"])
      EXPECT_EQ(wide.data<double>()[pick[0].get<int64_t>()], pick[1].get<double>());
  }
}

// ---- errors --------------------------------------------------------------------------------

TEST_F(H5FileErrors, MissingFileNamesFileAndDataset) {
  const std::string file = path("does_not_exist.h5");
  const std::vector<std::string> needles = {file, "/some/data", "no such file"};
  expect_io_error([&] { read_dataset(file, "/some/data"); }, needles);
  expect_io_error([&] { read_hyperslab(file, "some/data", Box{{0}, {1}}); }, needles);
  expect_io_error([&] { dataset_info(file, "/some/data"); }, needles);
  expect_io_error([&] { list_datasets(file); }, {file, "no such file"});
  EXPECT_FALSE(has_dataset(file, "/some/data"));
  expect_io_error([&] { read_dataset(path(""), "x"); }, {"directory"});
  expect_io_error([&] { write_dataset(path("no_dir/x.h5"), "x", Tensor::zeros({1}, DType::u8)); },
                  {"no_dir/x.h5", "/x", "cannot create"});
}

TEST_F(H5FileErrors, FileThatIsNotHdf5) {
  const std::string file = path("notes.txt");
  std::ofstream(file) << "just some text, not HDF5\n";
  const std::vector<std::string> needles = {file, "/x", "not HDF5"};
  expect_io_error([&] { read_dataset(file, "/x"); }, needles);
  expect_io_error([&] { dataset_info(file, "/x"); }, needles);
  expect_io_error([&] { has_dataset(file, "/x"); }, needles);
  expect_io_error([&] { list_datasets(file); }, {file, "not HDF5"});
  // Writing never silently clobbers a file that is not HDF5 ...
  expect_io_error([&] { write_dataset(file, "/x", Tensor::zeros({2}, DType::f32)); },
                  {file, "/x", "not HDF5", "truncate_file"});
  // ... unless asked to.
  write_dataset(file, "/x", Tensor::zeros({2}, DType::f32), {.truncate_file = true});
  EXPECT_TRUE(has_dataset(file, "/x"));
  // An empty file is not HDF5 either.
  const std::string empty = path("empty.h5");
  std::ofstream(empty).close();
  expect_io_error([&] { read_dataset(empty, "/x"); }, {empty, "/x", "not HDF5"});
}

TEST_F(H5FileErrors, MissingDatasetOrGroup) {
  const std::string file = path("data.h5");
  write_dataset(file, "/group/x", Tensor::zeros({2, 2}, DType::f32));
  expect_io_error([&] { read_dataset(file, "/group/y"); }, {file, "/group/y", "no object"});
  expect_io_error([&] { read_dataset(file, "/other/y"); }, {file, "/other/y", "no group '/other'"});
  expect_io_error([&] { dataset_info(file, "/group/x/z"); },
                  {file, "/group/x/z", "'/group/x' is a dataset, not a group"});
  expect_io_error([&] { read_hyperslab(file, "/nope", Box{{0}, {1}}); }, {file, "/nope"});
  expect_io_error([&] { read_dataset(file, ""); }, {file, "no name"});
  expect_io_error([&] { read_dataset(file, "///"); }, {file, "no name"});
}

TEST_F(H5FileErrors, GroupWhereDatasetExpected) {
  const std::string file = path("data.h5");
  write_dataset(file, "/group/inner/x", Tensor::zeros({2}, DType::f32));
  const std::vector<std::string> needles = {file, "/group/inner", "expected a dataset",
                                            "found a group"};
  expect_io_error([&] { read_dataset(file, "/group/inner"); }, needles);
  expect_io_error([&] { dataset_info(file, "group/inner"); }, needles);
  expect_io_error([&] { read_hyperslab(file, "/group/inner", Box{{0}, {1}}); }, needles);
  // Writing never replaces a group, nor writes below a dataset.
  expect_io_error([&] { write_dataset(file, "/group", Tensor::zeros({1}, DType::f32)); },
                  {file, "/group", "found a group"});
  expect_io_error([&] { write_dataset(file, "/group/inner/x/y", Tensor::zeros({1}, DType::f32)); },
                  {file, "/group/inner/x/y", "'/group/inner/x' to be a group", "found a dataset"});
  EXPECT_TRUE(has_dataset(file, "/group/inner/x"));
}

TEST_F(H5FileErrors, BoxOutsideTheDataset) {
  const std::string file = path("data.h5");
  write_dataset(file, "/x", Tensor::zeros({4, 5}, DType::f64));
  const std::vector<std::string> rank_needles = {file, "/x", "2-d box", "(4, 5)"};
  expect_io_error([&] { read_hyperslab(file, "/x", Box{{0}, {4}}); }, rank_needles);
  expect_io_error([&] { read_hyperslab(file, "/x", Box{{0, 0, 0}, {1, 1, 1}}); }, rank_needles);
  const std::vector<std::string> range_needles = {file, "/x", "within the dataset shape (4, 5)"};
  expect_io_error([&] { read_hyperslab(file, "/x", Box{{0, 0}, {5, 5}}); }, range_needles);
  expect_io_error([&] { read_hyperslab(file, "/x", Box{{-1, 0}, {2, 5}}); }, range_needles);
  expect_io_error([&] { read_hyperslab(file, "/x", Box{{3, 0}, {2, 5}}); }, range_needles);
  expect_io_error([&] { read_hyperslab(file, "/x", Box{{0, 6}, {4, 6}}); }, range_needles);
  // Empty boxes inside the dataset are fine.
  EXPECT_EQ(read_hyperslab(file, "/x", Box{{2, 5}, {2, 5}}).shape(), (Shape{0, 0}));
}

TEST_F(H5FileErrors, BadWriteOptions) {
  const std::string file = path("data.h5");
  const Tensor tensor = Tensor::zeros({4, 5}, DType::f32);
  expect_io_error([&] { write_dataset(file, "/x", tensor, {.chunks = Shape{2}}); },
                  {file, "/x", "2 chunk extents"});
  expect_io_error(
      [&] {
        write_dataset(file, "/x", tensor, {.chunks = Shape{2, 0}});
      },
      {file, "/x", "positive chunk extents"});
  expect_io_error([&] { write_dataset(file, "/x", tensor, {.gzip_level = 10}); },
                  {file, "/x", "gzip_level"});
  expect_io_error(
      [&] { write_dataset(file, "/x", Tensor::zeros({}, DType::f32), {.gzip_level = 1}); },
      {file, "/x", "0-d tensor"});
}

/// Writes datasets of HDF5 types Tessera does not read, with the HDF5 C API directly.
void write_unsupported_types(const std::string& file) {
  const hid_t handle = H5Fcreate(file.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(handle, 0);
  const hsize_t dims[1] = {4};
  const hid_t space = H5Screate_simple(1, dims, nullptr);
  auto make = [&](const char* name, hid_t type, const void* data) {
    const hid_t dataset =
        H5Dcreate2(handle, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(dataset, 0) << name;
    ASSERT_GE(H5Dwrite(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0) << name;
    H5Dclose(dataset);
  };
  const hid_t string_type = H5Tcopy(H5T_C_S1);
  H5Tset_size(string_type, 8);
  const char strings[4][8] = {"a", "bb", "ccc", "dddd"};
  make("strings", string_type, strings);
  struct Pair {
    int32_t a;
    double b;
  };
  const hid_t compound = H5Tcreate(H5T_COMPOUND, sizeof(Pair));
  H5Tinsert(compound, "a", HOFFSET(Pair, a), H5T_NATIVE_INT32);
  H5Tinsert(compound, "b", HOFFSET(Pair, b), H5T_NATIVE_DOUBLE);
  const Pair pairs[4] = {{1, 1.5}, {2, 2.5}, {3, 3.5}, {4, 4.5}};
  make("compound", compound, pairs);
  const long double long_doubles[4] = {1.0L, 2.0L, 3.0L, 4.0L};
  make("long_double", H5T_NATIVE_LDOUBLE, long_doubles);
  const int16_t shorts[4] = {-1, 2, -3, 4};
  make("i16", H5T_NATIVE_INT16, shorts);
  const hid_t enum_type = H5Tenum_create(H5T_NATIVE_INT8);
  int8_t value = 0;
  H5Tenum_insert(enum_type, "off", &value);
  value = 1;
  H5Tenum_insert(enum_type, "on", &value);
  const int8_t flags[4] = {0, 1, 1, 0};
  make("enum", enum_type, flags);
  H5Tclose(string_type);
  H5Tclose(compound);
  H5Tclose(enum_type);
  H5Sclose(space);
  H5Fclose(handle);
}

TEST_F(H5FileErrors, UnsupportedElementTypesNameTheTypeClass) {
  const std::string file = path("types.h5");
  write_unsupported_types(file);
  expect_io_error([&] { read_dataset(file, "/strings"); },
                  {file, "/strings", "string", "H5T_STRING"});
  expect_io_error([&] { read_dataset(file, "/compound"); },
                  {file, "/compound", "compound", "H5T_COMPOUND"});
  expect_io_error([&] { read_dataset(file, "/long_double"); },
                  {file, "/long_double", "128-bit float", "H5T_FLOAT"});
  expect_io_error([&] { read_dataset(file, "/enum"); }, {file, "/enum", "enum", "H5T_ENUM"});
  expect_io_error([&] { read_dataset(file, "/i16"); },
                  {file, "/i16", "i16", "H5T_INTEGER", "pass a dtype"});
  // A conversion is refused for non-numeric classes, and done for numeric ones.
  expect_io_error(
      [&] {
        read_hyperslab(file, "/strings", Box{{0}, {2}}, DType::f32);
      },
      {file, "/strings", "numeric", "H5T_STRING"});
  const Tensor shorts = read_dataset(file, "/i16", DType::i32);
  EXPECT_EQ(shorts.data<int32_t>()[2], -3);
  const Tensor long_doubles = read_dataset(file, "/long_double", DType::f64);
  EXPECT_EQ(long_doubles.data<double>()[3], 4.0);

  // Listing reports them without failing.
  std::map<std::string, DatasetInfo> infos;
  for (DatasetInfo& info : list_datasets(file)) infos[info.path] = info;
  ASSERT_EQ(infos.size(), 5u);
  EXPECT_EQ(infos["/strings"].file_type, "string");
  EXPECT_EQ(infos["/compound"].file_type, "compound");
  EXPECT_EQ(infos["/long_double"].file_type, "128-bit float");
  EXPECT_EQ(infos["/i16"].file_type, "i16");
  EXPECT_EQ(infos["/enum"].file_type, "enum");
  for (const auto& [name, info] : infos) EXPECT_EQ(info.dtype, std::nullopt) << name;
}

TEST_F(H5FileErrors, DatasetLargerThanMemoryIsAnIoErrorButItsBoxesRead) {
  // Chunked datasets with no chunk written: their metadata is tiny, whatever their shape.
  auto make_huge = [&](const std::string& file, hsize_t rows, hsize_t cols) {
    const hid_t handle = H5Fcreate(file.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(handle, 0);
    const hsize_t dims[2] = {rows, cols}, chunk[2] = {64, 64};
    const hid_t space = H5Screate_simple(2, dims, nullptr);
    const hid_t creation = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(creation, 2, chunk);
    const hid_t dataset =
        H5Dcreate2(handle, "huge", H5T_IEEE_F32LE, space, H5P_DEFAULT, creation, H5P_DEFAULT);
    ASSERT_GE(dataset, 0);
    H5Dclose(dataset);
    H5Pclose(creation);
    H5Sclose(space);
    H5Fclose(handle);
  };
  // 2^60 elements: a shape a tensor could describe, far beyond any memory.
  const std::string file = path("huge.h5");
  make_huge(file, hsize_t{1} << 40, hsize_t{1} << 20);
  EXPECT_EQ(dataset_info(file, "huge").shape, (Shape{int64_t{1} << 40, int64_t{1} << 20}));
  expect_io_error([&] { read_dataset(file, "huge"); }, {file, "/huge", "fits in memory"});
  const Tensor corner = read_hyperslab(file, "huge", Box{{5, 7}, {9, 10}});
  EXPECT_EQ(corner.shape(), (Shape{4, 3}));
  EXPECT_EQ(corner.item_as_double({3, 2}), 0.0);  // never written: the fill value
  // 2^70 elements: more than any tensor's element count can hold, refused on sight.
  const std::string beyond = path("beyond.h5");
  make_huge(beyond, hsize_t{1} << 40, hsize_t{1} << 30);
  expect_io_error([&] { dataset_info(beyond, "huge"); }, {beyond, "/huge", "elements"});
  expect_io_error(
      [&] {
        read_hyperslab(beyond, "huge", Box{{0, 0}, {1, 1}});
      },
      {beyond, "/huge", "elements"});
}

/// A file with several datasets (contiguous, chunked and compressed) for the damage tests.
std::vector<std::pair<std::string, Tensor>> write_damage_sample(const std::string& file,
                                                                bool checksum) {
  std::vector<std::pair<std::string, Tensor>> datasets = {
      {"/fields/u", random_bits_tensor({16, 16}, DType::f32, 1)},
      {"/fields/p", random_bits_tensor({40}, DType::i64, 2)},
      {"/compressed", random_bits_tensor({24, 24}, DType::f64, 3)},
  };
  write_dataset(file, datasets[0].first, datasets[0].second, {.checksum = checksum});
  write_dataset(file, datasets[1].first, datasets[1].second, {.checksum = checksum});
  write_dataset(file, datasets[2].first, datasets[2].second,
                {.chunks = Shape{8, 8}, .gzip_level = 4, .checksum = checksum});
  return datasets;
}

TEST_F(H5FileErrors, TruncatedFileIsAnIoErrorAtEveryLength) {
  const std::string original = path("original.h5");
  const auto datasets = write_damage_sample(original, /*checksum=*/false);
  const uintmax_t size = fs::file_size(original);
  for (int step = 1; step <= 20; ++step) {
    const uintmax_t length = step == 10 ? size / 2 : size * static_cast<uintmax_t>(step) / 21;
    SCOPED_TRACE("truncated to " + std::to_string(length) + " of " + std::to_string(size));
    const std::string file = path("truncated.h5");
    fs::copy_file(original, file, fs::copy_options::overwrite_existing);
    fs::resize_file(file, length);
    for (const auto& [name, tensor] : datasets) {
      expect_io_error([&] { read_dataset(file, name); }, {file, name});
      expect_io_error([&] { dataset_info(file, name); }, {file, name});
      expect_io_error([&] { read_hyperslab(file, name, Box::of_shape(tensor.shape())); },
                      {file, name});
    }
    expect_io_error([&] { list_datasets(file); }, {file});
  }
}

/// Overwrites 16 bytes of `file` at `offset` with garbage.
void overwrite_bytes(const std::string& file, uintmax_t offset) {
  std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
  stream.seekp(static_cast<std::streamoff>(offset));
  const char garbage[16] = {'\x5a', '\xa5', '\x13', '\x37', '\xde', '\xad', '\xbe', '\xef',
                            '\x00', '\xff', '\x42', '\x24', '\x81', '\x18', '\x7e', '\xe7'};
  stream.write(garbage, sizeof garbage);
}

/// How reads of a damaged file ended.
struct DamageOutcome {
  int io_errors = 0;  // IoError naming the file and dataset
  int identical = 0;  // the damage hit unused space or another dataset
  int different = 0;  // the right shape and dtype, damaged elements (no checksum to tell)
};

/// Reads every dataset of a damaged copy of a sample file; fails the test on anything but an
/// IoError or a tensor of the written shape and dtype (and on any output to stderr).
DamageOutcome read_damaged(const std::string& file,
                           const std::vector<std::pair<std::string, Tensor>>& datasets) {
  DamageOutcome outcome;
  testing::internal::CaptureStderr();
  try {
    list_datasets(file);
  } catch (const IoError& error) {
    EXPECT_NE(std::string(error.what()).find(file), std::string::npos) << error.what();
  }
  for (const auto& [name, tensor] : datasets) {
    try {
      const Tensor read = read_dataset(file, name);
      EXPECT_EQ(read.shape(), tensor.shape()) << name;
      EXPECT_EQ(read.dtype(), tensor.dtype()) << name;
      ++(bitwise_equal(read, tensor) ? outcome.identical : outcome.different);
    } catch (const IoError& error) {
      ++outcome.io_errors;
      const std::string message = error.what();
      EXPECT_NE(message.find(file), std::string::npos) << message;
      EXPECT_NE(message.find(name), std::string::npos) << message;
    }
  }
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  return outcome;
}

TEST_F(H5FileErrors, CorruptedChecksummedFileIsAnIoErrorNeverWrongData) {
  // With checksums on the data (WriteOptions::checksum) and on all metadata (HDF5 1.10 formats),
  // damage anywhere is either reported or harmless: a read never returns different elements.
  const std::string original = path("original.h5");
  const auto datasets = write_damage_sample(original, /*checksum=*/true);
  const uintmax_t size = fs::file_size(original);
  int detected = 0;
  for (int step = 0; step < 20; ++step) {
    const uintmax_t offset = size * static_cast<uintmax_t>(step + 1) / 22;
    SCOPED_TRACE("16 bytes overwritten at " + std::to_string(offset) + " of " +
                 std::to_string(size));
    const std::string file = path("corrupted.h5");
    fs::copy_file(original, file, fs::copy_options::overwrite_existing);
    overwrite_bytes(file, offset);
    const DamageOutcome outcome = read_damaged(file, datasets);
    EXPECT_EQ(outcome.different, 0);
    if (outcome.io_errors > 0) ++detected;
  }
  EXPECT_GE(detected, 10) << "most of the file is metadata or checksummed data";
}

TEST_F(H5FileErrors, CorruptedFileIsAnIoErrorOrDamagedValuesNeverACrash) {
  // Without data checksums (the default, as in h5py) damaged elements cannot be told from real
  // ones; damaged metadata still raises IoError. Either way: no crash, no other exception.
  const std::string original = path("original.h5");
  const auto datasets = write_damage_sample(original, /*checksum=*/false);
  const uintmax_t size = fs::file_size(original);
  int detected = 0;
  for (int step = 0; step < 20; ++step) {
    const uintmax_t offset = size * static_cast<uintmax_t>(step + 1) / 22;
    SCOPED_TRACE("16 bytes overwritten at " + std::to_string(offset) + " of " +
                 std::to_string(size));
    const std::string file = path("corrupted.h5");
    fs::copy_file(original, file, fs::copy_options::overwrite_existing);
    overwrite_bytes(file, offset);
    if (read_damaged(file, datasets).io_errors > 0) ++detected;
  }
  EXPECT_GE(detected, 1);
}

TEST_F(H5FileErrors, CorruptedFilePrintsNothingAtExit) {
  // HDF5 1.10 leaks an object header after a checksum failure and, at exit, prints "infinite loop
  // closing library" unless automatic error printing is off (HDF5 issue #3790).
  const std::string original = path("original.h5");
  write_damage_sample(original, /*checksum=*/false);
  const std::string file = path("corrupted.h5");
  fs::copy_file(original, file);
  overwrite_bytes(file, 64);  // inside the root group's object header: a checksum failure
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        bool threw_io_error = false;
        try {
          list_datasets(file);
        } catch (const IoError&) {
          threw_io_error = true;
        }
        remove_directory();
        std::exit(threw_io_error ? 0 : 1);
      },
      testing::ExitedWithCode(0), "^$");
}

}  // namespace
}  // namespace tessera::io
