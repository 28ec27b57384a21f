// Sharded normalizations: for a seeded sweep of random cases (group_norm, batch_norm in training
// and eval mode with and without running statistics, instance_norm, layer_norm over 1..rank
// trailing dims; 1/2/3-d; optional w and b; eps, momentum; 1-d..3-d meshes of 1..8 ranks sharding
// batch, channel, spatial and normalized dims with uneven and empty shards), the sharded forward
// (y and the running statistics) and the gradients dx, dw, db (through the autograd tape) equal
// the same code run unsharded on one rank; the statistics are bit-identical on every rank; the
// gradients match central finite differences; f32/f16/bf16 match f64 within their roundoff; bad
// attributes throw one error tagged with the op.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/dist/counting_comm.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/norm_cases.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;
using testing::NormCase;
using testing::NormInputs;

const std::vector<std::string> kResultNames{"y", "running_mean", "running_var", "dx", "dw", "db"};

/// Outputs and gradients on `mesh` (full tensors, the absent ones empty), x sharded as the case
/// says or replicated, in `dtype`: y, running_mean, running_var, dx, dw, db.
std::vector<std::optional<Tensor>> run_case(const NormCase& c, const DeviceMesh& mesh,
                                            const NormInputs& in, const Tensor& gy, bool sharded,
                                            DType dtype = DType::f64) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  Tape tape;
  ShardTensor x = sharded
                      ? ShardTensor::distribute(in.x.to_dtype(dtype), mesh, c.placements, c.extents)
                      : ShardTensor::distribute(in.x.to_dtype(dtype), mesh, replicated);
  x.set_requires_grad();
  auto param = [&](const std::optional<Tensor>& value, bool grad) -> std::optional<ShardTensor> {
    if (!value) return std::nullopt;
    ShardTensor result = ShardTensor::distribute(value->to_dtype(dtype), mesh, replicated);
    if (grad) result.set_requires_grad();
    return result;
  };
  const std::optional<ShardTensor> w = param(in.w, true), b = param(in.b, true);
  const std::vector<ShardTensor> outputs =
      testing::norm(c, x, w, b, param(in.running_mean, false), param(in.running_var, false));
  const ShardTensor& y = outputs[0];
  EXPECT_EQ(y.spec(), x.spec()) << "y comes back in x's layout";
  const ShardTensor gys =
      ShardTensor::distribute(gy.to_dtype(dtype), mesh, y.placements(), y.spec().extents);
  tape.backward(ops::sum(ops::mul(y, gys)));
  std::vector<std::optional<Tensor>> results{y.full_tensor(), std::nullopt, std::nullopt};
  if (outputs.size() == 3) {
    results[1] = outputs[1].full_tensor();
    results[2] = outputs[2].full_tensor();
  }
  EXPECT_EQ(tape.grad(x)->spec(), x.spec()) << "dx comes back in x's layout";
  results.push_back(tape.grad(x)->full_tensor());
  results.push_back(w ? std::optional<Tensor>(tape.grad(*w)->full_tensor()) : std::nullopt);
  results.push_back(b ? std::optional<Tensor>(tape.grad(*b)->full_tensor()) : std::nullopt);
  for (auto& result : results)
    if (result) result = result->to_dtype(DType::f64);
  return results;
}

Tensor random_gy(const NormCase& c, CaseRng& rng) {
  return testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
}

