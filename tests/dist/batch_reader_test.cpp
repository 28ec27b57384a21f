// Distributed tests of io::BatchReader: over every world size 1..4 and every ("dp", domain..)
// mesh, each batch holds exactly the file's rows of the samples its order names (every rank its
// own box, bit for bit); an epoch visits every sample once; the order is a pure function of
// (seed, epoch); seek() resumes exactly; read-ahead depth changes nothing; bad datasets and
// options, and read failures met by the background thread, raise the same AgreedError everywhere;
// each rank opens the file once (counted), so a file removed while it is read stays readable.
#include "io/hdf5/batch_reader.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "core/agree.hpp"
#include "io/hdf5/h5_file.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/io_test_support.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

/// The global batch the reader should produce: the rows `samples` of `full`, stacked.
Tensor expected_batch(const Tensor& full, const std::vector<int64_t>& samples) {
  Shape shape = full.shape();
  shape[0] = static_cast<int64_t>(samples.size());
  Tensor batch = Tensor::empty(shape, full.dtype());
  const size_t row_bytes =
      static_cast<size_t>(full.numel() / full.shape()[0]) * dtype_size(full.dtype());
  for (size_t r = 0; r < samples.size(); ++r)
    std::memcpy(static_cast<char*>(batch.raw_data()) + r * row_bytes,
                static_cast<const char*>(full.raw_data()) + samples[r] * row_bytes, row_bytes);
  return batch;
}

/// Meshes for a world: every factorization with its first dim named "dp", and without a dp dim.
std::vector<std::pair<std::vector<int>, std::vector<std::string>>> reader_meshes(int size) {
  std::vector<std::pair<std::vector<int>, std::vector<std::string>>> meshes;
  for (const std::vector<int>& shape : testing::mesh_factorizations(size)) {
    if (shape.size() > 3) continue;  // a sample has at most 2 spatial dims here
    std::vector<std::string> names{"dp", "x", "y"};
    names.resize(shape.size());
    meshes.emplace_back(shape, names);
    if (shape.size() <= 2) {
      std::vector<std::string> domain{"x", "y"};
      domain.resize(shape.size());
      meshes.emplace_back(shape, domain);
    }
  }
  return meshes;
}

TEST(BatchReader, BatchesHoldTheFilesSamplesInTheSeededOrder) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "batch_reader", "order");
      const std::string file = dir + "/samples.h5";
      testing::CaseRng data_rng(testing::case_seed(71, comm->size(), 0, 0));
      const Tensor full = testing::integer_tensor({9, 2, 5, 4}, DType::f32, data_rng, -100, 100);
      if (comm->rank() == 0)
        io::write_dataset(file, "/snapshots", full, {.chunks = Shape{1, 2, 3, 4}});
      comm->barrier();
      const auto meshes = reader_meshes(comm->size());
      for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
        DeviceMesh mesh(comm, meshes[mesh_index].first, meshes[mesh_index].second);
        for (int index = 0; index < 6; ++index) {
          testing::CaseRng rng(testing::case_seed(72, comm->size(), mesh_index, index));
          io::BatchReaderOptions options;
          options.batch_size = rng.uniform(1, 9);
          options.seed = static_cast<uint64_t>(rng.uniform(0, 1000));
          options.shuffle = rng.chance(0.8);
          options.drop_last = rng.chance(0.5);
          options.read_ahead = static_cast<int>(rng.uniform(0, 3));
          SCOPED_TRACE(
              fmt::format("mesh {} ({}), batch {}, seed {}, shuffle {}, drop_last {}, "
                          "read_ahead {}",
                          mesh.str(), fmt::join(mesh.names(), ","), options.batch_size,
                          options.seed, options.shuffle, options.drop_last, options.read_ahead));
          io::BatchReader reader(file, "/snapshots", mesh, options);
          const int64_t steps = reader.steps_per_epoch();
          EXPECT_EQ(steps, options.drop_last ? 9 / options.batch_size
                                             : (9 + options.batch_size - 1) / options.batch_size);
          for (int64_t epoch = 0; epoch < 2; ++epoch) {
            std::vector<int64_t> seen;
            for (int64_t step = 0; step < steps; ++step) {
              EXPECT_EQ(reader.position(), (io::BatchPosition{epoch, step}));
              const std::vector<int64_t> samples = reader.batch_samples({epoch, step});
              const ShardTensor batch = reader.next();
              const Tensor expected = expected_batch(full, samples);
              EXPECT_EQ(batch.global_shape(), expected.shape());
              EXPECT_TRUE(bitwise_equal(batch.to_local(), expected.view_box(batch.local_box())))
                  << "epoch " << epoch << " step " << step << " rank " << comm->rank();
              seen.insert(seen.end(), samples.begin(), samples.end());
            }
            // Every sample at most once per epoch; all of them without drop_last.
            std::sort(seen.begin(), seen.end());
            EXPECT_TRUE(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
            if (!options.drop_last) {
              EXPECT_EQ(seen.size(), 9u);
            }
            std::vector<int64_t> order = reader.epoch_order(epoch);
            std::sort(order.begin(), order.end());
            std::vector<int64_t> identity(9);
            std::iota(identity.begin(), identity.end(), 0);
            EXPECT_EQ(order, identity) << "epoch_order is not a permutation";
          }
          if (options.shuffle) {
            EXPECT_NE(reader.epoch_order(0), reader.epoch_order(1)) << "epochs share an order";
          }
        }
      }
      testing::remove_test_dir(*comm, dir);
    });
  }
}

