// Mixed precision (ops/nn/mixed_precision.hpp) and its cast op (ops/cast): a seeded conv net
// (f32 master weights, bf16 compute) trained 10 steps with SGD + momentum under DDP on dp=2 x
// rows=2 and under FSDP over dp_shard x rows gives the one-rank bf16 run's losses within 1e-3
// relative and its parameters within 2e-3 (measured: 7e-5 and 3e-4; bf16 keeps 8 bits and sharded
// weight gradients are rounded per rank before their f32 sum), with replicas bit-identical after
// every step and the master weights and their gradients f32; the f32 gradients of one bf16 step
// match an f64 run of the same net to bf16 accuracy (2e-2 relative in norm); the GradScaler skips a
// step with an inf injected on one rank (DDP, and FSDP's shard) on every rank, halves its scale and
// grows it after the interval; a checkpoint with the scaler resumes the uninterrupted run exactly;
// a bad policy is one error on every rank.
#include "ops/nn/mixed_precision.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/tessera.hpp"
#include "ops/cast/cast_op.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/fsdp.hpp"
#include "ops/nn/layers.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"
#include "tests/dist/training_support.hpp"
#ifdef TESSERA_TEST_HAVE_HDF5
#include "ops/nn/checkpoint.hpp"
#include "tests/dist/io_test_support.hpp"
#endif

namespace tessera {
namespace {

using testing::RunResult;
using testing::values_of;

// cast rounds to nearest even like Tensor::to_dtype on every layout, keeps the layout, and its
// gradient comes back in the input's dtype.
TEST(Cast, MatchesToDtypeOnEveryLayoutAndTheGradientKeepsTheInputDtype) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"x"});
    std::vector<float> values;  // k / 7: most need rounding to bf16
    for (int k = 0; k < 15; ++k) values.push_back(static_cast<float>(k - 7) / 7.0f);
    const Tensor full = Tensor::from_values<float>({5, 3}, values);
    for (const Placement placement : {Placement::replicate(), Placement::shard(0)}) {
      const ShardTensor x = ShardTensor::distribute(full, mesh, {placement});
      const ShardTensor y = ops::cast(x, DType::bf16);
      EXPECT_EQ(y.dtype(), DType::bf16);
      EXPECT_EQ(y.spec(), x.spec());
      EXPECT_EQ(values_of(y.full_tensor()), values_of(full.to_dtype(DType::bf16)));
      Parameter w(x, "w");
      {
        Tape tape;
        const ShardTensor scaled = ops::scale(ops::cast(w, DType::bf16), 3.0);
        tape.backward(ops::sum(ops::cast(scaled, DType::f32)));
      }
      ASSERT_TRUE(w.grad());
      EXPECT_EQ(w.grad()->dtype(), DType::f32);
      for (double g : values_of(w.grad()->full_tensor())) EXPECT_EQ(g, 3.0);
    }
    EXPECT_THROW(
        ops::cast(ShardTensor::distribute(full, mesh, {Placement::replicate()}), DType::i32),
        InvalidArgument);
  });
}

/// conv(2 -> 5, k3) -> tanh -> conv(5 -> 2, k3), parameters in `dtype`.
std::shared_ptr<nn::Sequential> make_net(const DeviceMesh& mesh, DType dtype) {
  auto net = std::make_shared<nn::Sequential>();
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 5, .dtype = dtype}, 41));
  net->append(std::make_shared<nn::Activation>("tanh"));
  net->append(std::make_shared<nn::Conv>(
      mesh, nn::ConvConfig{.in_channels = 5, .out_channels = 2, .dtype = dtype}, 42));
  return net;
}

struct Layout {
  std::vector<int> shape;
  std::vector<std::string> names;
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
  std::optional<nn::FsdpOptions> fsdp = std::nullopt;
  bool ddp = false;
};

/// x and target [4, 2, 11, 9] (integers in [-3, 3], so exact in every dtype) laid out as asked.
std::pair<ShardTensor, ShardTensor> data(const DeviceMesh& mesh, const Layout& layout,
                                         DType dtype) {
  testing::CaseRng rng(81);
  const Shape shape{4, 2, 11, 9};
  const Tensor x = testing::integer_tensor(shape, dtype, rng, -3, 3);
  const Tensor target = testing::integer_tensor(shape, dtype, rng, -3, 3);
  return {ShardTensor::distribute(x, mesh, layout.placements, layout.extents),
          ShardTensor::distribute(target, mesh, layout.placements, layout.extents)};
}