TEST(NormSharded, RandomCasesMatchUnshardedForwardAndGradient) {
  int total_cases = 0;
  testing::run_every_world([&](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    // The unsharded reference runs the same code on a one-rank mesh of this rank alone.
    auto self = comm->split(comm->rank(), 0);
    DeviceMesh single(self, {1});
    int cases = 0;
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < testing::cases_per_mesh(comm->size(), 40); ++index, ++cases) {
        CaseRng rng(testing::case_seed(71, comm->size(), static_cast<int>(mesh_index), index));
        const NormCase c = testing::random_norm_case(mesh.shape(), rng);
        const NormInputs inputs = testing::random_norm_inputs(c, rng);
        const Tensor gy = random_gy(c, rng);
        const auto expected = run_case(c, single, inputs, gy, false);
        const auto actual = run_case(c, mesh, inputs, gy, true);
        for (size_t i = 0; i < expected.size(); ++i) {
          ASSERT_EQ(actual[i].has_value(), expected[i].has_value()) << kResultNames[i];
          if (!expected[i]) continue;
          EXPECT_LE(testing::relative_error(*actual[i], *expected[i]), 1e-12)
              << kResultNames[i] << " case " << index << " mesh "
              << testing::shape_str(mesh.shape()) << " " << c.str();
        }
      }
    }
    if (comm->rank() == 0) total_cases += cases;
  });
  if (!testing::mpi_backend()) {
    EXPECT_GE(total_cases, 200);
  }
}

// The statistics reach every rank bit-identical: batch_norm's running statistics (replicated) of x
// sharded over batch and spatial dims on a 3x2 mesh, with an empty shard, are the same bits on
// every rank.
TEST(NormSharded, StatisticsAreBitIdenticalOnEveryRank) {
  testing::run_world(6, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {3, 2});
    CaseRng rng(7);
    NormCase c;
    c.op = "batch_norm";
    c.x_shape = {5, 3, 7, 9};
    c.has_running = true;
    c.placements = {Placement::shard(2), Placement::shard(0)};
    c.extents = {{4, 0, 3}, {1, 4}};
    const NormInputs in = testing::random_norm_inputs(c, rng);
    const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
    auto replicate = [&](const Tensor& t) { return ShardTensor::distribute(t, mesh, replicated); };
    const auto outputs =
        testing::norm(c, ShardTensor::distribute(in.x, mesh, c.placements, c.extents), std::nullopt,
                      std::nullopt, replicate(*in.running_mean), replicate(*in.running_var));
    for (int i = 1; i < 3; ++i) {
      const Tensor local = outputs[i].to_local().contiguous();
      Tensor root = local.clone();
      comm->broadcast(root.raw_data(), static_cast<size_t>(root.numel()), DType::f64, 0);
      EXPECT_TRUE(testing::all_ranks(*comm, bitwise_equal(local, root)))
          << kResultNames[i] << " differs between ranks";
    }
  });
}