TEST(BatchReader, OpensTheFileOnceAndReadsEverySampleOncePerEpoch) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "batch_reader", "opens");
      const std::string file = dir + "/samples.h5";
      testing::CaseRng data_rng(testing::case_seed(75, comm->size(), 0, 0));
      const Tensor full = testing::integer_tensor({11, 2, 6, 4}, DType::f32, data_rng, -100, 100);
      if (comm->rank() == 0) io::write_dataset(file, "/snapshots", full);
      comm->barrier();
      // A dp dim over the ranks (when even), the rest over the sample's x.
      const int dp = comm->size() % 2 == 0 ? 2 : 1;
      DeviceMesh mesh(comm, {dp, comm->size() / dp}, {"dp", "x"});
      const int64_t before = io::file_open_count();
      comm->barrier();
      {
        io::BatchReader reader(file, "/snapshots", mesh,
                               {.batch_size = 4, .seed = 9, .drop_last = false, .read_ahead = 2});
        comm->barrier();
        const int64_t constructed = io::file_open_count();
        // Under mpi one process per rank: its reader, plus rank 0's look at the header (which
        // opens the file twice). Local ranks share the process: every rank's reader and the
        // header look.
        EXPECT_LE(constructed - before, testing::mpi_backend() ? 3 : comm->size() + 2);
        for (int64_t epoch = 0; epoch < 3; ++epoch) {
          std::vector<int64_t> seen;
          for (int64_t step = 0; step < reader.steps_per_epoch(); ++step) {
            const std::vector<int64_t> samples = reader.batch_samples({epoch, step});
            const ShardTensor batch = reader.next();
            EXPECT_TRUE(bitwise_equal(batch.to_local(),
                                      expected_batch(full, samples).view_box(batch.local_box())));
            seen.insert(seen.end(), samples.begin(), samples.end());
          }
          std::sort(seen.begin(), seen.end());
          std::vector<int64_t> identity(11);
          std::iota(identity.begin(), identity.end(), 0);
          EXPECT_EQ(seen, identity) << "epoch " << epoch << ": every sample exactly once";
        }
        comm->barrier();
        EXPECT_EQ(io::file_open_count(), constructed)
            << "the reader reopened the file while reading 3 epochs";
        comm->barrier();
      }
      testing::remove_test_dir(*comm, dir);
    });
  }
}

TEST(BatchReader, OrderIsAPureFunctionOfSeedAndEpoch) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    const std::string dir = testing::make_test_dir(*comm, "batch_reader", "seed");
    const std::string file = dir + "/samples.h5";
    io::write_dataset(file, "/s", Tensor::zeros({10, 1}, DType::u8));
    DeviceMesh mesh(comm, {1}, {"dp"});
    io::BatchReader a(file, "/s", mesh, {.batch_size = 2, .seed = 1});
    io::BatchReader b(file, "/s", mesh, {.batch_size = 5, .seed = 1, .read_ahead = 0});
    io::BatchReader c(file, "/s", mesh, {.batch_size = 2, .seed = 2});
    EXPECT_EQ(a.epoch_order(3), b.epoch_order(3));
    EXPECT_NE(a.epoch_order(0), c.epoch_order(0));
    // Pinned: the order must not change between builds, libraries or machines.
    EXPECT_EQ(a.epoch_order(0), (std::vector<int64_t>{1, 2, 8, 9, 3, 4, 7, 0, 6, 5}));
    io::BatchReader plain(file, "/s", mesh, {.batch_size = 3, .shuffle = false});
    EXPECT_EQ(plain.batch_samples({4, 2}), (std::vector<int64_t>{6, 7, 8}));
    testing::remove_test_dir(*comm, dir);
  });
}

