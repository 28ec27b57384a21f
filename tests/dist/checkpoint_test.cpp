// Distributed tests of sharded checkpoints (io/hdf5/checkpoint.hpp): a set of named tensors
// (several dtypes, uneven shards, a Partial(sum), a replicated one, a name with a '/') saved on a
// 2x2 mesh loads back bit for bit on the same mesh (saved layout), on a mesh of 4 (replicated)
// and on a 1x4 mesh with given extents; the attributes are in the file; a file that is not a
// checkpoint (or of another version) gives the same AgreedError on every rank; and a save killed
// mid-write (a forked child, local backend only) leaves the previous checkpoint intact.
// Built only with HDF5. Files live in a directory named from values every rank knows, created and
// removed by rank 0.
#include "io/hdf5/checkpoint.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include "core/agree.hpp"
#include "io/hdf5/h5_file.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/io_test_support.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

namespace fs = std::filesystem;

/// The full tensors of the checkpoint test, by name (sorted, as load_checkpoint returns them).
std::vector<std::pair<std::string, Tensor>> reference_tensors() {
  testing::CaseRng rng(20261123);
  return {{"a", testing::integer_tensor({7, 5}, DType::f32, rng, -1000, 1000)},
          {"fields/u", testing::integer_tensor({6, 3, 2}, DType::f64, rng, -1000, 1000)},
          {"p", testing::integer_tensor({3, 4}, DType::i64, rng, -1000, 1000)},
          {"r", testing::integer_tensor({5, 3}, DType::u8, rng, 0, 255)}};
}

/// Expects `loaded` to hold exactly the reference tensors, bit for bit.
void expect_reference(const std::vector<std::pair<std::string, ShardTensor>>& loaded,
                      const std::vector<std::pair<std::string, Tensor>>& reference,
                      const std::string& how) {
  ASSERT_EQ(loaded.size(), reference.size()) << how;
  for (size_t i = 0; i < loaded.size(); ++i) {
    EXPECT_EQ(loaded[i].first, reference[i].first) << how;
    const Tensor full = loaded[i].second.full_tensor();
    EXPECT_EQ(full.dtype(), reference[i].second.dtype()) << how << ": " << loaded[i].first;
    EXPECT_TRUE(bitwise_equal(full, reference[i].second)) << how << ": " << loaded[i].first;
  }
}

TEST(Checkpoint, SavesOnOneMeshAndLoadsOnOthersBitExact) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    const std::string dir = testing::make_test_dir(*comm, "checkpoint", "roundtrip");
    const std::string file = dir + "/ckpt.h5";
    const auto reference = reference_tensors();
    DeviceMesh mesh(comm, {2, 2}, {"dp", "tp"});
    const std::vector<std::vector<int64_t>> a_extents = {{2, 5}, {4, 1}};
    std::vector<std::pair<std::string, ShardTensor>> tensors;
    tensors.emplace_back(
        "a", ShardTensor::scatter(reference[0].second, mesh,
                                  {Placement::shard(0), Placement::shard(1)}, a_extents));
    tensors.emplace_back("fields/u",
                         ShardTensor::scatter(reference[1].second, mesh,
                                              {Placement::shard(0), Placement::replicate()}));
    tensors.emplace_back(
        "p", ShardTensor::scatter(reference[2].second, mesh,
                                  {Placement::partial(ReduceOp::sum), Placement::shard(1)}));
    tensors.emplace_back("r",
                         ShardTensor::scatter(reference[3].second, mesh,
                                              {Placement::replicate(), Placement::replicate()}));
    io::save_checkpoint(file, tensors, /*root=*/1, /*staging_bytes=*/64);

    if (comm->rank() == 0) {
      const io::DatasetInfo a = io::dataset_info(file, "/a");
      EXPECT_EQ(a.attributes.at("tessera_format_version"), "1");
      EXPECT_EQ(a.attributes.at("global_shape"), "7,5");
      EXPECT_EQ(a.attributes.at("dtype"), "f32");
      EXPECT_EQ(a.attributes.at("placements"), "S(0),S(1)");
      EXPECT_EQ(a.attributes.at("mesh_shape"), "2,2");
      EXPECT_EQ(a.attributes.at("mesh_dims"), "dp,tp");
      EXPECT_EQ(a.attributes.at("extents"), "2,5;4,1");
      const io::DatasetInfo p = io::dataset_info(file, "/p");
      EXPECT_EQ(p.attributes.at("placements"), "R,S(1)");
      EXPECT_EQ(p.attributes.at("extents"), ";2,2");
      EXPECT_EQ(io::dataset_info(file, "/fields/u").attributes.at("extents"), "3,3;");
      EXPECT_EQ(io::dataset_info(file, "/r").attributes.at("placements"), "R,R");
    }
    for (const auto& entry : fs::directory_iterator(dir))
      EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos);

    // Same mesh shape: the saved layouts.
    const auto same = io::load_checkpoint(file, mesh);
    expect_reference(same, reference, "2x2");
    if (same.size() == 4) {
      EXPECT_EQ(same[0].second.spec().extents, a_extents);
      EXPECT_EQ(same[2].second.placements(),
                (std::vector<Placement>{Placement::replicate(), Placement::shard(1)}));
    }
    // Another mesh shape: replicated.
    DeviceMesh flat(comm, {4});
    const auto replicated = io::load_checkpoint(file, flat);
    expect_reference(replicated, reference, "4");
    for (const auto& [name, tensor] : replicated)
      EXPECT_EQ(tensor.placements(), std::vector<Placement>{Placement::replicate()}) << name;
    // Given layouts (uneven, with an empty shard) on a 1x4 mesh.
    DeviceMesh row(comm, {1, 4});
    const std::map<std::string, io::CheckpointLayout> layouts = {
        {"a", {{Placement::replicate(), Placement::shard(0)}, {{}, {0, 1, 2, 4}}}},
        {"fields/u", {{Placement::shard(2), Placement::shard(0)}, {{2}, {3, 0, 2, 1}}}}};
    const auto given = io::load_checkpoint(file, row, layouts);
    expect_reference(given, reference, "1x4");
    if (given.size() == 4) {
      EXPECT_EQ(given[0].second.spec().extents[1], (std::vector<int64_t>{0, 1, 2, 4}));
      EXPECT_EQ(given[1].second.placements(),
                (std::vector<Placement>{Placement::shard(2), Placement::shard(0)}));
      EXPECT_EQ(given[3].second.placements(),
                (std::vector<Placement>{Placement::replicate(), Placement::replicate()}));
    }
    testing::remove_test_dir(*comm, dir);
  });
}

