// `tessera demo`: the main job, on a 2x2 mesh with uneven extents (local ranks by default, or the
// MPI world under mpiexec).
//  1. Layouts: a generated 3-d field is scattered from rank 0, moved through several layouts
//     (uneven, balanced, replicated, partial), gathered back and verified bit for bit.
//  2. A sharded conv network (conv3d, gelu, conv3d, mse loss) takes one forward/backward step on
//     the sample data (a Gray-Scott snapshot and the next one as the target; generated fields
//     when the file is not readable); loss and every gradient are checked against one rank.
//  3. Neighborhood attention: a 2-d NA (7x7 window, dilation (1, 2), relative positional bias)
//     on q, k, v sharded over both spatial axes with uneven extents, forward and backward,
//     checked against one rank.
//  4. Training: a conv3d net learns to step the Gray-Scott fields (snapshot t -> t + 1) with
//     AdamW for 30 steps on dp=2 x domain 2 (batch of 2 over "dp", x over "x", uneven), the
//     gradients reduced by the bucketed data-parallel reducer; the loss of every step and the
//     final weights are checked against the same run on one rank.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <mutex>
#include <tuple>

#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "core/checked_math.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/host_allocator.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/tessera.hpp"
#include "core/trace.hpp"
#include "io/hdf5/h5_file.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/layers.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"

