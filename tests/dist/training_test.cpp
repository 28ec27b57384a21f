// Training primitives: Parameters (gradients accumulated across backward passes, hooks that fire
// as soon as a gradient is final), a differentiable redistribute, NoGrad, saved tensors released
// by backward, the optimizers against PyTorch fixtures (tests/fixtures/optim), clipping, the
// learning-rate schedules, and the property that matters: 10 steps of SGD with momentum and of
// AdamW on a seeded 2-d conv net give the same losses and parameters on 1 rank and on uneven
// domain decompositions (f64, 1e-10 relative), with replicated parameters bit-identical on every
// rank after every step, and an optimizer state saved mid-run resumes to the same result.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/host_allocator.hpp"
#include "core/tessera.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"
#include "tests/dist/training_support.hpp"

namespace tessera {
namespace {

using testing::expect_close;
using testing::RunResult;
using testing::values_of;

using Json = nlohmann::json;

Tensor f64_values(const std::vector<double>& values, const Shape& shape) {
  return Tensor::from_values<double>(shape, values);
}

TEST(Training, ParameterGradientsAccumulateUntilZeroGradAndMatchTheTape) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    const Tensor w_full = f64_values({1, 2, 3, 4, 5, 6}, {6});
    const Tensor x_full = f64_values({0.5, -1, 2, 0.25, 3, -2}, {6});
    Parameter w(ShardTensor::distribute(w_full, mesh, {Placement::replicate()}), "w");
    const ShardTensor x = ShardTensor::distribute(x_full, mesh, {Placement::shard(0)});
    EXPECT_FALSE(w.grad());
    auto step = [&] {
      Tape tape;
      tape.backward(ops::sum(ops::mul(w.tensor().redistribute({Placement::shard(0)}), x)));
      return *tape.grad(w.tensor());
    };
    const ShardTensor first = step();
    ASSERT_TRUE(w.grad());
    EXPECT_EQ(w.grad()->spec(), w.tensor().spec());  // the parameter's own layout
    EXPECT_EQ(values_of(w.grad()->to_local()), values_of(x_full));
    EXPECT_EQ(values_of(first.to_local()), values_of(x_full));
    step();  // a second micro-batch adds
    std::vector<double> twice = values_of(x_full);
    for (double& value : twice) value *= 2;
    EXPECT_EQ(values_of(w.grad()->to_local()), twice);
    w.zero_grad();
    EXPECT_FALSE(w.grad());
  });
}

TEST(Training, RedistributeIsDifferentiableWithoutAnyOtherCall) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {comm->size()});
    testing::CaseRng rng(testing::case_seed(70, comm->size(), 0, 0));
    const Tensor full = testing::integer_tensor({5, 7}, DType::f64, rng, -9, 9);
    ShardTensor x = ShardTensor::distribute(full, mesh, {Placement::shard(0)});
    x.set_requires_grad();
    Tape tape;
    const ShardTensor y = x.redistribute({Placement::shard(1)});
    EXPECT_TRUE(y.requires_grad());
    tape.backward(ops::sum(ops::mul(y, y)));
    std::vector<double> expected = values_of(full.view_box(x.local_box()).contiguous());
    for (double& value : expected) value *= 2;
    EXPECT_EQ(values_of(tape.grad(x)->to_local()), expected);
  });
}