/// Every rank holding the same piece of a parameter holds the same bits.
void expect_replicas_identical(const DeviceMesh& mesh, const Layout& layout, nn::Module& module,
                               int step) {
  std::vector<int> replica_dims;
  for (int m = 0; m < mesh.ndim(); ++m)
    if (!layout.fsdp || mesh.names()[m] != layout.fsdp->shard_dim) replica_dims.push_back(m);
  if (replica_dims.empty()) return;
  auto replicas = mesh.sub_comm(replica_dims);
  for (const Parameter& parameter : module.parameters()) {
    const std::vector<double> mine = values_of(parameter.tensor().to_local());
    std::vector<double> root = mine;
    replicas->broadcast(root.data(), root.size(), DType::f64, 0);
    EXPECT_EQ(std::memcmp(mine.data(), root.data(), mine.size() * sizeof(double)), 0)
        << parameter.name() << " differs between replicas after step " << step;
  }
}

/// 10 steps of SGD with momentum with f32 master weights computing in bf16; checks after every
/// step that the master weights and gradients are f32 and replicas bit-identical.
RunResult train_bf16(std::shared_ptr<Comm> comm, const Layout& layout, int steps) {
  DeviceMesh mesh(comm, layout.shape, layout.names);
  auto net = make_net(mesh, DType::f32);
  nn::apply_mixed_precision(*net, {.compute = DType::bf16, .reduce = DType::f32});
  std::unique_ptr<nn::FullyShardedDataParallel> fsdp;
  std::unique_ptr<nn::GradReducer> reducer;
  if (layout.fsdp) fsdp = std::make_unique<nn::FullyShardedDataParallel>(mesh, net, *layout.fsdp);
  if (layout.ddp) reducer = std::make_unique<nn::GradReducer>(net->parameters());
  nn::Module& module = fsdp ? static_cast<nn::Module&>(*fsdp) : *net;
  optim::Sgd sgd(module.parameters(), {.lr = 0.05, .momentum = 0.9});
  const auto [x, target] = data(mesh, layout, DType::f32);
  RunResult result;
  for (int step = 0; step < steps; ++step) {
    sgd.zero_grad();
    {
      Tape tape;
      const ShardTensor y = module.forward(x);
      EXPECT_EQ(y.dtype(), DType::bf16);
      const ShardTensor loss = ops::mse_loss(ops::cast(y, DType::f32), target);
      result.losses.push_back(values_of(loss.full_tensor())[0]);
      tape.backward(loss);
    }
    if (reducer) reducer->finish();
    for (const Parameter& parameter : module.parameters()) {
      EXPECT_TRUE(parameter.grad() && parameter.grad()->dtype() == DType::f32) << parameter.name();
    }
    sgd.step();
    for (const Parameter& parameter : module.parameters())
      EXPECT_EQ(parameter.tensor().dtype(), DType::f32) << parameter.name();
    expect_replicas_identical(mesh, layout, module, step);
  }
  for (const Parameter& parameter : module.parameters())
    result.parameters.push_back(values_of(parameter.tensor().full_tensor()));
  return result;
}

