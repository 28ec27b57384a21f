// `tessera demo`: the main job. Scatters a generated 3-d field from rank 0 over a 2x2 mesh with
// uneven extents, moves it through several layouts (uneven, balanced, replicated, partial),
// gathers it back, and verifies it bit for bit against the original, printing each layout and
// its time. Runs on local ranks (threads) by default, or on the MPI world under mpiexec.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <mutex>

#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/tessera.hpp"

namespace tessera::cli {

namespace {

struct DemoOptions {
  std::string shape = "48,40,36";
  int ranks = 4;
};

/// A smooth field with fine detail, so any misplaced element changes the bits.
Tensor generate_field(const Shape& shape) {
  Tensor field = Tensor::empty(shape, DType::f32);
  float* values = field.data<float>();
  int64_t flat = 0;
  for (int64_t x = 0; x < shape[0]; ++x)
    for (int64_t y = 0; y < shape[1]; ++y)
      for (int64_t z = 0; z < shape[2]; ++z, ++flat)
        values[flat] = static_cast<float>(std::sin(0.11 * x) * std::cos(0.07 * y) + 0.013 * z +
                                          1e-4 * static_cast<double>(flat % 97));
  return field;
}

/// Uneven extents: the first rank of a dim gets about a third more than the others.
std::vector<int64_t> uneven_split(int64_t n, int parts) {
  std::vector<int64_t> extents = default_split(n, parts);
  if (parts > 1) {
    const int64_t moved = std::min(extents.back(), n / (3 * parts));
    extents.front() += moved;
    extents.back() -= moved;
  }
  return extents;
}

void run_demo(std::shared_ptr<Comm> world, const Shape& shape) {
  if (world->size() != 4)  // the same on every rank, so every rank raises it
    throw AgreedError(
        "demo", fmt::format("the demo runs on a 2x2 mesh, i.e. 4 ranks; got {}", world->size()));
  DeviceMesh mesh(world, {2, 2}, {"x", "y"});
  const bool root = world->rank() == 0;
  const Tensor original = root ? generate_field(shape) : Tensor();
  if (root) {
    fmt::print("tessera demo: field {} f32 ({:.1f} MiB) on a 2x2 mesh (x, y), {} backend\n", shape,
               shape_numel(shape) * 4.0 / (1 << 20), world->backend());
    fmt::print("  {:<34} {:<62} {:>10}\n", "step", "layout", "time (ms)");
  }
  auto report = [&](const std::string& step, const ShardTensor& tensor, double seconds) {
    // The slowest rank's time is the step's time.
    double slowest = seconds;
    world->all_reduce(&slowest, &slowest, 1, DType::f64, ReduceOp::max);
    if (root) fmt::print("  {:<34} {:<62} {:>10.3f}\n", step, tensor.spec().str(), slowest * 1e3);
  };
  auto timed = [&](auto&& step) {
    world->barrier();
    const double start = now_seconds();
    ShardTensor result = step();
    return std::make_pair(std::move(result), now_seconds() - start);
  };

  const std::vector<std::vector<int64_t>> uneven{uneven_split(shape[0], 2),
                                                 uneven_split(shape[1], 2)};
  auto [a, t0] = timed([&] {
    return ShardTensor::scatter(original, mesh, {Placement::shard(0), Placement::shard(1)}, uneven,
                                0);
  });
  report("scatter from rank 0 (uneven)", a, t0);
  auto [b, t1] = timed([&] { return a.redistribute({Placement::shard(1), Placement::shard(2)}); });
  report("S(0),S(1) -> S(1),S(2) balanced", b, t1);
  auto [c, t2] = timed([&] {
    return b.redistribute({Placement::replicate(), Placement::shard(0)}, {{}, {5, shape[0] - 5}});
  });
  report("-> R,S(0) very uneven", c, t2);
  auto [d, t3] = timed([&] {
    return c.redistribute({Placement::partial(ReduceOp::sum), Placement::shard(2)});
  });
  report("-> P(sum),S(2)", d, t3);
  auto [e, t4] = timed([&] {
    return d.redistribute({Placement::shard(0), Placement::replicate()});
  });
  report("reduce -> S(0),R", e, t4);
  auto [f, t5] = timed([&] {
    return e.redistribute({Placement::shard(0), Placement::shard(1)}, uneven);
  });
  report("-> S(0),S(1) original uneven", f, t5);

  world->barrier();
  const double start = now_seconds();
  const Tensor gathered = f.gather(0);
  const double gather_time = now_seconds() - start;
  int32_t ok = root ? static_cast<int32_t>(bitwise_equal(gathered, original)) : 1;
  world->all_reduce(&ok, &ok, 1, DType::i32, ReduceOp::min);
  if (root) {
    fmt::print("  {:<34} {:<62} {:>10.3f}\n", "gather to rank 0", "full tensor", gather_time * 1e3);
    fmt::print("verified bit-for-bit against the original: {}\n", ok ? "yes" : "NO");
  }
  if (!ok) throw Error("demo", "the gathered field differs from the original");
}

}  // namespace

void register_demo(CLI::App& app) {
  auto options = std::make_shared<DemoOptions>();
  auto* command = app.add_subcommand(
      "demo",
      "Scatter a 3-d field over a 2x2 mesh, redistribute it through several layouts, "
      "gather it back and verify it");
  command->add_option("--shape", options->shape, "Global field shape x,y,z")->capture_default_str();
  command->add_option("--ranks", options->ranks, "Local ranks (threads) without mpiexec")
      ->capture_default_str();
  command->callback([options] {
    const Shape shape = parse_list(options->shape);
    check_arg(shape.size() == 3, "demo", "--shape needs 3 extents, got '{}'", options->shape);
    launch(backend_from_env(), options->ranks,
           [&](std::shared_ptr<Comm> world) { run_demo(world, shape); });
  });
}

}  // namespace tessera::cli
