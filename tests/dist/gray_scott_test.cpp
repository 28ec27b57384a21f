// The Gray-Scott simulation (apps/sim/gray_scott.hpp): sharded runs equal the one-rank run bit
// for bit on every mesh factorization of 1..4 ranks with uneven (1-wide and empty) shards, f32
// and f64; the run equals an independent NumPy implementation (tests/fixtures/gray_scott) within
// 1e-12 in f64; snapshots are written by every rank into RUN.h5; a restart from a cut-off run
// equals the uninterrupted run, also on another mesh; a restart with other options is refused.
#include "apps/sim/gray_scott.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/hdf5/h5_file.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/io_test_support.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;

/// True when `a` and `b` hold the same bits (same shape and dtype).
bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return x.nbytes() == 0 || std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

/// Collective: the one-rank run of `config` for `steps` steps, computed by every rank alone (on
/// a communicator of itself): u and v of the whole grid.
std::array<Tensor, 2> one_rank_fields(Comm& world, const sim::GrayScottConfig& config,
                                      int64_t steps) {
  const DeviceMesh solo(world.split(world.rank(), 0), {1});
  sim::GrayScott reference(solo, {Placement::replicate()}, {}, config);
  for (int64_t s = 0; s < steps; ++s) reference.step();
  return {reference.field(0).to_local(), reference.field(1).to_local()};
}

/// Distinct grid dims for the mesh dims of a `mesh_ndim`-d mesh, rotated by `variant`.
std::vector<int> shard_dims_of(int mesh_ndim, int variant) {
  std::vector<int> dims;
  for (int m = 0; m < mesh_ndim; ++m) dims.push_back((m + variant) % 3);
  return dims;
}

TEST(GrayScott, ShardedEqualsOneRankBitForBit) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [&](std::shared_ptr<Comm> world) {
      for (DType dtype : {DType::f32, DType::f64}) {
        sim::GrayScottConfig config;
        config.size = {7, 6, 5};
        config.dtype = dtype;
        config.seed = 3;
        constexpr int64_t kSteps = 5;
        const std::array<Tensor, 2> expected = one_rank_fields(*world, config, kSteps);
        int mesh_index = 0;
        for (const std::vector<int>& mesh_shape : testing::mesh_factorizations(world_size)) {
          const DeviceMesh mesh(world, mesh_shape);
          for (int variant = 0; variant < 3; ++variant) {
            CaseRng rng(testing::case_seed(41, world_size, mesh_index, variant));
            const std::vector<int> dims = shard_dims_of(mesh.ndim(), variant);
            std::vector<Placement> placements;
            std::vector<std::vector<int64_t>> extents;
            for (int m = 0; m < mesh.ndim(); ++m) {
              placements.push_back(Placement::shard(dims[m]));
              // Variant 0: balanced; 1: uneven with 1-wide shards; 2: uneven with empty ones.
              const int64_t extent = config.size[dims[m]];
              std::vector<int64_t> split = testing::random_extents(extent, mesh_shape[m], rng);
              if (variant == 0) split = default_split(extent, mesh_shape[m]);
              if (variant == 1) {
                split.assign(mesh_shape[m], 1);
                split.back() = extent - (mesh_shape[m] - 1);
              }
              extents.push_back(split);
            }
            sim::GrayScott sharded(mesh, placements, extents, config);
            for (int64_t s = 0; s < kSteps; ++s) sharded.step();
            const Box box = sharded.spec().local_box(mesh.coord());
            for (int species = 0; species < 2; ++species)
              EXPECT_TRUE(
                  same_bits(sharded.field(species).to_local(), expected[species].view_box(box)))
                  << "species " << species << " " << dtype_name(dtype) << " on "
                  << sharded.spec().str() << " rank " << world->rank();
          }
          ++mesh_index;
        }
      }
    });
  }
}