namespace tessera::cli {

namespace {

/// Prints max |sharded - one rank| for every named result; true when all are below `tolerance`
/// (and `worst` so far is too).
bool report_differences(const std::vector<std::string>& names, const std::vector<Tensor>& sharded,
                        const std::vector<Tensor>& reference, double tolerance, double worst = 0) {
  for (size_t i = 0; i < sharded.size(); ++i) {
    const double diff = max_abs_diff(sharded[i], reference[i]);
    worst = std::max(worst, diff);
    fmt::print("  max |sharded - one rank| {:<4} {:.2g}\n", names[i], diff);
  }
  return worst < tolerance;
}

/// The smallest extent per dim of --shape the demo's steps work with.
constexpr int64_t kMinDemoExtent = 5;

struct DemoOptions {
  std::string shape = "48,40,36";
  int ranks = 4;
  std::string data = TESSERA_SAMPLE_DATA;  // data/gray_scott.h5 of the source tree
  std::string device = "cpu";
};

/// The calling rank's device.
Device rank_device() {
  return current_rank_context().device();
}

/// Seconds now, after the rank's queued device work is done (device steps are asynchronous).
double settled_seconds() {
  synchronize(current_rank_context().compute());
  return now_seconds();
}

/// True when the demo runs in estimate mode (docs/scaling.md): every tensor is shape-only, so
/// the demo posts the same messages but computes, checks and prints no values.
bool without_data() {
  return estimate::active();
}

/// A smooth field with fine detail, so any misplaced element changes the bits.
Tensor generate_field(const Shape& shape) {
  Tensor field = Tensor::empty(shape, DType::f32);
  if (without_data()) return field;
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

void run_layout_tour(std::shared_ptr<Comm> world, const Shape& shape) {
  if (world->size() != 4)  // the same on every rank, so every rank raises it
    throw AgreedError(
        "demo", fmt::format("the demo runs on a 2x2 mesh, i.e. 4 ranks; got {}", world->size()));
  DeviceMesh mesh(world, {2, 2}, {"x", "y"});
  const bool root = world->rank() == 0;
  const Tensor original = root ? generate_field(shape) : Tensor();
  if (root) {
    fmt::print(
        "tessera demo: field {} f32 ({:.1f} MiB) on a 2x2 mesh (x, y), {} backend, pieces on {}\n",
        shape, shape_numel(shape) * 4.0 / (1 << 20), world->backend(), rank_device().str());
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
    const double start = settled_seconds();
    ShardTensor result = step();
    return std::make_pair(std::move(result), settled_seconds() - start);
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
  const double start = settled_seconds();
  const Tensor gathered = f.gather(0);
  const double gather_time = settled_seconds() - start;
  int32_t ok =
      root && !without_data() ? static_cast<int32_t>(bitwise_equal(gathered, original)) : 1;
  world->all_reduce(&ok, &ok, 1, DType::i32, ReduceOp::min);
  if (root) {
    fmt::print("  {:<34} {:<62} {:>10.3f}\n", "gather to rank 0", "full tensor", gather_time * 1e3);
    fmt::print("verified bit-for-bit against the original: {}\n",
               without_data() ? "not checked (recorded without data)"
               : ok           ? "yes"
                              : "NO");
  }
  if (!ok) throw Error("demo", "the gathered field differs from the original");
}

/// Deterministic pseudo-random values in [-scale, scale] (the same on every rank).
Tensor generated(const Shape& shape, uint64_t seed, double scale) {
  Tensor values = Tensor::empty(shape, DType::f32);
  if (without_data()) return values;
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < values.numel(); ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    values.data<float>()[i] = static_cast<float>(scale * ((state >> 11) * 0x1.0p-53 * 2 - 1));
  }
  return values;
}

struct StepResult {
  double loss = 0;
  std::vector<Tensor> grads;  // x, w1, b1, w2, b2 (full tensors)
  double forward_seconds = 0, backward_seconds = 0;
};

/// One forward/backward step of conv3d -> gelu -> conv3d -> mse on `mesh` (x sharded as given).
StepResult conv_network_step(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                             const std::vector<std::vector<int64_t>>& extents,
                             const std::vector<Tensor>& data) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  ops::ConvOptions same;
  same.padding_name = "same";
  Tape tape;
  mesh.comm().barrier();
  double start = settled_seconds();
  ShardTensor x = ShardTensor::distribute(data[0], mesh, placements, extents);
  ShardTensor target = ShardTensor::distribute(data[5], mesh, placements, extents);
  std::vector<ShardTensor> params;
  for (size_t i = 1; i <= 4; ++i)
    params.push_back(ShardTensor::distribute(data[i], mesh, replicated));
  x.set_requires_grad();
  for (ShardTensor& param : params) param.set_requires_grad();
  const ShardTensor hidden = ops::gelu(ops::conv(x, params[0], params[1], same));
  const ShardTensor loss = ops::mse_loss(ops::conv(hidden, params[2], params[3], same), target);
  const Tensor loss_value = loss.full_tensor().to(Device::cpu());
  StepResult result;
  result.forward_seconds = settled_seconds() - start;
  mesh.comm().barrier();
  start = settled_seconds();
  tape.backward(loss);
  result.grads.push_back(tape.grad(x)->full_tensor());
  for (const ShardTensor& param : params) result.grads.push_back(tape.grad(param)->full_tensor());
  result.backward_seconds = settled_seconds() - start;
  result.loss = without_data() ? std::nan("") : loss_value.item_as_double({});
  for (double* seconds : {&result.forward_seconds, &result.backward_seconds})
    mesh.comm().all_reduce(seconds, seconds, 1, DType::f64, ReduceOp::max);
  return result;
}

/// Snapshots [first, first + count) of the sample data (Gray-Scott u, v fields) as inputs and
/// the snapshots one later as targets, from one read of [first, first + count], or nullopt when
/// the file cannot be read (no HDF5 in this build, or no file).
std::optional<std::pair<Tensor, Tensor>> read_snapshots(const std::string& file, int64_t first,
                                                        int64_t count = 1) {
  try {
    const Shape shape = io::dataset_info(file, "snapshots").shape;
    if (shape.size() != 5 || shape[0] < first + count + 1) return std::nullopt;
    Box box = Box::of_shape(shape);
    box.lo[0] = first;
    box.hi[0] = first + count + 1;
    const Tensor run = io::read_hyperslab(file, "snapshots", box, DType::f32);
    return std::make_pair(run.slice(0, 0, count).contiguous(),
                          run.slice(0, 1, count + 1).contiguous());
  } catch (const Error&) {
    return std::nullopt;
  }
}

void run_conv_network(std::shared_ptr<Comm> world, Shape field, const std::string& data_file) {
  DeviceMesh mesh(world, {2, 2}, {"x", "y"});
  // Input: a Gray-Scott snapshot and, as the target, the next one (learning one time step).
  const auto snapshots = read_snapshots(data_file, 2);
  const int64_t channels = snapshots ? snapshots->first.shape(1) : 4, hidden = 8;
  if (snapshots)
    field = {snapshots->first.shape(2), snapshots->first.shape(3), snapshots->first.shape(4)};
  const Shape x_shape{1, channels, field[0], field[1], field[2]};
  std::vector<Tensor> data{snapshots ? snapshots->first : generated(x_shape, 1, 1.0),
                           generated({hidden, channels, 3, 3, 3}, 2, 0.2),
                           generated({hidden}, 3, 0.1),
                           generated({channels, hidden, 3, 3, 3}, 4, 0.2),
                           generated({channels}, 5, 0.1),
                           snapshots ? snapshots->second : generated(x_shape, 6, 0.5)};
  for (Tensor& tensor : data) tensor = tensor.to(rank_device());
  const std::vector<std::vector<int64_t>> extents{uneven_split(field[0], 2),
                                                  uneven_split(field[1], 2)};
  // Each step runs twice; the second is timed (the first creates oneDNN primitives and plans).
  conv_network_step(mesh, {Placement::shard(2), Placement::shard(3)}, extents, data);
  const StepResult sharded =
      conv_network_step(mesh, {Placement::shard(2), Placement::shard(3)}, extents, data);
  // The same step on one rank: rank 0 alone, on a mesh of itself.
  auto self = world->split(world->rank() == 0 ? 0 : -1, 0);
  if (world->rank() != 0) return;
  DeviceMesh single(self, {1, 1}, {"x", "y"});
  conv_network_step(single, {Placement::replicate(), Placement::replicate()}, {}, data);
  const StepResult reference =
      conv_network_step(single, {Placement::replicate(), Placement::replicate()}, {}, data);
  if (without_data()) {
    fmt::print(
        "\nconv network step: x [1, {}, {}] sharded over 2x2 and on one rank, recorded "
        "without data\n",
        channels, fmt::join(field, ", "));
    return;
  }
  fmt::print(
      "\nconv network step: conv3d({0}->8, k3) -> gelu -> conv3d(8->{0}, k3) -> mse, x [1, {0}, "
      "{1}] f32 on {2}\n",
      channels, fmt::join(field, ", "), rank_device().str());
  fmt::print("  input: {}\n",
             snapshots ? fmt::format("{} snapshots 2 -> 3 (u, v of a Gray-Scott run)", data_file)
                       : std::string("generated (sample data not readable)"));
  fmt::print("  sharded over 2x2 (extents {} x {}): forward {:.1f} ms, backward {:.1f} ms\n",
             extents[0], extents[1], sharded.forward_seconds * 1e3, sharded.backward_seconds * 1e3);
  fmt::print("  one rank:                          forward {:.1f} ms, backward {:.1f} ms\n",
             reference.forward_seconds * 1e3, reference.backward_seconds * 1e3);
  fmt::print("  loss {:.8f} (one rank {:.8f}), |difference| {:.2g}\n", sharded.loss, reference.loss,
             std::fabs(sharded.loss - reference.loss));
  const double loss_diff = std::fabs(sharded.loss - reference.loss);
  const bool ok = report_differences({"dx", "dw1", "db1", "dw2", "db2"}, sharded.grads,
                                     reference.grads, 1e-4, loss_diff) &&
                  loss_diff < 1e-4;
  fmt::print("sharded step matches the one-rank step (f32, tolerance 1e-4): {}\n",
             ok ? "yes" : "NO");
  if (!ok) throw Error("demo", "the sharded conv network step differs from the one-rank step");
}

struct NaStep {
  std::vector<Tensor> results;  // o, lse, dq, dk, dv, d rpb (full tensors)
  double seconds = 0;
};

/// One forward/backward pass of 2-d neighborhood attention on `mesh` (q, k, v laid out as given).
NaStep na_step(const DeviceMesh& mesh, const std::vector<Placement>& placements,
               const std::vector<std::vector<int64_t>>& extents, const std::vector<Tensor>& data) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  mesh.comm().barrier();
  const double start = settled_seconds();
  Tape tape;
  std::vector<ShardTensor> qkv;
  for (size_t i = 0; i < 3; ++i)
    qkv.push_back(ShardTensor::distribute(data[i], mesh, placements, extents).set_requires_grad());
  ops::NaOptions options;
  options.kernel_size = {7, 7};
  options.dilation = {1, 2};
  options.rpb = ShardTensor::distribute(data[3], mesh, replicated).set_requires_grad();
  const ops::NaResult result = ops::neighborhood_attention(qkv[0], qkv[1], qkv[2], options);
  const ShardTensor go = ShardTensor::distribute(data[4], mesh, result.output.placements(),
                                                 result.output.spec().extents);
  tape.backward(ops::sum(ops::mul(result.output, go)));
  NaStep step;
  step.results = {result.output.full_tensor(), result.lse.full_tensor()};
  for (const ShardTensor& input : qkv) step.results.push_back(tape.grad(input)->full_tensor());
  step.results.push_back(tape.grad(*options.rpb)->full_tensor());
  step.seconds = settled_seconds() - start;
  mesh.comm().all_reduce(&step.seconds, &step.seconds, 1, DType::f64, ReduceOp::max);
  return step;
}

void run_neighborhood_attention(std::shared_ptr<Comm> world) {
  DeviceMesh mesh(world, {2, 2}, {"x", "y"});
  const Shape shape{1, 30, 26, 2, 8};  // [B, X, Y, heads, D]
  std::vector<Tensor> data{generated(shape, 11, 1.0), generated(shape, 12, 1.0),
                           generated(shape, 13, 1.0), generated({2, 13, 13}, 14, 0.5),
                           generated(shape, 15, 1.0)};
  // The op has cpu and cuda kernels, so this part runs on the rank's device.
  const Device device = rank_device();
  for (Tensor& tensor : data) tensor = tensor.to(device);
  const std::vector<std::vector<int64_t>> extents{uneven_split(shape[1], 2),
                                                  uneven_split(shape[2], 2)};
  const NaStep sharded = na_step(mesh, {Placement::shard(1), Placement::shard(2)}, extents, data);
  auto self = world->split(world->rank() == 0 ? 0 : -1, 0);
  if (world->rank() != 0) return;
  DeviceMesh single(self, {1, 1}, {"x", "y"});
  const NaStep reference =
      na_step(single, {Placement::replicate(), Placement::replicate()}, {}, data);
  if (without_data()) {
    fmt::print(
        "\nneighborhood attention 2-d: q, k, v {} sharded over 2x2 and on one rank, recorded "
        "without data\n",
        shape);
    return;
  }
  fmt::print(
      "\nneighborhood attention 2-d: q, k, v {} f32, window 7x7, dilation (1, 2), with rpb, on "
      "{}\n",
      shape, device.str());
  fmt::print("  sharded over 2x2 (extents {} x {}): forward + backward {:.1f} ms\n", extents[0],
             extents[1], sharded.seconds * 1e3);
  fmt::print("  one rank:                          forward + backward {:.1f} ms\n",
             reference.seconds * 1e3);
  const bool ok = report_differences({"o", "lse", "dq", "dk", "dv", "drpb"}, sharded.results,
                                     reference.results, 1e-5);
  fmt::print("sharded neighborhood attention matches one rank (f32, tolerance 1e-5): {}\n",
             ok ? "yes" : "NO");
  if (!ok) throw Error("demo", "the sharded neighborhood attention differs from one rank");
}

/// Losses of `steps` AdamW steps of a conv3d(C->8) -> gelu -> conv3d(8->C) net on (x, target)
/// laid out on `mesh` as given (gradients through a GradReducer), and the final weights.
struct TrainingRun {
  std::vector<double> losses;
  std::vector<Tensor> weights;  // full tensors
  double seconds = 0;
};

TrainingRun train_net(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                      const std::vector<std::vector<int64_t>>& extents, const Tensor& x_full,
                      const Tensor& target_full, int steps) {
  const int64_t channels = x_full.shape(1);
  nn::Sequential net;
  net.append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.spatial_dims = 3, .in_channels = channels, .out_channels = 8}, 11));
  net.append(std::make_shared<nn::Activation>("gelu"));
  net.append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.spatial_dims = 3, .in_channels = 8, .out_channels = channels}, 12));
  optim::AdamW optimizer(net.parameters(), {.lr = 2e-3, .weight_decay = 0.0});
  nn::GradReducer reducer(net.parameters());
  const ShardTensor x = ShardTensor::distribute(x_full, mesh, placements, extents);
  const ShardTensor target = ShardTensor::distribute(target_full, mesh, placements, extents);
  TrainingRun run;
  mesh.comm().barrier();
  const double start = settled_seconds();
  for (int step = 0; step < steps; ++step) {
    trace::Span span("step", fmt::format("train step {}", step));
    optimizer.zero_grad();
    Tape tape;
    const ShardTensor loss = ops::mse_loss(net.forward(x), target);
    const Tensor loss_value = loss.full_tensor().to(Device::cpu());
    run.losses.push_back(without_data() ? std::nan("") : loss_value.item_as_double({}));
    tape.backward(loss);
    reducer.finish();
    optimizer.step();
  }
  run.seconds = settled_seconds() - start;
  mesh.comm().all_reduce(&run.seconds, &run.seconds, 1, DType::f64, ReduceOp::max);
  for (const Parameter& parameter : net.parameters())
    run.weights.push_back(parameter.tensor().full_tensor().to(Device::cpu()));
  return run;
}