// Backwards that pass the gradient through (add's, concat's, permute's) hand it out, or views of
// it, without a copy; the leaves' gradients still never share storage with the gradient passed
// to backward, so overwriting that buffer afterwards changes none of them.
TEST(Training, LeafGradientsNeverShareStorageWithTheGradientPassedToBackward) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    const Tensor a_full = f64_values({1, 2, 3, 4, 5, 6}, {2, 3});
    const Tensor b_full = f64_values({-1, -2, -3, -4, -5, -6}, {2, 3});
    for (const std::string program : {"add", "concat", "permute"}) {
      ShardTensor a = ShardTensor::distribute(a_full, mesh, {Placement::replicate()});
      ShardTensor b = ShardTensor::distribute(b_full, mesh, {Placement::replicate()});
      a.set_requires_grad();
      b.set_requires_grad();
      Tape tape;
      const ShardTensor y = program == "add"      ? ops::add(a, b)
                            : program == "concat" ? ops::concat({a, b}, 0)
                                                  : ops::permute(a, {1, 0});
      Tensor g = Tensor::empty(y.global_shape(), DType::f64);
      for (int64_t i = 0; i < g.numel(); ++i) g.data<double>()[i] = double(10 + i);
      const ShardTensor gy(g, mesh, y.spec());
      tape.backward(y, gy);
      // The gradients the pass-through backwards give, read before the buffer is overwritten.
      std::vector<double> want_a, want_b;
      if (program == "add") {
        want_a = want_b = values_of(g);
      } else if (program == "concat") {
        want_a = values_of(g.slice(0, 0, 2).contiguous());
        want_b = values_of(g.slice(0, 2, 4).contiguous());
      } else {  // a[i][j] took y[j][i]
        for (int64_t i = 0; i < 2; ++i)
          for (int64_t j = 0; j < 3; ++j) want_a.push_back(g.data<double>()[j * 2 + i]);
      }
      g.fill(-1.0);
      EXPECT_EQ(values_of(tape.grad(a)->to_local().contiguous()), want_a) << program;
      if (program != "permute") {
        EXPECT_EQ(values_of(tape.grad(b)->to_local().contiguous()), want_b) << program;
      }
    }
  });
}

TEST(Training, NoGradRecordsNothing) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    Parameter w(ShardTensor::distribute(f64_values({1, 2}, {2}), mesh, {Placement::replicate()}));
    Tape tape;
    {
      NoGrad no_grad;
      EXPECT_EQ(Tape::active(), nullptr);
      const ShardTensor y = ops::gelu(w.tensor().redistribute({Placement::shard(0)}));
      EXPECT_FALSE(y.requires_grad());
    }
    EXPECT_EQ(tape.size(), 0u);
    EXPECT_EQ(Tape::active(), &tape);
    EXPECT_TRUE(ops::gelu(w.tensor()).requires_grad());
    EXPECT_EQ(tape.size(), 1u);
  });
}

/// A seeded 2-d conv net: conv(C->H, k3) -> gelu -> conv(H->C, k3), padding same.
struct ConvNet {
  std::vector<Parameter> parameters;  // w1, b1, w2, b2 (replicated)

  ConvNet(const DeviceMesh& mesh, int64_t channels, int64_t hidden, uint64_t seed) {
    testing::CaseRng rng(seed);
    const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
    const std::vector<std::pair<std::string, Shape>> shapes{{"w1", {hidden, channels, 3, 3}},
                                                            {"b1", {hidden}},
                                                            {"w2", {channels, hidden, 3, 3}},
                                                            {"b2", {channels}}};
    for (const auto& [name, shape] : shapes) {
      Tensor values = testing::integer_tensor(shape, DType::f64, rng, -8, 8);
      values = values.to_dtype(DType::f64);
      for (double& v : std::span(values.data<double>(), values.numel())) v /= 40;
      parameters.emplace_back(ShardTensor::distribute(values, mesh, replicated), name);
    }
  }

  ShardTensor loss(const ShardTensor& x, const ShardTensor& target) const {
    ops::ConvOptions same;
    same.padding_name = "same";
    const ShardTensor hidden =
        ops::gelu(ops::conv(x, parameters[0].tensor(), parameters[1].tensor(), same));
    return ops::mse_loss(ops::conv(hidden, parameters[2].tensor(), parameters[3].tensor(), same),
                         target);
  }
};

/// Losses of `steps` steps and the final parameters (full values), on `mesh` with x and target
/// laid out as given; checks after every step that the replicated parameters are bit-identical
/// on every rank. With `resume_at` the optimizer's state and the parameters are saved after that
/// step and loaded into a fresh net and optimizer, which finishes the run.

