// `tessera generate gray-scott`: the sample data generator. A 3-d Gray-Scott reaction-diffusion
// simulation (two species u, v on a periodic grid, explicit Euler, 7-point Laplacian):
//   du/dt = Du lap(u) - u v^2 + F (1 - u),   dv/dt = Dv lap(v) + u v^2 - (F + k) v
// started from u = 1, v = 0 with a few seeded cubes of v = 0.25 (u = 0.5), and written as
// snapshots [samples, 2 (u, v), X, Y, Z] f32 (chunked per snapshot, gzip) with the parameters as
// attributes. data/gray_scott.h5 was made with the defaults.
#include <fmt/format.h>

#include <cstdint>
#include <vector>

#include "apps/tessera/commands.hpp"
#include "core/tensor.hpp"
#include "io/hdf5/h5_file.hpp"

namespace tessera::cli {

namespace {

struct GrayScottOptions {
  std::string out = "data/gray_scott.h5";
  int64_t size = 24;
  int64_t snapshots = 6;
  int64_t steps_between = 200;
  double du = 0.16, dv = 0.08, feed = 0.035, kill = 0.065, dt = 1.0;
  uint64_t seed = 7;
};

void generate(const GrayScottOptions& o) {
  const int64_t n = o.size, cells = n * n * n;
  check_arg(n >= 4 && o.snapshots >= 1 && o.steps_between >= 1, "generate",
            "size {} (>= 4), snapshots {} and steps between {} (>= 1)", n, o.snapshots,
            o.steps_between);
  std::vector<float> u(cells, 1.0f), v(cells, 0.0f), u_next(cells), v_next(cells);
  auto at = [n](int64_t x, int64_t y, int64_t z) {
    return ((x + n) % n * n + (y + n) % n) * n + (z + n) % n;
  };
  uint64_t state = o.seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&state](int64_t range) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<int64_t>(state % static_cast<uint64_t>(range));
  };
  for (int seed = 0; seed < 6; ++seed) {  // cubes of v where the pattern starts
    const int64_t cx = next(n), cy = next(n), cz = next(n), half = std::max<int64_t>(1, n / 10);
    for (int64_t x = -half; x <= half; ++x)
      for (int64_t y = -half; y <= half; ++y)
        for (int64_t z = -half; z <= half; ++z) {
          u[at(cx + x, cy + y, cz + z)] = 0.5f;
          v[at(cx + x, cy + y, cz + z)] = 0.25f;
        }
  }
  Tensor snapshots = Tensor::empty({o.snapshots, 2, n, n, n}, DType::f32);
  for (int64_t s = 0; s < o.snapshots; ++s) {
    for (int64_t step = 0; step < o.steps_between; ++step) {
      for (int64_t x = 0; x < n; ++x)
        for (int64_t y = 0; y < n; ++y)
          for (int64_t z = 0; z < n; ++z) {
            const int64_t c = at(x, y, z);
            const float lap_u = u[at(x - 1, y, z)] + u[at(x + 1, y, z)] + u[at(x, y - 1, z)] +
                                u[at(x, y + 1, z)] + u[at(x, y, z - 1)] + u[at(x, y, z + 1)] -
                                6 * u[c];
            const float lap_v = v[at(x - 1, y, z)] + v[at(x + 1, y, z)] + v[at(x, y - 1, z)] +
                                v[at(x, y + 1, z)] + v[at(x, y, z - 1)] + v[at(x, y, z + 1)] -
                                6 * v[c];
            const float reaction = u[c] * v[c] * v[c];
            u_next[c] =
                u[c] + static_cast<float>(o.dt * (o.du * lap_u - reaction + o.feed * (1 - u[c])));
            v_next[c] = v[c] + static_cast<float>(
                                   o.dt * (o.dv * lap_v + reaction - (o.feed + o.kill) * v[c]));
          }
      u.swap(u_next);
      v.swap(v_next);
    }
    float* out = snapshots.data<float>() + s * 2 * cells;
    std::copy(u.begin(), u.end(), out);
    std::copy(v.begin(), v.end(), out + cells);
  }
  io::WriteOptions options;
  options.truncate_file = true;
  options.chunks = Shape{1, 2, n, n, n};
  options.gzip_level = 4;
  io::write_dataset(o.out, "snapshots", snapshots, options);
  io::write_attributes(o.out, "snapshots",
                       {{"model", "gray-scott 3-d, periodic, explicit Euler, 7-point Laplacian"},
                        {"layout", "[sample, species (u, v), x, y, z]"},
                        {"Du", fmt::format("{}", o.du)},
                        {"Dv", fmt::format("{}", o.dv)},
                        {"F", fmt::format("{}", o.feed)},
                        {"k", fmt::format("{}", o.kill)},
                        {"dt", fmt::format("{}", o.dt)},
                        {"steps_between_snapshots", fmt::format("{}", o.steps_between)},
                        {"generator", "tessera generate gray-scott"}});
  fmt::print("wrote {}: snapshots [{}, 2, {}, {}, {}] f32\n", o.out, o.snapshots, n, n, n);
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
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  gray_scott->add_option("--snapshots", options->snapshots, "Snapshots")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  gray_scott->add_option("--steps-between", options->steps_between, "Time steps between snapshots")
      ->check(integer_at_least(0))
      ->capture_default_str();
  gray_scott->add_option("--seed", options->seed, "Seed of the initial cubes")
      ->check(integer_at_least(0))
      ->capture_default_str();
  gray_scott->callback([options] { generate(*options); });
}

}  // namespace tessera::cli