TEST(MixedPrecision, Bf16DdpAndFsdpEqualOneRankWithBitIdenticalReplicas) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    auto alone = comm->split(comm->rank(), 0);
    const Layout one{{1}, {"dp"}, {Placement::replicate()}, {}, std::nullopt};
    const RunResult reference = train_bf16(alone, one, 10);
    EXPECT_LT(reference.losses.back(), reference.losses.front());
    const std::vector<Placement> split{Placement::shard(0), Placement::shard(2)};
    const std::vector<std::pair<std::string, Layout>> layouts{
        {"ddp dp=2 x rows=2", {{2, 2}, {"dp", "rows"}, split, {{}, {7, 4}}, std::nullopt, true}},
        {"fsdp dp_shard=2 x rows=2",
         {{2, 2},
          {"dp_shard", "rows"},
          split,
          {{}, {7, 4}},
          nn::FsdpOptions{.shard_dim = "dp_shard"}}}};
    for (const auto& [what, layout] : layouts) {
      const RunResult got = train_bf16(comm, layout, 10);
      ASSERT_EQ(got.losses.size(), reference.losses.size());
      for (size_t i = 0; i < got.losses.size(); ++i)
        EXPECT_NEAR(got.losses[i], reference.losses[i], 1e-3 * std::fabs(reference.losses[i]))
            << what << " loss of step " << i;
      ASSERT_EQ(got.parameters.size(), reference.parameters.size());
      for (size_t p = 0; p < got.parameters.size(); ++p)
        for (size_t i = 0; i < got.parameters[p].size(); ++i)
          EXPECT_NEAR(got.parameters[p][i], reference.parameters[p][i],
                      2e-3 * (1 + std::fabs(reference.parameters[p][i])))
              << what << " parameter " << p << " element " << i;
    }
  });
}

/// sqrt(sum (a - b)^2) / sqrt(sum b^2).
double norm_error(const std::vector<double>& a, const std::vector<double>& b) {
  double difference = 0, reference = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    difference += (a[i] - b[i]) * (a[i] - b[i]);
    reference += b[i] * b[i];
  }
  return std::sqrt(difference / reference);
}

// Every layer with parameters computes in bf16 and hands f32 gradients to its f32 parameters;
// BatchNorm keeps f32 statistics. Output and gradients of a 9-layer net of all of them, sharded
// over a 2x1 mesh, equal the f32 net's within bf16 accuracy through that depth: 1e-1 relative in
// norm (measured 1e-3 to 7.4e-2, the largest BatchNorm's bias, a sum that mostly cancels).
TEST(MixedPrecision, EveryLayerComputesInBf16WithF32Gradients) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2, 1}, {"rows", "cols"});
    auto run = [&](bool mixed) {
      // A nonlinearity after every norm and no bias right before one, so that no parameter's
      // exact gradient vanishes (a relative comparison of zeros would compare rounding noise).
      auto net = std::make_shared<nn::Sequential>();
      net->append(
          std::make_shared<nn::Conv>(mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 4}, 5));
      net->append(std::make_shared<nn::Activation>("gelu"));
      net->append(std::make_shared<nn::GroupNorm>(mesh, 2, 4));
      net->append(std::make_shared<nn::Activation>("gelu"));
      net->append(std::make_shared<nn::Conv>(
          mesh, nn::ConvConfig{.in_channels = 4, .out_channels = 4, .bias = false}, 6));
      net->append(std::make_shared<nn::BatchNorm>(mesh, 4));
      net->append(std::make_shared<nn::Activation>("gelu"));
      net->append(std::make_shared<nn::ConvTranspose>(
          mesh, nn::ConvTransposeConfig{.in_channels = 4, .out_channels = 3, .bias = false}, 7));
      net->append(std::make_shared<nn::InstanceNorm>(mesh, 3, 1e-5, true));
      net->append(std::make_shared<nn::Activation>("gelu"));
      net->append(std::make_shared<nn::AvgPool>(ops::PoolOptions{}));
      net->append(std::make_shared<nn::Linear>(mesh, 5, 6, true, 8));
      net->append(std::make_shared<nn::Activation>("gelu"));
      net->append(std::make_shared<nn::LayerNorm>(mesh, Shape{6}));
      if (mixed) nn::apply_mixed_precision(*net, {.compute = DType::bf16});
      testing::CaseRng rng(3);
      const Tensor x = testing::integer_tensor({2, 2, 10, 10}, DType::f32, rng, -3, 3);
      const ShardTensor xs =
          ShardTensor::distribute(x, mesh, {Placement::shard(2), Placement::replicate()});
      std::vector<std::vector<double>> result;
      {
        Tape tape;
        const ShardTensor y = net->forward(xs);
        EXPECT_EQ(y.dtype(), mixed ? DType::bf16 : DType::f32);
        const ShardTensor y32 = ops::cast(y, DType::f32);
        result.push_back(values_of(y32.full_tensor()));
        // Against a target: a loss of LayerNorm's output alone would be flat in everything before.
        const Tensor target = testing::integer_tensor(y32.global_shape(), DType::f32, rng, -2, 2);
        tape.backward(ops::mse_loss(
            y32, ShardTensor::distribute(target, mesh, y32.placements(), y32.spec().extents)));
      }
      for (const Parameter& parameter : net->parameters()) {
        EXPECT_EQ(parameter.tensor().dtype(), DType::f32) << parameter.name();
        EXPECT_TRUE(parameter.grad() && parameter.grad()->dtype() == DType::f32)
            << parameter.name();
        result.push_back(values_of(parameter.grad()->full_tensor()));
      }
      for (const auto& [name, buffer] : net->named_buffers()) EXPECT_EQ(buffer.dtype(), DType::f32);
      return result;
    };
    const auto exact = run(false), mixed = run(true);
    ASSERT_EQ(exact.size(), mixed.size());
    for (size_t k = 0; k < exact.size(); ++k)
      EXPECT_LT(norm_error(mixed[k], exact[k]), 1e-1) << (k == 0 ? "output" : "gradient ") << k;
  });
}

