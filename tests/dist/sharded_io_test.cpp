// Distributed tests of sharded HDF5 IO (io/hdf5/sharded_io.hpp): read_sharded (collective MPI-IO
// where available, and independent) and scatter (with a tiny staging budget that forces slabbing,
// and with the default) give every rank exactly its box of the dataset, bit for bit, for every
// dtype and contiguous, chunked and compressed storage; gather_write and write_sharded (collective
// and in turns) write back the global tensor bit for bit (Partial layouts included) without
// leaving a temporary file; missing files and datasets, Partial
// placements on read and unwritable outputs raise the same AgreedError on every rank.
// Built only with HDF5. Files live in a directory named from values every rank knows (backend,
// world size, test binary, and the pid under the local backend), created and removed by rank 0.
#include "io/hdf5/sharded_io.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "core/agree.hpp"
#include "core/config.hpp"
#include "io/hdf5/h5_file.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/io_test_support.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

namespace fs = std::filesystem;

constexpr DType io_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                               DType::i32, DType::i64, DType::u8};
constexpr int cases_per_world = 64;
constexpr size_t tiny_staging = 64;

/// One random layout (Shard/Replicate, or with Partial when `partial_op` is given) of a random
/// global tensor of one of the IO dtypes.
testing::ShardCase io_case(const std::vector<int>& mesh_shape, testing::CaseRng& rng,
                           std::optional<ReduceOp> partial_op) {
  testing::ShardCase shard_case;
  // Datasets of rank 1..6 (small extents at ranks 5 and 6).
  const int ndim = static_cast<int>(rng.uniform(1, 6));
  shard_case.global_shape.resize(ndim);
  for (int64_t& extent : shard_case.global_shape) extent = rng.uniform(0, ndim <= 4 ? 9 : 3);
  shard_case.dtype = io_dtypes[rng.uniform(0, std::size(io_dtypes) - 1)];
  shard_case.placements =
      testing::random_placements(ndim, static_cast<int>(mesh_shape.size()), rng, partial_op);
  shard_case.extents = testing::random_layout_extents(shard_case.global_shape, mesh_shape,
                                                      shard_case.placements, rng);
  return shard_case;
}

/// Checks this rank's piece of a tensor read from the dataset holding `full`.
void expect_piece(const ShardTensor& sharded, const Tensor& full,
                  const testing::ShardCase& shard_case, const std::string& how) {
  EXPECT_EQ(sharded.global_shape(), shard_case.global_shape) << how;
  EXPECT_EQ(sharded.placements(), shard_case.placements) << how;
  EXPECT_EQ(sharded.dtype(), shard_case.dtype) << how;
  const Box box = sharded.local_box();
  EXPECT_TRUE(bitwise_equal(sharded.to_local(), full.view_box(box)))
      << how << ": rank " << sharded.mesh().rank() << " box " << box.str();
}

/// True when a ".tmp-" file was left in `dir`.
bool has_temporary_file(const std::string& dir) {
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().find(".tmp-") != std::string::npos) return true;
  return false;
}