void run_training(std::shared_ptr<Comm> world, Shape field, const std::string& data_file) {
  constexpr int kSteps = 30;
  DeviceMesh mesh(world, {2, 2}, {"dp", "x"});
  // A batch of two samples: snapshots 1 and 2 as inputs, 2 and 3 as targets.
  const auto snapshots = read_snapshots(data_file, 1, 2);
  Tensor x, target;
  if (snapshots) {
    std::tie(x, target) = *snapshots;
    field = {x.shape(2), x.shape(3), x.shape(4)};
  } else {
    x = generated({2, 2, field[0], field[1], field[2]}, 21, 1.0);
    target = generated({2, 2, field[0], field[1], field[2]}, 22, 0.5);
  }
  x = x.to(rank_device());
  target = target.to(rank_device());
  const std::vector<std::vector<int64_t>> extents{{1, 1}, uneven_split(field[0], 2)};
  const TrainingRun sharded =
      train_net(mesh, {Placement::shard(0), Placement::shard(2)}, extents, x, target, kSteps);
  auto self = world->split(world->rank() == 0 ? 0 : -1, 0);
  if (world->rank() != 0) return;
  DeviceMesh single(self, {1, 1}, {"dp", "x"});
  const TrainingRun reference =
      train_net(single, {Placement::replicate(), Placement::replicate()}, {}, x, target, kSteps);
  if (without_data()) {
    fmt::print("\ntraining: {} steps on dp=2 x domain 2 and on one rank, recorded without data\n",
               kSteps);
    return;
  }
  fmt::print(
      "\ntraining: conv3d(2->8, k3) -> gelu -> conv3d(8->2, k3), AdamW lr 2e-3, {} steps, batch of "
      "2 "
      "[2, 2, {}] f32 on {}\n",
      kSteps, fmt::join(field, ", "), rank_device().str());
  fmt::print("  input: {}\n",
             snapshots ? fmt::format("{} snapshots 1, 2 -> 2, 3 (learning one step)", data_file)
                       : std::string("generated (sample data not readable)"));
  fmt::print(
      "  dp=2 x domain 2 (x extents {}), gradients through the bucketed reducer: {:.2f} s; "
      "one rank: {:.2f} s\n",
      extents[1], sharded.seconds, reference.seconds);
  double worst = 0;
  for (int step = 0; step < kSteps; ++step) {
    const double diff = std::fabs(sharded.losses[step] - reference.losses[step]) /
                        std::max(std::fabs(reference.losses[step]), 1e-30);
    worst = std::max(worst, diff);
    if (step % 5 == 0 || step == kSteps - 1)
      fmt::print("  step {:>2}  loss {:.8f}  (one rank {:.8f})\n", step + 1, sharded.losses[step],
                 reference.losses[step]);
  }
  fmt::print("  max relative loss difference over {} steps: {:.2g}\n", kSteps, worst);
  const bool ok =
      report_differences({"w1", "b1", "w2", "b2"}, sharded.weights, reference.weights, 1e-4, 0) &&
      worst < 1e-4 && reference.losses.back() < reference.losses.front();
  fmt::print(
      "training on dp=2 x domain 2 matches one rank and the loss falls (f32, tolerance "
      "1e-4): {}\n",
      ok ? "yes" : "NO");
  if (!ok) throw Error("demo", "training on dp=2 x domain 2 differs from one rank");
}

}  // namespace