// The backward reuses the forward's statistics: layer_norm with its normalized dim sharded over
// 2 ranks gathers the moments (count, mean, M2 per row) once, in the forward; the backward gathers
// only its two sums per row, and its gradients equal those of the same call on one rank.
TEST(NormSharded, BackwardReusesTheForwardStatistics) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    auto ledger = std::make_shared<testing::CountingComm::Ledger>();
    DeviceMesh mesh(std::make_shared<testing::CountingComm>(comm, ledger), {2});
    CaseRng rng(11);
    NormCase c;
    c.op = "layer_norm";
    c.x_shape = {4, 6};
    c.normalized_ndim = 1;
    c.has_w = c.has_b = true;
    c.placements = {Placement::shard(1)};
    c.extents = {{2, 4}};
    const NormInputs in = testing::random_norm_inputs(c, rng);
    const Tensor gy = random_gy(c, rng);
    const int64_t rows = 4, ranks = 2;
    const auto gathers_of_width = [&](int64_t width) {
      std::lock_guard lock(ledger->mutex);
      return std::count(ledger->calls.begin(), ledger->calls.end(),
                        std::pair<std::string, int64_t>{"all_gather", ranks * rows * width * 8});
    };
    const std::vector<Placement> replicated{Placement::replicate()};
    Tape tape;
    ShardTensor x = ShardTensor::distribute(in.x, mesh, c.placements, c.extents);
    x.set_requires_grad();
    ShardTensor w = ShardTensor::distribute(*in.w, mesh, replicated);
    w.set_requires_grad();
    const ShardTensor b = ShardTensor::distribute(*in.b, mesh, replicated);
    const ShardTensor y = ops::layer_norm(x, 1, w, b);
    EXPECT_EQ(gathers_of_width(3), 1) << "the forward gathers the moments once";
    // The op's other outputs: each row's mean and rstd, [4, 1], replicated over the mesh dim that
    // shards the normalized dim.
    const std::vector<ShardTensor> all =
        apply_op("layer_norm", {x}, OpAttrs().set("normalized_ndim", int64_t{1}).set("eps", c.eps));
    ASSERT_EQ(all.size(), 3u);
    const Tensor mean = all[1].full_tensor(), rstd = all[2].full_tensor();
    ASSERT_EQ(mean.shape(), (Shape{rows, 1}));
    EXPECT_TRUE(all[1].placements()[0].is_replicate());
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0, squares = 0;
      for (int64_t i = 0; i < 6; ++i) sum += in.x.data<double>()[r * 6 + i];
      const double expected_mean = sum / 6;
      for (int64_t i = 0; i < 6; ++i)
        squares += std::pow(in.x.data<double>()[r * 6 + i] - expected_mean, 2);
      EXPECT_NEAR(mean.data<double>()[r], expected_mean, 1e-12 * (1 + std::fabs(expected_mean)));
      const double expected_rstd = 1 / std::sqrt(squares / 6 + c.eps);
      EXPECT_NEAR(rstd.data<double>()[r], expected_rstd, 1e-12 * expected_rstd);
    }
    {
      std::lock_guard lock(ledger->mutex);
      ledger->calls.clear();
    }
    tape.backward(
        ops::sum(ops::mul(y, ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents))));
    EXPECT_EQ(gathers_of_width(3), 0) << "the backward gathers no moments";
    EXPECT_EQ(gathers_of_width(2), 1) << "the backward gathers its sums once";
    DeviceMesh single(comm->split(comm->rank(), 0), {1});
    const auto reference = run_case(c, single, in, gy, false);
    EXPECT_LE(testing::relative_error(tape.grad(x)->full_tensor(), *reference[3]), 1e-12) << "dx";
    EXPECT_LE(testing::relative_error(tape.grad(w)->full_tensor(), *reference[4]), 1e-12) << "dw";
  });
}