TEST(GrayScott, EqualsNumpyFixture) {
  const std::string dir = std::string(TESSERA_FIXTURE_DIR) + "/gray_scott";
  const nlohmann::json fixture = nlohmann::json::parse(std::ifstream(dir + "/case.json"));
  sim::GrayScottConfig config;
  config.size = fixture["size"].get<Shape>();
  config.steps = fixture["steps"];
  config.every = fixture["every"];
  config.seed = fixture["seed"];
  config.dtype = DType::f64;
  config.params = {fixture["du"], fixture["dv"], fixture["feed"], fixture["kill"], fixture["dt"]};
  const Shape shape = fixture["shape"].get<Shape>();
  Tensor expected = Tensor::empty(shape, DType::f64);
  std::ifstream(dir + "/snapshots.bin", std::ios::binary)
      .read(static_cast<char*>(expected.raw_data()),
            static_cast<std::streamsize>(expected.nbytes()));
  ASSERT_EQ(shape[0], config.snapshots());
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [&](std::shared_ptr<Comm> world) {
      const DeviceMesh mesh(world, {world_size});
      sim::GrayScott sharded(mesh, {Placement::shard(world_size % 3)}, {}, config);
      for (int64_t t = 0; t < config.snapshots(); ++t) {
        if (t > 0)
          for (int64_t s = 0; s < config.every; ++s) sharded.step();
        const Box box = sharded.spec().local_box(mesh.coord());
        for (int species = 0; species < 2; ++species) {
          Box at{{t, species}, {t + 1, species + 1}};
          at.lo.insert(at.lo.end(), box.lo.begin(), box.lo.end());
          at.hi.insert(at.hi.end(), box.hi.begin(), box.hi.end());
          EXPECT_LE(max_abs_diff(sharded.field(species).to_local(),
                                 expected.view_box(at).reshape(box.shape())),
                    1e-12)
              << "snapshot " << t << " species " << species << " rank " << world->rank();
        }
      }
    });
  }
}

/// Snapshot `t` of RUN.h5, read whole by the calling rank.
Tensor read_snapshots(const std::string& file) {
  return io::read_dataset(file, "snapshots");
}

TEST(GrayScott, WritesEverySnapshotAndRestartEqualsUninterrupted) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    testing::run_world(world_size, [&](std::shared_ptr<Comm> world) {
      const std::string dir = testing::make_test_dir(*world, "GrayScott", "Restart");
      sim::GrayScottConfig config;
      config.size = {8, 5, 6};
      config.steps = 9;
      config.every = 2;  // T = 5: steps 0, 2, 4, 6, 8; the 9th step is not run
      config.dtype = DType::f64;
      const DeviceMesh mesh(world, {world_size});
      const std::string whole = dir + "/whole.h5", cut = dir + "/cut.h5";
      sim::SimulateOptions options;
      options.out = whole;
      const sim::SimulateReport report =
          sim::simulate(mesh, {Placement::shard(0)}, {}, config, options);
      EXPECT_EQ(report.steps_run, 8);
      EXPECT_EQ(report.snapshots_written, 5);
      // Every snapshot equals the one-rank run at its step.
      const Tensor written = read_snapshots(whole);
      for (int64_t t = 0; t < config.snapshots(); ++t) {
        const std::array<Tensor, 2> expected = one_rank_fields(*world, config, t * config.every);
        for (int species = 0; species < 2; ++species)
          EXPECT_TRUE(
              same_bits(written.view_box({{t, species, 0, 0, 0}, {t + 1, species + 1, 8, 5, 6}})
                            .reshape({8, 5, 6}),
                        expected[species]))
              << "snapshot " << t << " species " << species;
      }
      // A run cut off after 2 snapshots (the rest zero, `written` = 2), restarted on another mesh.
      options.out = cut;
      sim::simulate(mesh, {Placement::shard(0)}, {}, config, options);
      if (world->rank() == 0) {
        io::write_hyperslab(cut, "snapshots", {{2, 0, 0, 0, 0}, {5, 2, 8, 5, 6}},
                            Tensor::zeros({3, 2, 8, 5, 6}, DType::f64));
        io::write_attributes(cut, "snapshots", {{"written", "2"}});
      }
      world->barrier();
      options.restart = true;
      const sim::SimulateReport resumed =
          sim::simulate(DeviceMesh(world, {1, world_size}),
                        {Placement::replicate(), Placement::shard(2)}, {}, config, options);
      EXPECT_EQ(resumed.first_step, 2);
      EXPECT_EQ(resumed.steps_run, 6);
      EXPECT_TRUE(same_bits(read_snapshots(cut), written));
      EXPECT_EQ(io::dataset_info(cut, "snapshots").attributes.at("written"), "5");
      // Other options than the file's: refused on every rank, naming the parameter.
      sim::GrayScottConfig other = config;
      other.params.du = 0.2;
      const std::string message = testing::agreed_error_of(
          [&] { sim::simulate(mesh, {Placement::shard(0)}, {}, other, options); });
      EXPECT_NE(message.find("Du = 0.16, the options say 0.2"), std::string::npos) << message;
      testing::remove_test_dir(*world, dir);
    });
  }
}

TEST(GrayScott, InitialCubesFollowTheStream) {
  // The first draws of the stream for seed 0: state 1 -> xorshift64 (13, 7, 17).
  uint64_t state = 1;
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  const sim::InitialCubes cubes = sim::initial_cubes({1000, 1000, 1000}, 0);
  EXPECT_EQ(cubes.centres[0][0], static_cast<int64_t>(state % 1000));
  EXPECT_EQ(cubes.half, 100);
  EXPECT_EQ(sim::initial_cubes({3, 40, 50}, 5).half, 1);
}

}  // namespace
}  // namespace tessera