TEST(BatchReader, SeekResumesExactly) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "batch_reader", "seek");
      const std::string file = dir + "/samples.h5";
      testing::CaseRng rng(testing::case_seed(73, comm->size(), 0, 0));
      const Tensor full = testing::integer_tensor({7, 3, 6}, DType::f64, rng, -50, 50);
      if (comm->rank() == 0) io::write_dataset(file, "/u", full);
      comm->barrier();
      DeviceMesh mesh(comm, {comm->size()}, {"x"});
      const io::BatchReaderOptions options{.batch_size = 3, .seed = 9};
      std::vector<Tensor> first_run;
      {
        io::BatchReader reader(file, "/u", mesh, options);
        for (int i = 0; i < 7; ++i) first_run.push_back(reader.next().to_local());
      }
      io::BatchReader resumed(file, "/u", mesh, options);
      resumed.next();        // reads ahead of the position it is then moved back and forth from
      resumed.seek({1, 1});  // 2 steps per epoch: batch 3 of the first run
      for (int i = 3; i < 7; ++i)
        EXPECT_TRUE(bitwise_equal(resumed.next().to_local(), first_run[i])) << "batch " << i;
      resumed.seek({0, 0});
      EXPECT_TRUE(bitwise_equal(resumed.next().to_local(), first_run[0]));
      EXPECT_THROW(resumed.seek({0, 2}), InvalidArgument);
      testing::remove_test_dir(*comm, dir);
    });
  }
}

TEST(BatchReader, ErrorsAreRaisedTheSameOnEveryRank) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "batch_reader", "errors");
      const std::string file = dir + "/samples.h5";
      if (comm->rank() == 0) {
        io::write_dataset(file, "/u", Tensor::zeros({4, 2, 8}, DType::f32),
                          {.chunks = Shape{1, 2, 8}, .checksum = true});
        io::write_dataset(file, "/flat", Tensor::zeros({4}, DType::f32));
      }
      comm->barrier();
      DeviceMesh mesh(comm, {comm->size()}, {"dp"});
      DeviceMesh domain(comm, {comm->size()}, {"x"});
      auto expect_agreed = [&](const std::function<void()>& action, const std::string& what,
                               const std::string& needle) {
        const std::string message = testing::agreed_error_of(action);
        testing::expect_same_error_everywhere(*comm, message, what);
        EXPECT_NE(message.find(needle), std::string::npos) << message;
      };
      expect_agreed([&] { io::BatchReader(file, "/missing", mesh, {}); }, "missing dataset",
                    "/missing");
      expect_agreed([&] { io::BatchReader(file, "/flat", mesh, {}); }, "1-d dataset",
                    "at least 2 dims");
      expect_agreed([&] { io::BatchReader(file, "/u", mesh, {.batch_size = 5}); },
                    "batch larger than the samples", "no batch");
      expect_agreed([&] { io::BatchReader(file, "/u", domain, {.shard_dims = {0}}); },
                    "sharding the sample dim", "not a dim of the sample");
      expect_agreed(
          [&] {
            io::BatchReader(file, "/u", domain, {.shard_dims = {2, 1}});
          },
          "too many shard dims", "shard_dims");

      // The reader holds the file open: removing it changes nothing (POSIX keeps the data).
      {
        io::BatchReader reader(file, "/u", domain, {.batch_size = 1, .read_ahead = 1});
        comm->barrier();
        const std::string copy = dir + "/copy.h5";
        if (comm->rank() == 0) {
          std::filesystem::copy_file(file, copy);
          std::filesystem::remove(file);
        }
        comm->barrier();
        for (int step = 0; step < 8; ++step)
          EXPECT_EQ(testing::agreed_error_of([&] { reader.next(); }), "");
        comm->barrier();
        if (comm->rank() == 0) std::filesystem::rename(copy, file);
        comm->barrier();
      }
      // The file is overwritten with garbage while batches are read ahead: the samples not yet
      // read fail their checksums, and a later next() fails on every rank.
      io::BatchReader reader(file, "/u", domain, {.batch_size = 1, .read_ahead = 1});
      comm->barrier();
      if (comm->rank() == 0) {
        const auto size = std::filesystem::file_size(file);
        std::fstream damage(file, std::ios::in | std::ios::out | std::ios::binary);
        damage.seekp(static_cast<std::streamoff>(size / 2));
        damage << std::string(size - size / 2, '\xab');
      }
      comm->barrier();
      std::string message;
      for (int step = 0; step < 8 && message.empty(); ++step)
        message = testing::agreed_error_of([&] { reader.next(); });
      testing::expect_same_error_everywhere(*comm, message, "file removed while reading");
      testing::remove_test_dir(*comm, dir);
    });
  }
}

}  // namespace
}  // namespace tessera