// group_norm and instance_norm reuse the forward's statistics likewise: group_norm [4, 6, 5] with
// 3 groups and its channel dim sharded over 2 ranks at 4 | 2 (group 1 split across them), and
// instance_norm with its spatial dim sharded, gather the moments once, in the forward; the
// backward gathers only its two sums per slot. The mean and rstd outputs ([N, groups] and
// [N, C], replicated over the mesh dim that shards a reduced dim) hold each slot's mean and
// 1 / sqrt(biased variance + eps), and the gradients equal those of one rank.
TEST(NormSharded, GroupAndInstanceNormBackwardReuseTheForwardStatistics) {
  for (const std::string op : {"group_norm", "instance_norm"}) {
    SCOPED_TRACE(op);
    testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
      auto ledger = std::make_shared<testing::CountingComm::Ledger>();
      DeviceMesh mesh(std::make_shared<testing::CountingComm>(comm, ledger), {2});
      CaseRng rng(12);
      NormCase c;
      c.op = op;
      c.x_shape = {4, 6, 5};
      c.groups = 3;
      c.has_w = c.has_b = true;
      const bool group = op == "group_norm";
      c.placements = {Placement::shard(group ? 1 : 2)};
      c.extents = {group ? std::vector<int64_t>{4, 2} : std::vector<int64_t>{2, 3}};
      const NormInputs in = testing::random_norm_inputs(c, rng);
      const Tensor gy = random_gy(c, rng);
      // Slots: [N, groups] for group_norm (every rank holds all groups), this rank's [N, C] for
      // instance_norm (all channels: the spatial dim is sharded).
      const int64_t n = 4, channels = 6, length = 5, ranks = 2;
      const int64_t per_slot = group ? channels / c.groups : 1;
      const int64_t slots = n * (channels / per_slot);
      const auto gathers_of_width = [&](int64_t width) {
        std::lock_guard lock(ledger->mutex);
        return std::count(ledger->calls.begin(), ledger->calls.end(),
                          std::pair<std::string, int64_t>{"all_gather", ranks * slots * width * 8});
      };
      const std::vector<Placement> replicated{Placement::replicate()};
      Tape tape;
      ShardTensor x = ShardTensor::distribute(in.x, mesh, c.placements, c.extents);
      x.set_requires_grad();
      ShardTensor w = ShardTensor::distribute(*in.w, mesh, replicated);
      w.set_requires_grad();
      const ShardTensor b = ShardTensor::distribute(*in.b, mesh, replicated);
      const ShardTensor y =
          group ? ops::group_norm(x, c.groups, w, b, c.eps) : ops::instance_norm(x, w, b, c.eps);
      EXPECT_EQ(gathers_of_width(3), 1) << "the forward gathers the moments once";
      OpAttrs attrs;
      attrs.set("eps", c.eps);
      if (group) attrs.set("groups", c.groups);
      const std::vector<ShardTensor> all = apply_op(op, {x}, attrs);
      ASSERT_EQ(all.size(), 3u);
      EXPECT_TRUE(all[1].placements()[0].is_replicate());
      EXPECT_TRUE(all[2].placements()[0].is_replicate());
      const Tensor mean = all[1].full_tensor(), rstd = all[2].full_tensor();
      ASSERT_EQ(mean.shape(), (Shape{n, channels / per_slot}));
      ASSERT_EQ(rstd.shape(), mean.shape());
      const double* values = in.x.data<double>();
      for (int64_t s = 0; s < slots; ++s) {
        // Slot s: batch s / (slots / n), channels [first, first + per_slot), all positions.
        const int64_t batch = s / (slots / n), first = (s % (slots / n)) * per_slot;
        const auto at = [&](int64_t ch, int64_t i) {
          return values[(batch * channels + ch) * length + i];
        };
        double sum = 0, squares = 0;
        for (int64_t ch = first; ch < first + per_slot; ++ch)
          for (int64_t i = 0; i < length; ++i) sum += at(ch, i);
        const double count = static_cast<double>(per_slot * length);
        const double expected_mean = sum / count;
        for (int64_t ch = first; ch < first + per_slot; ++ch)
          for (int64_t i = 0; i < length; ++i) squares += std::pow(at(ch, i) - expected_mean, 2);
        const double expected_rstd = 1 / std::sqrt(squares / count + c.eps);
        EXPECT_NEAR(mean.data<double>()[s], expected_mean, 1e-12 * (1 + std::fabs(expected_mean)))
            << "slot " << s;
        EXPECT_NEAR(rstd.data<double>()[s], expected_rstd, 1e-12 * expected_rstd) << "slot " << s;
      }
      {
        std::lock_guard lock(ledger->mutex);
        ledger->calls.clear();
      }
      tape.backward(ops::sum(
          ops::mul(y, ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents))));
      EXPECT_EQ(gathers_of_width(3), 0) << "the backward gathers no moments";
      EXPECT_EQ(gathers_of_width(2), 1) << "the backward gathers its sums once";
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      const auto reference = run_case(c, single, in, gy, false);
      EXPECT_LE(testing::relative_error(tape.grad(x)->full_tensor(), *reference[3]), 1e-12) << "dx";
      EXPECT_LE(testing::relative_error(tape.grad(w)->full_tensor(), *reference[4]), 1e-12) << "dw";
    });
  }
}