void register_demo(CLI::App& app) {
  auto options = std::make_shared<DemoOptions>();
  auto* command = app.add_subcommand(
      "demo",
      "Scatter a 3-d field over a 2x2 mesh, redistribute it through several layouts, "
      "gather it back and verify it");
  command->add_option("--shape", options->shape, "Global field shape x,y,z")->capture_default_str();
  command
      ->add_option("--ranks", options->ranks,
                   "Local ranks (threads) without mpiexec (the demo's 2x2 mesh needs 4)")
      ->check(CLI::Range(1, kMaxLocalRanks))
      ->capture_default_str();
  add_trace_option(*command);
  command->add_option("--data", options->data, "Sample data file (tessera generate gray-scott)")
      ->capture_default_str();
  command
      ->add_option("--device", options->device,
                   "Where each rank's pieces live: cpu, cuda (ranks round-robin over the GPUs) "
                   "or cuda:N")
      ->capture_default_str();
  command->callback([options] {
    const Shape shape = parse_list(options->shape);
    check_arg(shape.size() == 3, "demo", "--shape needs 3 extents, got '{}'", options->shape);
    const size_t bytes = checked_tensor_bytes(shape, sizeof(float), "f32", "demo");
    if (bytes > host_memory_limit())
      throw OutOfMemory("demo", fmt::format("out of memory: --shape {} needs {} bytes for the f32 "
                                            "field, more than the host memory limit of {} bytes",
                                            options->shape, bytes, host_memory_limit()));
    // The layout tour moves 5 rows to one rank and the conv network runs on half the field.
    for (int64_t extent : shape)
      check_arg(extent >= kMinDemoExtent, "demo", "--shape {}: each extent must be at least {}",
                options->shape, kMinDemoExtent);
    select_device(options->device);
    launch(backend_from_env(), options->ranks, [&](std::shared_ptr<Comm> world) {
      run_layout_tour(world, shape);
      run_conv_network(world, {shape[0] / 2, shape[1] / 2, shape[2] / 2}, options->data);
      run_neighborhood_attention(world);
      run_training(world, {shape[0] / 2, shape[1] / 2, shape[2] / 2}, options->data);
    });
  });
}

}  // namespace tessera::cli