TEST(ShardedIo, ReadScatterAndGatherWriteAreBitExactOnEveryLayout) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "sharded_io", "roundtrip");
      const auto meshes = testing::mesh_factorizations(comm->size());
      const int cases = testing::cases_per_mesh(comm->size(), cases_per_world);
      for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
        DeviceMesh mesh(comm, meshes[mesh_index]);
        for (int index = 0; index < cases; ++index) {
          testing::CaseRng rng(testing::case_seed(40, comm->size(), mesh_index, index));
          const testing::ShardCase shard_case = io_case(mesh.shape(), rng, std::nullopt);
          SCOPED_TRACE(
              fmt::format("mesh {}: {}", testing::shape_str(mesh.shape()), shard_case.str()));
          const Tensor full =
              testing::integer_tensor(shard_case.global_shape, shard_case.dtype, rng, -1000, 1000);
          const std::string input = fmt::format("{}/in_{}_{}.h5", dir, mesh_index, index);
          // Contiguous, chunked, or chunked and gzip-compressed (with shuffle), at random.
          io::WriteOptions storage;
          const int64_t kind = rng.uniform(0, 2);
          if (kind >= 1 && full.ndim() > 0 && full.numel() > 0) {
            storage.chunks = Shape(full.ndim());
            for (int64_t& extent : *storage.chunks) extent = rng.uniform(1, 4);
            if (kind == 2) storage.gzip_level = static_cast<int>(rng.uniform(1, 9));
          }
          if (comm->rank() == 0) io::write_dataset(input, "/fields/u", full, storage);
          comm->barrier();
          SCOPED_TRACE(kind == 0 ? "contiguous" : kind == 1 ? "chunked" : "chunked+gzip");

          expect_piece(
              io::read_sharded(input, "/fields/u", mesh, shard_case.placements, shard_case.extents),
              full, shard_case, "read_sharded");
          expect_piece(io::read_sharded(input, "/fields/u", mesh, shard_case.placements,
                                        shard_case.extents, std::nullopt, /*collective=*/false),
                       full, shard_case, "read_sharded (independent)");
          // Read with conversion: HDF5 converts every one of these integer values exactly.
          const ShardTensor converted = io::read_sharded(
              input, "/fields/u", mesh, shard_case.placements, shard_case.extents, DType::f64);
          EXPECT_TRUE(bitwise_equal(converted.to_local(),
                                    full.to_dtype(DType::f64).view_box(converted.local_box())))
              << "read_sharded as f64";
          const int root = static_cast<int>(rng.uniform(0, comm->size() - 1));
          expect_piece(io::scatter(input, "/fields/u", mesh, shard_case.placements,
                                   shard_case.extents, root, tiny_staging),
                       full, shard_case, "scatter (64-byte staging)");
          const ShardTensor sharded = io::scatter(input, "/fields/u", mesh, shard_case.placements,
                                                  shard_case.extents, root);
          expect_piece(sharded, full, shard_case, "scatter");

          // Write back: from the scattered tensor, and from a Partial layout of the same values.
          const int write_root = static_cast<int>(rng.uniform(0, comm->size() - 1));
          const std::string output = fmt::format("{}/out_{}_{}.h5", dir, mesh_index, index);
          io::gather_write(sharded, output, "/result", write_root, tiny_staging);
          const ReduceOp partial_op = rng.chance(0.5) ? ReduceOp::sum : ReduceOp::max;
          const ShardTensor partial = ShardTensor::distribute(
              full, mesh, testing::random_placements(full.ndim(), mesh.ndim(), rng, partial_op));
          io::gather_write(partial, output, "/partial", write_root);
          if (comm->rank() == write_root) {
            EXPECT_TRUE(bitwise_equal(io::read_dataset(output, "/result"), full))
                << "gather_write from " << sharded.spec().str();
            EXPECT_TRUE(bitwise_equal(io::read_dataset(output, "/partial"), full))
                << "gather_write from " << partial.spec().str();
            EXPECT_FALSE(has_temporary_file(dir));
          }
          comm->barrier();

          // Every rank writes its own box (collective MPI-IO where available, and in turns).
          const std::string parallel = fmt::format("{}/par_{}_{}.h5", dir, mesh_index, index);
          io::write_sharded(sharded, parallel, "/result");
          io::write_sharded(partial, parallel, "/partial", /*collective=*/false);
          io::write_sharded(sharded, parallel, "/turns", /*collective=*/false);
          io::write_sharded(partial, parallel, "/partial_collective");
          // The writes in the input's storage (chunked, compressed) too.
          io::write_sharded(sharded, parallel, "/stored", /*collective=*/true, storage);
          io::write_sharded(sharded, parallel, "/stored_turns", /*collective=*/false, storage);
          io::gather_write(sharded, parallel, "/stored_root", write_root, tiny_staging, storage);
          if (comm->rank() == 0) {
            for (const char* name : {"/result", "/partial", "/turns", "/partial_collective",
                                     "/stored", "/stored_turns", "/stored_root"})
              EXPECT_TRUE(bitwise_equal(io::read_dataset(parallel, name), full))
                  << "write_sharded " << name;
            for (const char* name : {"/stored", "/stored_turns", "/stored_root"})
              EXPECT_EQ(io::dataset_info(parallel, name).chunks.has_value(),
                        storage.chunks.has_value())
                  << name;
            EXPECT_FALSE(has_temporary_file(dir));
          }
          comm->barrier();
        }
      }
      testing::remove_test_dir(*comm, dir);
    });
  }
}