template <typename MakeOptimizer>
RunResult train(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                const std::vector<std::vector<int64_t>>& extents, MakeOptimizer make_optimizer,
                int steps, int resume_at = -1,
                std::optional<nn::ReducerOptions> reducer_options = std::nullopt) {
  testing::CaseRng rng(81);
  const Shape shape{2, 2, 11, 9};
  const Tensor x_full = testing::integer_tensor(shape, DType::f64, rng, -5, 5);
  const Tensor target_full = testing::integer_tensor(shape, DType::f64, rng, -5, 5);
  const ShardTensor x = ShardTensor::distribute(x_full, mesh, placements, extents);
  const ShardTensor target = ShardTensor::distribute(target_full, mesh, placements, extents);
  auto net = std::make_unique<ConvNet>(mesh, 2, 4, 5);
  auto optimizer = make_optimizer(net->parameters);
  std::unique_ptr<nn::GradReducer> reducer;
  if (reducer_options)
    reducer = std::make_unique<nn::GradReducer>(net->parameters, *reducer_options);
  RunResult result;
  for (int step = 0; step < steps; ++step) {
    optimizer->zero_grad();
    Tape tape;
    const ShardTensor loss = net->loss(x, target);
    result.losses.push_back(values_of(loss.full_tensor())[0]);
    tape.backward(loss);
    if (reducer) {
      for (const Parameter& parameter : net->parameters)
        EXPECT_FALSE(parameter.grad()) << "the reducer holds gradients until finish()";
      reducer->finish();
    }
    optimizer->step();
    for (const Parameter& parameter : net->parameters) {
      const std::vector<double> mine = values_of(parameter.tensor().to_local());
      std::vector<double> root = mine;
      mesh.comm().broadcast(root.data(), root.size(), DType::f64, 0);
      EXPECT_EQ(std::memcmp(mine.data(), root.data(), mine.size() * sizeof(double)), 0)
          << parameter.name() << " differs from rank 0's after step " << step;
    }
    if (step == resume_at) {
      const auto state = optimizer->state_dict();
      std::vector<Tensor> saved;
      for (const Parameter& parameter : net->parameters)
        saved.push_back(parameter.tensor().full_tensor());
      net = std::make_unique<ConvNet>(mesh, 2, 4, 99);  // other values, overwritten below
      for (size_t i = 0; i < saved.size(); ++i)
        net->parameters[i].assign_local(saved[i].view_box(net->parameters[i].tensor().local_box()));
      optimizer = make_optimizer(net->parameters);
      optimizer->load_state_dict(state);
      EXPECT_EQ(optimizer->steps(), step + 1);
    }
  }
  for (const Parameter& parameter : net->parameters)
    result.parameters.push_back(values_of(parameter.tensor().full_tensor()));
  return result;
}

/// The optimizers of the layout tests: SGD with momentum and weight decay, and AdamW.
using testing::adamw;
using testing::sgd;

TEST(Training, SgdAndAdamWStepsEqualOneRankOnUnevenDomainDecompositions) {
  for (int world : {2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      // The reference: this rank alone (a communicator of itself, under every backend).
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      const RunResult sgd_reference = train(single, {Placement::replicate()}, {}, sgd, 10);
      const RunResult adamw_reference = train(single, {Placement::replicate()}, {}, adamw, 10);
      EXPECT_LT(sgd_reference.losses.back(), sgd_reference.losses.front());
      EXPECT_LT(adamw_reference.losses.back(), adamw_reference.losses.front());
      // 2x1 and 2x2 meshes over the spatial dims, uneven extents (7 + 4 rows, 6 + 3 columns).
      const std::vector<int> shape = world == 2 ? std::vector<int>{2, 1} : std::vector<int>{2, 2};
      DeviceMesh mesh(comm, shape);
      const std::vector<Placement> placements{Placement::shard(2), Placement::shard(3)};
      const std::vector<std::vector<int64_t>> extents{
          {7, 4}, world == 2 ? std::vector<int64_t>{9} : std::vector<int64_t>{6, 3}};
      const std::string what = fmt::format("mesh {}", fmt::join(shape, "x"));
      expect_close(train(mesh, placements, extents, sgd, 10), sgd_reference, what + " sgd");
      expect_close(train(mesh, placements, extents, adamw, 10), adamw_reference, what + " adamw");
      // Saved after step 5 and resumed in a fresh optimizer: steps 6..10 as if uninterrupted.
      expect_close(train(mesh, placements, extents, adamw, 10, 4), adamw_reference,
                   what + " adamw resumed");
    });
  }
}