// The f32 gradients of a bf16 step are the f64 gradients to bf16 accuracy (2^-8 per rounding,
// a few roundings deep): 2e-2 relative in norm, per parameter, on one rank and on dp=2 x rows=2.
TEST(MixedPrecision, F32GradientsOfABf16StepMatchF64) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    auto gradients = [](std::shared_ptr<Comm> world, const Layout& layout, DType dtype,
                        bool mixed) {
      DeviceMesh mesh(world, layout.shape, layout.names);
      auto net = make_net(mesh, dtype);
      if (mixed) nn::apply_mixed_precision(*net, {.compute = DType::bf16});
      const auto [x, target] = data(mesh, layout, dtype);
      {
        Tape tape;
        tape.backward(ops::mse_loss(ops::cast(net->forward(x), dtype), target));
      }
      std::vector<std::vector<double>> result;
      for (const Parameter& parameter : net->parameters()) {
        EXPECT_EQ(parameter.grad()->dtype(), dtype);
        result.push_back(values_of(parameter.grad()->full_tensor()));
      }
      return result;
    };
    auto alone = comm->split(comm->rank(), 0);
    const Layout one{{1}, {"dp"}, {Placement::replicate()}, {}, std::nullopt};
    const auto exact = gradients(alone, one, DType::f64, false);
    const Layout sharded{
        {2, 2}, {"dp", "rows"}, {Placement::shard(0), Placement::shard(2)}, {{}, {7, 4}}};
    for (const auto& got :
         {gradients(alone, one, DType::f32, true), gradients(comm, sharded, DType::f32, true)})
      for (size_t p = 0; p < exact.size(); ++p) {
        const double error = norm_error(got[p], exact[p]);
        EXPECT_LT(error, 2e-2) << "parameter " << p;
        EXPECT_GT(error, 0.0) << "parameter " << p << " (bf16 should round somewhere)";
      }
  });
}

/// One f16 training step with the scaler (the reducer's finish() after backward when there is
/// one); `inject_on` >= 0: that rank puts an inf into its piece of the first gradient after the
/// reduction. Returns whether the step was taken.
bool scaled_step(nn::Module& net, nn::GradReducer* reducer, optim::Optimizer& optimizer,
                 nn::GradScaler& scaler, const ShardTensor& x, const ShardTensor& target,
                 int inject_on, std::vector<double>* losses = nullptr) {
  optimizer.zero_grad();
  {
    Tape tape;
    const ShardTensor loss = ops::mse_loss(ops::cast(net.forward(x), DType::f32), target);
    if (losses) losses->push_back(values_of(loss.full_tensor())[0]);
    tape.backward(scaler.scale(loss));
  }
  if (reducer) reducer->finish();
  if (x.mesh().rank() == inject_on) {
    Parameter first = net.parameters().front();
    Tensor local = first.grad()->to_local().clone();
    local.data<float>()[0] = std::numeric_limits<float>::infinity();
    first.set_grad(ShardTensor(local, first.grad()->mesh(), first.grad()->spec()));
  }
  const bool stepped = scaler.step(optimizer);
  scaler.update();
  return stepped;
}