// Device tensors move through HDF5 in slabs; with TESSERA_IO_SLAB_BYTES set, cpu tensors take
// the same path, so the collective reads and writes (where every rank must make as many HDF5
// calls as the rank with the most slabs) are checked here with uneven boxes and replicas.
TEST(ShardedIo, SlabbedCollectiveReadsAndWritesEqualTheDataset) {
  ::setenv("TESSERA_IO_SLAB_BYTES", "200", 1);
  for (int world_size = 1; world_size <= 4; ++world_size)
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "sharded_io", "slabs");
      testing::CaseRng rng(testing::case_seed(45, comm->size(), 0, 0));
      const Tensor full = testing::integer_tensor({23, 9, 5}, DType::f64, rng, -99, 99);
      const std::string input = dir + "/in.h5", output = dir + "/out.h5";
      if (comm->rank() == 0) io::write_dataset(input, "/u", full);
      comm->barrier();
      // Rank r holds 1 + 2r rows (the last rank the rest): different slab counts per rank.
      std::vector<int64_t> rows(comm->size());
      int64_t assigned = 0;
      for (int r = 0; r + 1 < comm->size(); ++r) assigned += rows[r] = 1 + 2 * r;
      rows.back() = 23 - assigned;
      const std::vector<std::pair<std::vector<int>, std::vector<Placement>>> layouts{
          {{comm->size()}, {Placement::shard(0)}},
          {{comm->size()}, {Placement::replicate()}},
      };
      for (const auto& [mesh_shape, placements] : layouts) {
        DeviceMesh mesh(comm, mesh_shape);
        const std::vector<std::vector<int64_t>> extents =
            placements[0].is_shard() ? std::vector<std::vector<int64_t>>{rows}
                                     : std::vector<std::vector<int64_t>>{};
        for (bool collective : {true, false}) {
          const ShardTensor read =
              io::read_sharded(input, "/u", mesh, placements, extents, std::nullopt, collective);
          EXPECT_TRUE(bitwise_equal(read.to_local(), full.view_box(read.local_box()).contiguous()))
              << read.spec().str() << " collective " << collective;
          io::write_sharded(read, output, "/u", collective);
          io::gather_write(read, output, "/v", comm->size() - 1, 64);
          if (comm->rank() == 0) {
            EXPECT_TRUE(bitwise_equal(io::read_dataset(output, "/u"), full));
            EXPECT_TRUE(bitwise_equal(io::read_dataset(output, "/v"), full));
          }
          comm->barrier();
        }
      }
      testing::remove_test_dir(*comm, dir);
    });
  ::unsetenv("TESSERA_IO_SLAB_BYTES");
}

TEST(ShardedIo, CollectiveIoIsUsedExactlyWithParallelHdf5AndTheMpiBackend) {
  for (int world_size = 1; world_size <= 4; ++world_size)
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const DeviceMesh mesh(comm, {comm->size()});
      EXPECT_EQ(io::collective_io_available(mesh),
                TESSERA_HAVE_PARALLEL_HDF5 && comm->backend() == "mpi");
    });
}