TEST(Checkpoint, RefusesAFileThatIsNotACheckpointOnEveryRank) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "checkpoint", "refuse");
      const std::string plain = dir + "/plain.h5";
      const std::string other_version = dir + "/v2.h5";
      if (comm->rank() == 0) {
        io::write_dataset(plain, "/u", Tensor::zeros({3}, DType::f32));
        io::write_dataset(other_version, "/u", Tensor::zeros({3}, DType::f32));
        io::write_attributes(other_version, "/u", {{"tessera_format_version", "2"}});
      }
      comm->barrier();
      DeviceMesh mesh(comm, {comm->size()});
      std::string message = testing::agreed_error_of([&] { io::load_checkpoint(plain, mesh); });
      testing::expect_same_error_everywhere(*comm, message, "plain file");
      EXPECT_NE(message.find("not a Tessera checkpoint"), std::string::npos) << message;
      message = testing::agreed_error_of([&] { io::load_checkpoint(other_version, mesh); });
      testing::expect_same_error_everywhere(*comm, message, "version 2");
      EXPECT_NE(message.find("found \"2\""), std::string::npos) << message;
      message = testing::agreed_error_of([&] { io::load_checkpoint(dir + "/missing.h5", mesh); });
      testing::expect_same_error_everywhere(*comm, message, "missing file");
      testing::remove_test_dir(*comm, dir);
    });
  }
}

TEST(Checkpoint, AKilledSaveLeavesThePreviousCheckpointIntact) {
  if (testing::mpi_backend()) GTEST_SKIP() << "fork() runs only under the local backend";
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    const std::string dir = testing::make_test_dir(*comm, "checkpoint", "crash");
    const std::string file = dir + "/ckpt.h5";
    DeviceMesh mesh(comm, {1});
    const auto reference = reference_tensors();
    std::vector<std::pair<std::string, ShardTensor>> tensors;
    for (const auto& [name, full] : reference)
      tensors.emplace_back(name, ShardTensor::distribute(full, mesh, {Placement::replicate()}));
    io::save_checkpoint(file, tensors);

    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // Checkpoint B: 8 tensors of 25 MB, written with a tiny staging budget.
      try {
        std::vector<std::pair<std::string, ShardTensor>> big;
        for (int i = 0; i < 8; ++i)
          big.emplace_back(fmt::format("b{}", i),
                           ShardTensor::distribute(Tensor::zeros({25 << 18}, DType::f32), mesh,
                                                   {Placement::replicate()}));
        io::save_checkpoint(file, big, 0, 64);
      } catch (...) {
      }
      ::_exit(0);
    }
    // Kill the child once its temporary file exists (mid-write), or after at most 5 s.
    const std::string temporary = fmt::format("{}.tmp-{}", file, static_cast<long>(child));
    for (int i = 0; i < 500 && !fs::exists(temporary); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status)) << "the child finished its save before it was killed";
    EXPECT_TRUE(fs::exists(temporary)) << "the child was not killed mid-write";

    expect_reference(io::load_checkpoint(file, mesh), reference, "after the killed save");
    testing::remove_test_dir(*comm, dir);
  });
}

}  // namespace
}  // namespace tessera