// The gradients an optimizer consumes, checked against central finite differences of the loss:
// on a 2x2 domain decomposition (reduced by the tape) and on dp 2 x rows 2 (reduced by the
// bucketed reducer), for a seeded sample of elements of every parameter.
TEST(Training, ReducedParameterGradientsMatchCentralFiniteDifferences) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2, 2});
    testing::CaseRng rng(17);
    const Shape shape{2, 2, 11, 9};
    const Tensor x_full = testing::integer_tensor(shape, DType::f64, rng, -5, 5);
    const Tensor target_full = testing::integer_tensor(shape, DType::f64, rng, -5, 5);
    struct Layout {
      std::vector<Placement> placements;
      std::vector<std::vector<int64_t>> extents;
      bool reducer;
    };
    const std::vector<Layout> layouts{
        {{Placement::shard(2), Placement::shard(3)}, {{7, 4}, {6, 3}}, false},
        {{Placement::shard(0), Placement::shard(2)}, {{1, 1}, {5, 6}}, true}};
    for (const Layout& layout : layouts) {
      const ShardTensor x =
          ShardTensor::distribute(x_full, mesh, layout.placements, layout.extents);
      const ShardTensor target =
          ShardTensor::distribute(target_full, mesh, layout.placements, layout.extents);
      ConvNet net(mesh, 2, 3, 23);
      std::unique_ptr<nn::GradReducer> reducer;
      if (layout.reducer) reducer = std::make_unique<nn::GradReducer>(net.parameters);
      {
        Tape tape;
        tape.backward(net.loss(x, target));
      }
      if (reducer) reducer->finish();
      auto loss_value = [&] {
        NoGrad no_grad;
        return values_of(net.loss(x, target).full_tensor())[0];
      };
      constexpr double eps = 1e-5;
      for (Parameter& parameter : net.parameters) {
        const std::vector<double> grad = values_of(parameter.grad()->full_tensor());
        Tensor values = parameter.tensor().full_tensor();
        for (int sample = 0; sample < 4; ++sample) {
          const int64_t index = rng.uniform(0, values.numel() - 1);
          double* element = values.data<double>() + index;
          const double original = *element;
          *element = original + eps;
          parameter.assign_local(values.view_box(parameter.tensor().local_box()));
          const double plus = loss_value();
          *element = original - eps;
          parameter.assign_local(values.view_box(parameter.tensor().local_box()));
          const double minus = loss_value();
          *element = original;
          parameter.assign_local(values.view_box(parameter.tensor().local_box()));
          const double numeric = (plus - minus) / (2 * eps);
          EXPECT_NEAR(grad[index], numeric, 1e-6 * (1 + std::fabs(numeric)))
              << parameter.name() << " element " << index
              << (layout.reducer ? " (dp x rows, reducer)" : " (2x2 domain)");
        }
      }
    }
  });
}

// Data parallelism: the batch sharded over "dp" (and the rows over a domain dim), gradients
// reduced by the bucketed reducer (one bucket per parameter, or all in one; overlapped with
// backward or not): the same losses and parameters as one rank, replicas bit-identical.
TEST(Training, DataParallelReducerEqualsOneRankForEveryBucketing) {
  for (int world : {2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      const RunResult sgd_reference = train(single, {Placement::replicate()}, {}, sgd, 10);
      const RunResult adamw_reference = train(single, {Placement::replicate()}, {}, adamw, 10);
      // dp = 2 over the batch (2 samples); with 4 ranks also the rows over a second dim (7 + 4).
      const std::vector<int> shape = world == 2 ? std::vector<int>{2} : std::vector<int>{2, 2};
      DeviceMesh mesh(
          comm, shape,
          world == 2 ? std::vector<std::string>{"dp"} : std::vector<std::string>{"dp", "rows"});
      std::vector<Placement> placements{Placement::shard(0)};
      std::vector<std::vector<int64_t>> extents{{}};
      if (world == 4) {
        placements.push_back(Placement::shard(2));
        extents.push_back({7, 4});
      }
      for (const nn::ReducerOptions& options :
           {nn::ReducerOptions{.bucket_bytes = 8, .overlap = true},
            nn::ReducerOptions{.bucket_bytes = size_t{1} << 20, .overlap = true},
            nn::ReducerOptions{.bucket_bytes = 300, .overlap = false}}) {
        const std::string what =
            fmt::format("mesh {}, buckets of {} bytes, overlap {}", fmt::join(shape, "x"),
                        options.bucket_bytes, options.overlap);
        expect_close(train(mesh, placements, extents, sgd, 10, -1, options), sgd_reference,
                     what + " sgd");
        expect_close(train(mesh, placements, extents, adamw, 10, -1, options), adamw_reference,
                     what + " adamw");
      }
    });
  }
}