// Under DDP (replicated gradients) and under FSDP (rank 1's shard of the gradient only).
TEST(GradScaler, InfOnOneRankSkipsTheStepEverywhereHalvesTheScaleThenItGrows) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    for (bool sharded : {false, true}) {
      SCOPED_TRACE(sharded ? "fsdp" : "ddp");
      DeviceMesh mesh(comm, {2}, {"dp"});
      auto net = make_net(mesh, DType::f32);
      nn::apply_mixed_precision(*net, {.compute = DType::f16});
      std::unique_ptr<nn::FullyShardedDataParallel> fsdp;
      std::unique_ptr<nn::GradReducer> reducer;
      if (sharded)
        fsdp = std::make_unique<nn::FullyShardedDataParallel>(mesh, net,
                                                              nn::FsdpOptions{.shard_dim = "dp"});
      else
        reducer = std::make_unique<nn::GradReducer>(net->parameters());
      nn::Module& module = fsdp ? static_cast<nn::Module&>(*fsdp) : *net;
      optim::Sgd sgd(module.parameters(), {.lr = 0.05, .momentum = 0.9});
      // PyTorch's defaults, but a scale whose f16 gradients of this net stay finite.
      const nn::GradScalerOptions defaults;
      EXPECT_EQ(defaults.init_scale, 65536.0);
      EXPECT_EQ(defaults.growth_factor, 2.0);
      EXPECT_EQ(defaults.backoff_factor, 0.5);
      EXPECT_EQ(defaults.growth_interval, 2000);
      nn::GradScaler scaler(module.parameters(), {.init_scale = 1024, .growth_interval = 3});
      const Layout layout{{2}, {"dp"}, {Placement::shard(0)}, {}};
      const auto [x, target] = data(mesh, layout, DType::f32);
      auto snapshot = [&] {
        std::vector<std::vector<double>> values;
        for (const Parameter& parameter : module.parameters())
          values.push_back(values_of(parameter.tensor().to_local()));
        return values;
      };
      EXPECT_TRUE(scaled_step(module, reducer.get(), sgd, scaler, x, target, -1));
      EXPECT_EQ(scaler.get_scale(), 1024.0);
      const auto before = snapshot();
      EXPECT_FALSE(scaled_step(module, reducer.get(), sgd, scaler, x, target, /*inject_on=*/1));
      EXPECT_EQ(snapshot(), before) << "a step with an inf on rank 1 changed the parameters";
      EXPECT_EQ(scaler.get_scale(), 512.0);
      EXPECT_EQ(sgd.steps(), 1);
      for (int good = 0; good < 3; ++good) {
        EXPECT_EQ(scaler.get_scale(), 512.0) << "after " << good << " good steps";
        EXPECT_TRUE(scaled_step(module, reducer.get(), sgd, scaler, x, target, -1));
      }
      EXPECT_EQ(scaler.get_scale(), 1024.0);
      EXPECT_EQ(scaler.state().growth_tracker, 0);
      EXPECT_NE(snapshot(), before);
    }
  });
}

// Unscaled gradients equal the unscaled run's: the scale is a power of two.
TEST(GradScaler, UnscaledGradientsEqualTheUnscaledRun) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1}, {"dp"});
    const Layout layout{{1}, {"dp"}, {Placement::replicate()}, {}};
    const auto [x, target] = data(mesh, layout, DType::f32);
    std::vector<std::vector<double>> plain, unscaled;
    for (bool scaled : {false, true}) {
      auto net = make_net(mesh, DType::f32);
      nn::apply_mixed_precision(*net, {.compute = DType::bf16});
      nn::GradScaler scaler(net->parameters(), {.init_scale = 1024});
      {
        Tape tape;
        const ShardTensor loss = ops::mse_loss(ops::cast(net->forward(x), DType::f32), target);
        tape.backward(scaled ? scaler.scale(loss) : loss);
      }
      if (scaled) {
        EXPECT_FALSE(scaler.unscale());
      }
      for (const Parameter& parameter : net->parameters())
        (scaled ? unscaled : plain).push_back(values_of(parameter.grad()->to_local()));
    }
    EXPECT_EQ(unscaled, plain);
  });
}