TEST(ShardedIo, ReplacingADatasetKeepsTheOthersAndDoesNotGrowTheFile) {
  for (int world_size = 1; world_size <= 3; ++world_size) {
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "sharded_io", "replace");
      DeviceMesh mesh(comm, {comm->size()});
      testing::CaseRng rng(testing::case_seed(44, comm->size(), 0, 0));
      const Tensor full = testing::integer_tensor({64, 32}, DType::f64, rng, -9, 9);
      const ShardTensor sharded = ShardTensor::distribute(full, mesh, {Placement::shard(0)});
      const std::string alone = dir + "/alone.h5", shared = dir + "/shared.h5";
      if (comm->rank() == 0) io::write_dataset(shared, "/keep", full);
      comm->barrier();
      uintmax_t first_size = 0;
      for (int round = 0; round < 4; ++round) {
        io::gather_write(sharded, alone, "/u", 0, tiny_staging);
        io::write_sharded(sharded, alone, "/u", round % 2 == 0);
        io::write_sharded(sharded, shared, "/u");
        io::gather_write(sharded, shared, "/group/v");
        if (comm->rank() == 0) {
          if (round == 0) first_size = fs::file_size(alone);
          EXPECT_EQ(fs::file_size(alone), first_size) << "round " << round;
          EXPECT_TRUE(bitwise_equal(io::read_dataset(alone, "/u"), full));
          for (const char* name : {"/keep", "/u", "/group/v"})
            EXPECT_TRUE(bitwise_equal(io::read_dataset(shared, name), full)) << name;
        }
        comm->barrier();
      }
      testing::remove_test_dir(*comm, dir);
    });
  }
}

TEST(ShardedIo, ErrorsAreRaisedTheSameOnEveryRank) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "sharded_io", "errors");
      const std::string input = dir + "/in.h5";
      const Tensor full = Tensor::zeros({5, 3}, DType::f32);
      if (comm->rank() == 0) io::write_dataset(input, "/u", full);
      comm->barrier();
      DeviceMesh mesh(comm, {comm->size()});
      const std::vector<Placement> shard0{Placement::shard(0)};

      std::string message =
          testing::agreed_error_of([&] { io::read_sharded(input, "/missing", mesh, shard0); });
      testing::expect_same_error_everywhere(*comm, message, "read_sharded of a missing dataset");
      EXPECT_NE(message.find("no object of that name"), std::string::npos) << message;

      message = testing::agreed_error_of(
          [&] { io::scatter(input, "/missing", mesh, shard0, {}, 0, 64); });
      testing::expect_same_error_everywhere(*comm, message, "scatter of a missing dataset");

      message = testing::agreed_error_of(
          [&] { io::scatter(dir + "/no_such_file.h5", "/u", mesh, shard0, {}, comm->size() - 1); });
      testing::expect_same_error_everywhere(*comm, message, "scatter of a missing file");
      EXPECT_NE(message.find("no such file"), std::string::npos) << message;

      message = testing::agreed_error_of(
          [&] { io::read_sharded(input, "/u", mesh, {Placement::partial(ReduceOp::sum)}); });
      testing::expect_same_error_everywhere(*comm, message, "read_sharded into a Partial layout");
      EXPECT_NE(message.find("Partial"), std::string::npos) << message;

      message = testing::agreed_error_of(
          [&] { io::read_sharded(input, "/u", mesh, {Placement::shard(2)}); });
      testing::expect_same_error_everywhere(*comm, message, "read_sharded with a bad layout");

      const ShardTensor sharded = io::read_sharded(input, "/u", mesh, shard0);
      message = testing::agreed_error_of(
          [&] { io::gather_write(sharded, dir + "/no_such_dir/out.h5", "/u", 0, 64); });
      testing::expect_same_error_everywhere(*comm, message,
                                            "gather_write into a missing directory");
      for (bool collective : {true, false}) {
        message = testing::agreed_error_of(
            [&] { io::write_sharded(sharded, dir + "/no_such_dir/out.h5", "/u", collective); });
        testing::expect_same_error_everywhere(*comm, message,
                                              "write_sharded into a missing directory");
      }
      // A file that is not HDF5 is never overwritten.
      if (comm->rank() == 0) {
        std::ofstream text(dir + "/notes.txt");
        text << "not HDF5\n";
      }
      comm->barrier();
      message =
          testing::agreed_error_of([&] { io::write_sharded(sharded, dir + "/notes.txt", "/u"); });
      testing::expect_same_error_everywhere(*comm, message, "write_sharded into a text file");
      EXPECT_NE(message.find("not HDF5"), std::string::npos) << message;
      if (comm->rank() == 0) {
        EXPECT_FALSE(has_temporary_file(dir));
      }
      testing::remove_test_dir(*comm, dir);
    });
  }
}

}  // namespace
}  // namespace tessera