// Buckets: reverse parameter order, split at bucket_bytes; one collective per bucket per step;
// with sync off backward passes only accumulate, and the next synced one reduces the sum once.
TEST(Training, ReducerBucketsAndAccumulatesMicroBatchesWithoutCommunication) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"dp"});
    testing::CaseRng rng(83);
    const Shape shape{2, 2, 6, 5};
    const ShardTensor x = ShardTensor::distribute(
        testing::integer_tensor(shape, DType::f64, rng, -5, 5), mesh, {Placement::shard(0)});
    const ShardTensor target = ShardTensor::distribute(
        testing::integer_tensor(shape, DType::f64, rng, -5, 5), mesh, {Placement::shard(0)});
    ConvNet plain_net(mesh, 2, 4, 5), reduced_net(mesh, 2, 4, 5);
    // w1 (144 values), b1 (4), w2 (72), b2 (2) in f64: 650 bytes hold b2, w2 and b1 (624
    // bytes), not w1 too.
    nn::GradReducer reducer(reduced_net.parameters, {.bucket_bytes = 650});
    EXPECT_EQ(reducer.buckets(), (std::vector<std::vector<size_t>>{{3, 2, 1}, {0}}));
    for (int pass = 0; pass < 3; ++pass) {  // three micro-batches, reduced once
      reducer.set_sync(pass == 2);
      {
        Tape tape;
        tape.backward(plain_net.loss(x, target));
      }
      {
        Tape tape;
        tape.backward(reduced_net.loss(x, target));
      }
      if (pass < 2) {
        EXPECT_EQ(reducer.stats().collectives, 0) << "no communication while sync is off";
        reducer.finish();  // does nothing while sync is off
        EXPECT_FALSE(reduced_net.parameters[0].grad());
      }
    }
    reducer.finish();
    EXPECT_EQ(reducer.stats().collectives, 2);  // one per bucket
    EXPECT_EQ(reducer.stats().backward_passes, 1);
    for (size_t p = 0; p < plain_net.parameters.size(); ++p) {
      ASSERT_TRUE(reduced_net.parameters[p].grad());
      EXPECT_EQ(reduced_net.parameters[p].grad()->spec(),
                reduced_net.parameters[p].tensor().spec());
      const std::vector<double> got = values_of(reduced_net.parameters[p].grad()->to_local());
      const std::vector<double> expected = values_of(plain_net.parameters[p].grad()->to_local());
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_NEAR(got[i], expected[i], 1e-12 * (1 + std::fabs(expected[i])))
            << "parameter " << p << " element " << i;
    }
    // One reducer per parameter.
    EXPECT_THROW(nn::GradReducer(reduced_net.parameters), Error);
  });
}

TEST(Training, HooksFireAsSoonAsAGradientIsFinalAndBackwardReleasesSavedTensors) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2, 1});
    ConvNet net(mesh, 2, 4, 3);
    testing::CaseRng rng(4);
    const Shape shape{1, 2, 64, 64};
    const std::vector<Placement> rows{Placement::shard(2), Placement::replicate()};
    const ShardTensor x =
        ShardTensor::distribute(testing::integer_tensor(shape, DType::f64, rng, -3, 3), mesh, rows);
    const ShardTensor target =
        ShardTensor::distribute(testing::integer_tensor(shape, DType::f64, rng, -3, 3), mesh, rows);
    // w2 (used last in forward) is final before backward reaches the first conv: w1 has no
    // gradient yet when w2's hook runs.
    std::vector<std::string> order;
    bool w1_pending_when_w2_final = false;
    GradHookHandle w2_hook = register_grad_hook(net.parameters[2].tensor().id(), [&](const auto&) {
      order.push_back("w2");
      w1_pending_when_w2_final = !net.parameters[0].grad();
    });
    GradHookHandle w1_hook = register_grad_hook(net.parameters[0].tensor().id(),
                                                [&](const auto&) { order.push_back("w1"); });
    size_t retained = 0, released = 0;
    for (bool retain : {true, false}) {
      for (Parameter& parameter : net.parameters) parameter.zero_grad();
      Tape tape;
      tape.backward(net.loss(x, target), retain);
      // The allocator's figures are the process's: both ranks (threads) measure at the same
      // point, between two barriers, so neither is caught halfway through its backward.
      comm->barrier();
      (retain ? retained : released) = host_allocator_stats().in_use;
      comm->barrier();
      if (!retain) {
        EXPECT_THROW(tape.backward(net.loss(x, target)), Error);
      }
    }
    EXPECT_EQ(order, (std::vector<std::string>{"w2", "w1", "w2", "w1"}));
    EXPECT_TRUE(w1_pending_when_w2_final);
    // The retained tape still holds the haloed inputs and activations of both convs (several
    // tensors of 1 x 4 x 34 x 64 f64 per rank, 70 KiB each); the released one does not.
    EXPECT_GT(retained, released + 4 * 60 * 1024) << retained << " vs " << released;
  });
}