TEST(MixedPrecision, BadPolicyIsOneErrorOnEveryRank) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"dp"});
    auto net = make_net(mesh, DType::f32);
    auto message = [&](const nn::MixedPrecision& policy) {
      try {
        nn::apply_mixed_precision(*net, policy);
      } catch (const InvalidArgument& error) {
        return std::string(error.what());
      }
      return std::string("no error");
    };
    const std::string not_floating = message({.compute = DType::i32});
    EXPECT_NE(not_floating.find("[mixed_precision] compute dtype i32 is not floating"),
              std::string::npos)
        << not_floating;
    const std::string reduce = message({.compute = DType::bf16, .reduce = DType::bf16});
    EXPECT_NE(reduce.find("[mixed_precision] reduce dtype bf16 differs"), std::string::npos)
        << reduce;
    EXPECT_EQ(testing::all_gather_strings(*comm, not_floating + reduce)[0],
              testing::all_gather_strings(*comm, not_floating + reduce).back());
    EXPECT_FALSE(net->compute_dtype().has_value());
    EXPECT_THROW(nn::GradScaler(net->parameters(), {.backoff_factor = 1.5}), InvalidArgument);
  });
}

#ifdef TESSERA_TEST_HAVE_HDF5
// f16 with the scaler on dp=2: 6 steps with an inf injected at step 1 (the scale backs off, then
// grows every 2 good steps) equal a run saved after step 3 and resumed into a fresh model,
// optimizer and scaler: the same losses, parameters and scaler state, bit for bit.
TEST(GradScaler, CheckpointWithTheScalerResumesIdentically) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"dp"});
    const std::string dir = testing::make_test_dir(*comm, "GradScaler", "Checkpoint");
    const std::string file = dir + "/run.h5";
    const Layout layout{{2}, {"dp"}, {Placement::shard(0)}, {}};
    const auto [x, target] = data(mesh, layout, DType::f32);
    struct Run {
      std::shared_ptr<nn::Sequential> net;
      std::unique_ptr<nn::GradReducer> reducer;
      std::unique_ptr<optim::AdamW> adamw;
      std::unique_ptr<nn::GradScaler> scaler;
    };
    auto make_run = [&] {
      Run run;
      run.net = make_net(mesh, DType::f32);
      nn::apply_mixed_precision(*run.net, {.compute = DType::f16});
      run.reducer = std::make_unique<nn::GradReducer>(run.net->parameters());
      run.adamw =
          std::make_unique<optim::AdamW>(run.net->parameters(), optim::AdamOptions{.lr = 0.01});
      run.scaler = std::make_unique<nn::GradScaler>(
          run.net->parameters(), nn::GradScalerOptions{.init_scale = 1024, .growth_interval = 2});
      return run;
    };
    auto steps = [&](Run& run, int first, int last, std::vector<double>& losses) {
      for (int step = first; step < last; ++step)
        scaled_step(*run.net, run.reducer.get(), *run.adamw, *run.scaler, x, target,
                    step == 1 ? 0 : -1, &losses);
    };
    std::vector<double> straight, resumed;
    Run uninterrupted = make_run();
    steps(uninterrupted, 0, 6, straight);
    Run first = make_run();
    steps(first, 0, 3, resumed);
    nn::save_training_checkpoint(file, *first.net, *first.adamw, {{"step", 3}}, first.scaler.get());
    Run second = make_run();
    EXPECT_THROW(nn::load_training_checkpoint(file, *second.net, *second.adamw), InvalidArgument);
    EXPECT_EQ(nn::load_training_checkpoint(file, *second.net, *second.adamw, second.scaler.get())
                  .at("step"),
              3);
    EXPECT_EQ(second.scaler->get_scale(), first.scaler->get_scale());
    steps(second, 3, 6, resumed);
    EXPECT_EQ(resumed, straight);
    EXPECT_EQ(second.scaler->get_scale(), uninterrupted.scaler->get_scale());
    EXPECT_EQ(second.scaler->state().growth_tracker, uninterrupted.scaler->state().growth_tracker);
    for (size_t p = 0; p < uninterrupted.net->parameters().size(); ++p)
      EXPECT_EQ(values_of(second.net->parameters()[p].tensor().to_local()),
                values_of(uninterrupted.net->parameters()[p].tensor().to_local()));
    testing::remove_test_dir(*comm, dir);
  });
}
#endif

}  // namespace
}  // namespace tessera