/// sum(norm(x, w, b) * gy) on `mesh` with x laid out as the case says.
double loss_of(const NormCase& c, const DeviceMesh& mesh, const NormInputs& in, const Tensor& gy) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  auto param = [&](const std::optional<Tensor>& value) -> std::optional<ShardTensor> {
    if (!value) return std::nullopt;
    return ShardTensor::distribute(*value, mesh, replicated);
  };
  const auto outputs =
      testing::norm(c, ShardTensor::distribute(in.x, mesh, c.placements, c.extents), param(in.w),
                    param(in.b), param(in.running_mean), param(in.running_var));
  const Tensor y = outputs[0].full_tensor().contiguous();
  double loss = 0.0;
  for (int64_t i = 0; i < y.numel(); ++i) loss += y.data<double>()[i] * gy.data<double>()[i];
  return loss;
}

// Central differences of sum(norm(x) * gy) against dx, dw and db on 2 ranks, every op (batch_norm
// in training and eval mode), x sharded along a reduced dim.
TEST(NormSharded, GradientMatchesCentralFiniteDifferences) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    int checked = 0;
    for (int index = 0; index < 10; ++index) {
      CaseRng rng(testing::case_seed(72, 2, 0, index));
      NormCase c;
      const char* ops[] = {"group_norm", "batch_norm", "instance_norm", "layer_norm", "batch_norm"};
      c.op = ops[index % 5];
      c.x_shape = index < 5 ? Shape{2, 4, 5} : Shape{2, 2, 3, 4};
      c.groups = 2;
      c.normalized_ndim = index < 5 ? 1 : 2;
      c.eps = 1e-3;
      c.has_w = c.has_b = true;
      c.has_running = c.op == "batch_norm";
      c.training = index % 5 != 4;
      const int last = static_cast<int>(c.x_shape.size()) - 1;
      c.placements = {Placement::shard(last)};
      c.extents = {{1, c.x_shape[last] - 1}};
      NormInputs in = testing::random_norm_inputs(c, rng);
      const Tensor gy = random_gy(c, rng);
      const auto analytic = run_case(c, mesh, in, gy, true);
      const double step = 1e-6;
      double worst = 0.0;
      // Perturbs every element of x, w and b in turn.
      Tensor* targets[] = {&in.x, &*in.w, &*in.b};
      const int grads[] = {3, 4, 5};
      for (int t = 0; t < 3; ++t) {
        const Tensor original = targets[t]->clone();
        const Tensor expected = analytic[grads[t]]->contiguous();
        for (int64_t i = 0; i < original.numel(); ++i) {
          Tensor plus = original.clone(), minus = original.clone();
          plus.data<double>()[i] += step;
          minus.data<double>()[i] -= step;
          *targets[t] = plus;
          const double up = loss_of(c, mesh, in, gy);
          *targets[t] = minus;
          const double down = loss_of(c, mesh, in, gy);
          worst = std::max(worst, std::fabs((up - down) / (2 * step) - expected.data<double>()[i]));
        }
        *targets[t] = original;
      }
      EXPECT_LT(worst, 1e-6) << c.str();
      ++checked;
    }
    EXPECT_EQ(checked, 10);
  });
}

// f32, f16 and bf16 against f64 on 2 ranks, sharded: within the dtype's roundoff (statistics
// accumulate in f64 for every dtype).
TEST(NormSharded, LowPrecisionDtypesMatchF64WithinTheirRoundoff) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    for (int index = 0; index < 40; ++index) {
      CaseRng rng(testing::case_seed(73, 2, 0, index));
      const NormCase c = testing::random_norm_case(mesh.shape(), rng);
      const NormInputs inputs = testing::random_norm_inputs(c, rng);
      const Tensor gy = random_gy(c, rng);
      const auto reference = run_case(c, mesh, inputs, gy, true);
      for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
        const auto low = run_case(c, mesh, inputs, gy, true, dtype);
        // Relative to the largest magnitude; eps = 1e-5 on near-constant planes amplifies.
        const double bound = dtype == DType::f32 ? 1e-4 : dtype == DType::f16 ? 3e-2 : 2e-1;
        for (size_t i = 0; i < low.size(); ++i) {
          if (!reference[i]) continue;
          EXPECT_LE(testing::relative_error(*low[i], *reference[i]), bound)
              << kResultNames[i] << " " << dtype_name(dtype) << " " << c.str();
        }
      }
    }
  });
}

