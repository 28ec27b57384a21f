// `tessera generate gray-scott`: the sample data generator, a thin use of the Gray-Scott
// simulation (apps/sim/gray_scott.hpp, the scheme of docs/simulation.md): --snapshots S and
// --steps-between K run S - 1 times K steps and write /snapshots [S, 2 (u, v), n, n, n] f32
// (the initial state first; chunked per snapshot and species, gzip) with the parameters as
// attributes. data/gray_scott.h5 was made with the defaults.
#include "apps/sim/gray_scott.hpp"

#include <fmt/format.h>

#include <cstdint>

#include "apps/tessera/commands.hpp"
#include "apps/tessera/run_op_common.hpp"

namespace tessera::cli {

namespace {

struct GrayScottOptions {
  std::string out = "data/gray_scott.h5";
  int64_t size = 24;
  int64_t snapshots = 6;
  int64_t steps_between = 200;
  uint64_t seed = 7;
};

void generate(std::shared_ptr<Comm> world, const GrayScottOptions& o) {
  sim::GrayScottConfig config;
  config.size = {o.size, o.size, o.size};
  config.steps = (o.snapshots - 1) * o.steps_between;
  config.every = o.steps_between;
  config.seed = o.seed;
  config.dtype = DType::f32;
  try {
    sim::check_config(config);
  } catch (const Error& error) {
    throw AgreedError("generate", untagged(error));
  }
  const DeviceMesh mesh(world, {world->size()});
  sim::SimulateOptions run;
  run.out = o.out;
  run.gzip_level = 4;
  sim::simulate(mesh, {Placement::shard(0)}, {}, config, run);
  if (world->rank() == 0)
    fmt::print("wrote {}: snapshots [{}, 2, {}, {}, {}] f32\n", o.out, o.snapshots, o.size, o.size,
               o.size);
}

}  // namespace

void register_generate(CLI::App& app) {
  auto options = std::make_shared<GrayScottOptions>();
  auto* generate_command = app.add_subcommand("generate", "Generate sample data");
  generate_command->require_subcommand(1);
  auto* gray_scott =
      generate_command->add_subcommand("gray-scott", "3-d Gray-Scott reaction-diffusion snapshots");
  gray_scott->add_option("--out", options->out, "Output HDF5 file")->capture_default_str();
  gray_scott->add_option("--size", options->size, "Grid extent per dim")
      ->check(CLI::Range(int64_t{3}, int64_t{4096}))
      ->capture_default_str();
  gray_scott->add_option("--snapshots", options->snapshots, "Snapshots")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  gray_scott->add_option("--steps-between", options->steps_between, "Time steps between snapshots")
      ->check(integer_at_least(1))
      ->capture_default_str();
  gray_scott->add_option("--seed", options->seed, "Seed of the initial cubes")
      ->check(integer_at_least(0))
      ->capture_default_str();
  gray_scott->callback([options] {
    launch(backend_from_env(), 1, [&](std::shared_ptr<Comm> world) { generate(world, *options); });
  });
}

}  // namespace tessera::cli