TEST(Training, OptimizersMatchPyTorch) {
  std::ifstream file(std::string(TESSERA_FIXTURE_DIR) + "/optim/optim_fixtures.json");
  ASSERT_TRUE(file) << "tests/fixtures/optim/optim_fixtures.json";
  const Json fixtures = Json::parse(file);
  const std::vector<double> initial = fixtures["initial"];
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    for (const Json& fixture : fixtures["cases"]) {
      const std::string name = fixture["optimizer"];
      const Json& options = fixture["options"];
      Parameter p(
          ShardTensor::distribute(f64_values(initial, {12}), mesh, {Placement::replicate()}), "p");
      std::unique_ptr<optim::Optimizer> optimizer;
      if (name == "sgd") {
        optimizer = std::make_unique<optim::Sgd>(
            std::vector<Parameter>{p},
            optim::SgdOptions{.lr = options.value("lr", 1e-3),
                              .momentum = options.value("momentum", 0.0),
                              .dampening = options.value("dampening", 0.0),
                              .weight_decay = options.value("weight_decay", 0.0),
                              .nesterov = options.value("nesterov", false),
                              .maximize = options.value("maximize", false)});
      } else {
        optim::AdamOptions adam{.lr = options.value("lr", 1e-3),
                                .beta1 = options.value("beta1", 0.9),
                                .beta2 = options.value("beta2", 0.999),
                                .eps = options.value("eps", 1e-8),
                                .amsgrad = options.value("amsgrad", false)};
        if (options.contains("weight_decay")) adam.weight_decay = options["weight_decay"];
        if (name == "adam")
          optimizer = std::make_unique<optim::Adam>(std::vector<Parameter>{p}, adam);
        else
          optimizer = std::make_unique<optim::AdamW>(std::vector<Parameter>{p}, adam);
      }
      for (size_t step = 0; step < fixture["after"].size(); ++step) {
        const std::vector<double> g = fixtures["grads"][step];
        p.set_grad(ShardTensor::distribute(f64_values(g, {12}), mesh, {Placement::replicate()}));
        optimizer->step();
        const std::vector<double> expected = fixture["after"][step];
        const std::vector<double> got = values_of(p.tensor().to_local());
        for (size_t i = 0; i < expected.size(); ++i)
          EXPECT_NEAR(got[i], expected[i], 1e-12 * (1 + std::fabs(expected[i])))
              << name << " " << options.dump() << " step " << step << " element " << i;
      }
    }
    // clip_grad_norm_ of two gradients.
    const Json& clip = fixtures["clip"];
    Parameter a(
        ShardTensor::distribute(Tensor::zeros({12}, DType::f64), mesh, {Placement::replicate()}));
    Parameter b(
        ShardTensor::distribute(Tensor::zeros({5}, DType::f64), mesh, {Placement::replicate()}));
    const std::vector<double> g0 = fixtures["grads"][0], g1 = fixtures["grads"][1];
    a.set_grad(ShardTensor::distribute(f64_values(g0, {12}), mesh, {Placement::replicate()}));
    b.set_grad(ShardTensor::distribute(f64_values({g1.begin(), g1.begin() + 5}, {5}), mesh,
                                       {Placement::replicate()}));
    const double norm = optim::clip_grad_norm({a, b}, clip["max_norm"]);
    EXPECT_NEAR(norm, clip["norm"].get<double>(), 1e-12);
    const std::vector<double> a_clipped = clip["a"], b_clipped = clip["b"];
    const std::vector<double> a_got = values_of(a.grad()->to_local());
    const std::vector<double> b_got = values_of(b.grad()->to_local());
    for (size_t i = 0; i < a_clipped.size(); ++i) EXPECT_NEAR(a_got[i], a_clipped[i], 1e-14);
    for (size_t i = 0; i < b_clipped.size(); ++i) EXPECT_NEAR(b_got[i], b_clipped[i], 1e-14);
  });
}