/// The error of a call on one rank (or every rank of the launched world), "" when none.
std::string error_of(const std::string& op, const Shape& shape, const OpAttrs& attrs,
                     const std::vector<Shape>& params = {}) {
  std::string message;
  const int world = testing::mpi_backend() ? mpi_world()->size() : 1;
  testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {world});
    std::vector<ShardTensor> inputs{
        ShardTensor::distribute(Tensor::zeros(shape, DType::f64), mesh, {Placement::replicate()})};
    for (const Shape& param : params)
      inputs.push_back(ShardTensor::distribute(Tensor::zeros(param, DType::f64), mesh,
                                               {Placement::replicate()}));
    try {
      apply_op(op, inputs, attrs);
    } catch (const InvalidArgument& error) {
      message = error.what();
    }
  });
  return message;
}

TEST(NormSharded, BadAttributesThrowOneErrorNamingTheOpAndTheAttribute) {
  using ::testing::AllOf;
  using ::testing::HasSubstr;
  using ::testing::StartsWith;
  auto attrs = [](std::initializer_list<std::pair<const char*, AttrValue>> values) {
    OpAttrs result;
    for (const auto& [name, value] : values) result.set(name, value);
    return result;
  };
  EXPECT_THAT(error_of("group_norm", {2, 6, 5}, attrs({{"groups", int64_t{4}}})),
              AllOf(StartsWith("[group_norm]"), HasSubstr("'groups'"), HasSubstr("6 channels")));
  EXPECT_THAT(error_of("group_norm", {2, 6, 5}, attrs({{"groups", int64_t{0}}})),
              AllOf(StartsWith("[group_norm]"), HasSubstr("'groups'")));
  EXPECT_THAT(error_of("group_norm", {2, 6, 5}, {}),
              AllOf(StartsWith("[group_norm]"), HasSubstr("'groups'")));
  EXPECT_THAT(error_of("group_norm", {2, 6, 5}, attrs({{"groups", int64_t{2}}, {"eps", -1.0}})),
              AllOf(StartsWith("[group_norm]"), HasSubstr("'eps'")));
  EXPECT_THAT(error_of("group_norm", {2, 6, 5}, attrs({{"groups", int64_t{2}}}), {{5}}),
              AllOf(StartsWith("[group_norm]"), HasSubstr("w of shape")));
  EXPECT_THAT(error_of("layer_norm", {2, 6, 5}, attrs({{"normalized_ndim", int64_t{4}}})),
              AllOf(StartsWith("[layer_norm]"), HasSubstr("'normalized_ndim'")));
  EXPECT_THAT(error_of("layer_norm", {2, 6, 5}, attrs({{"normalized_ndim", int64_t{0}}})),
              AllOf(StartsWith("[layer_norm]"), HasSubstr("'normalized_ndim'")));
  EXPECT_THAT(error_of("layer_norm", {2, 6, 5}, {}, {{6}}),
              AllOf(StartsWith("[layer_norm]"), HasSubstr("w of shape")));
  EXPECT_THAT(error_of("instance_norm", {2, 6}, {}),
              AllOf(StartsWith("[instance_norm]"), HasSubstr("[N, C, spatial..]")));
  EXPECT_THAT(error_of("batch_norm", {2, 3, 4}, attrs({{"training", int64_t{0}}})),
              AllOf(StartsWith("[batch_norm]"), HasSubstr("running_mean")));
  EXPECT_THAT(error_of("batch_norm", {1, 3, 1}, {}),
              AllOf(StartsWith("[batch_norm]"), HasSubstr("more than 1 value per channel")));
  EXPECT_THAT(error_of("batch_norm", {2, 3, 4}, attrs({{"groups", int64_t{1}}})),
              AllOf(StartsWith("[batch_norm]"), HasSubstr("'groups'")));
}

}  // namespace
}  // namespace tessera