TEST(Training, ClipGradNormCountsEveryElementOnceOnAnyLayout) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {comm->size()});
    testing::CaseRng rng(testing::case_seed(71, comm->size(), 0, 0));
    const Tensor full = testing::integer_tensor({9, 4}, DType::f64, rng, -9, 9);
    double squares = 0;
    for (double value : values_of(full)) squares += value * value;
    for (const Placement& placement : {Placement::shard(0), Placement::replicate()}) {
      Parameter p(ShardTensor::distribute(Tensor::zeros({9, 4}, DType::f64), mesh, {placement}));
      p.set_grad(ShardTensor::distribute(full, mesh, {placement}));
      EXPECT_NEAR(optim::clip_grad_norm({p}, 1e9), std::sqrt(squares), 1e-12 * squares)
          << placement.str();
      const double clipped = optim::clip_grad_norm({p}, 1.0);
      EXPECT_NEAR(clipped, std::sqrt(squares), 1e-9);
      double after = 0;
      for (double value : values_of(p.grad()->full_tensor())) after += value * value;
      EXPECT_NEAR(std::sqrt(after), 1.0, 1e-6);
    }
  });
}

TEST(Training, LearningRateSchedules) {
  EXPECT_DOUBLE_EQ(optim::warmup_cosine_lr(0, 1.0, 4, 10), 0.25);
  EXPECT_DOUBLE_EQ(optim::warmup_cosine_lr(3, 1.0, 4, 10), 1.0);
  EXPECT_DOUBLE_EQ(optim::warmup_cosine_lr(4, 1.0, 4, 10), 1.0);
  EXPECT_NEAR(optim::warmup_cosine_lr(7, 1.0, 4, 10, 0.1), 0.1 + 0.9 * 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(optim::warmup_cosine_lr(10, 1.0, 4, 10, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(optim::step_lr(0, 0.5, 3, 0.1), 0.5);
  EXPECT_DOUBLE_EQ(optim::step_lr(5, 0.5, 3, 0.1), 0.05);
  EXPECT_THROW(optim::warmup_cosine_lr(0, 1.0, 5, 4), Error);
  EXPECT_THROW(optim::step_lr(0, 1.0, 0, 0.5), Error);
}

TEST(Training, BadInputIsOneClearError) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    EXPECT_THROW(Parameter(ShardTensor::distribute(Tensor::zeros({2}, DType::f64), mesh,
                                                   {Placement::partial(ReduceOp::sum)})),
                 Error);
    Parameter p(
        ShardTensor::distribute(Tensor::zeros({3}, DType::f64), mesh, {Placement::replicate()}));
    EXPECT_THROW(p.set_grad(ShardTensor::distribute(Tensor::zeros({4}, DType::f64), mesh,
                                                    {Placement::replicate()})),
                 Error);
    EXPECT_THROW(optim::Sgd({p}, {.lr = -1}), Error);
    EXPECT_THROW(optim::Sgd({p}, {.lr = 0.1, .nesterov = true}), Error);
    optim::Adam adam({p}, {});
    p.set_grad(
        ShardTensor::distribute(Tensor::zeros({3}, DType::f64), mesh, {Placement::replicate()}));
    adam.step();
    auto state = adam.state_dict();
    EXPECT_EQ(state.count("0.exp_avg"), 1u);
    state.emplace("0.velocity", state.at("0.exp_avg"));
    EXPECT_THROW(adam.load_state_dict(state), Error);
  });
}

}  // namespace
}  // namespace tessera
