// Sharded pad: for a seeded sweep of random cases (constant, reflect, replicate and circular, 1..3
// padded dims; constant with 4 and 5 too, pads up to the mode's limit; 1-d..3-d meshes of 1..8
// ranks sharding any dims with uneven, empty and thin shards), the sharded forward and dx (through
// the autograd tape) equal the same code run unsharded on one rank; dx matches central finite
// differences; bad attributes throw one error tagged [pad].
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/interpolate_cases.hpp"
#include "tests/dist/op_cases.hpp"
#include "tests/dist/pad_cases.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;
using testing::PadCase;
using testing::random_pad_case;

/// Forward and dx on `mesh` (full tensors), x sharded as the case says or replicated.
std::vector<Tensor> run_case(const PadCase& c, const DeviceMesh& mesh, const Tensor& x,
                             const Tensor& gy, bool sharded) {
  return testing::forward_and_grad([&](const ShardTensor& xs) { return testing::pad(c, xs); }, mesh,
                                   x, gy, c.placements, c.extents, sharded);
}

TEST(PadSharded, RandomCasesMatchUnshardedForwardAndGradient) {
  int total_cases = 0;
  testing::run_every_world([&](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    auto self = comm->split(comm->rank(), 0);
    DeviceMesh single(self, {1});
    int cases = 0;
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < testing::cases_per_mesh(comm->size(), 40); ++index, ++cases) {
        CaseRng rng(testing::case_seed(81, comm->size(), static_cast<int>(mesh_index), index));
        const PadCase c = random_pad_case(mesh.shape(), rng);
        const Tensor x = testing::random_interpolate_input(c.x_shape, rng);
        const ShardTensor probe =
            testing::pad(c, ShardTensor::distribute(x, single, {Placement::replicate()}));
        const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
        const auto expected = run_case(c, single, x, gy, false);
        const auto actual = run_case(c, mesh, x, gy, true);
        const char* names[] = {"y", "dx"};
        for (size_t i = 0; i < expected.size(); ++i)
          EXPECT_LE(testing::relative_error(actual[i], expected[i]), 1e-12)
              << names[i] << " case " << index << " mesh " << testing::shape_str(mesh.shape())
              << " " << c.str();
      }
    }
    if (comm->rank() == 0) total_cases += cases;
  });
  if (!testing::mpi_backend()) {
    EXPECT_GE(total_cases, 200);
  }
}

/// A constant padding of 4 or 5 dims (more than the kernels' three: the op pads in turns) of a
/// 4-d to 6-d input, pads 0..2 and now and then crops; mesh dims shard any dims with uneven,
/// empty and thin shards, or replicate.
PadCase random_many_pairs_case(const std::vector<int>& mesh_shape, CaseRng& rng) {
  PadCase c;
  const int count = static_cast<int>(rng.uniform(4, 5));
  const int rank = count + static_cast<int>(rng.uniform(0, 1));
  for (int d = 0; d < rank; ++d)
    c.x_shape.push_back(d < rank - count ? rng.uniform(1, 2) : rng.uniform(1, 4));
  for (int pair = 0; pair < count; ++pair) {
    const int64_t length = c.x_shape[rank - 1 - pair];
    int64_t lo = rng.uniform(0, 2), hi = rng.uniform(0, 2);
    if (rng.chance(0.25)) {
      lo = -rng.uniform(0, length);
      hi = -rng.uniform(0, length + lo);
    }
    c.options.pad.push_back(lo);
    c.options.pad.push_back(hi);
  }
  if (rng.chance(0.5)) c.options.value = static_cast<double>(rng.uniform(-8, 8)) / 4;
  std::vector<bool> used(c.x_shape.size(), false);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    const int dim = static_cast<int>(rng.uniform(0, rank - 1));
    if (used[dim] || rng.chance(0.1)) {
      c.placements.push_back(Placement::replicate());
      c.extents.emplace_back();
      continue;
    }
    used[dim] = true;
    c.placements.push_back(Placement::shard(dim));
    c.extents.push_back(rng.chance(0.3)
                            ? default_split(c.x_shape[dim], mesh_shape[m])
                            : testing::random_extents(c.x_shape[dim], mesh_shape[m], rng));
  }
  return c;
}

// Constant padding of 4 and 5 dims (as PyTorch allows): sharded forward and dx equal one rank,
// and the padded cells and the copied interior are what a direct loop over the global indices
// gives.
TEST(PadSharded, FourAndFivePairsConstantMatchUnshardedAndDirectLoop) {
  int total_cases = 0;
  testing::run_every_world([&](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    DeviceMesh single(comm->split(comm->rank(), 0), {1});
    int cases = 0;
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < testing::cases_per_mesh(comm->size(), 30); ++index, ++cases) {
        CaseRng rng(testing::case_seed(84, comm->size(), static_cast<int>(mesh_index), index));
        const PadCase c = random_many_pairs_case(mesh.shape(), rng);
        const Tensor x = testing::random_interpolate_input(c.x_shape, rng);
        const ShardTensor probe =
            testing::pad(c, ShardTensor::distribute(x, single, {Placement::replicate()}));
        const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
        const auto expected = run_case(c, single, x, gy, false);
        const auto actual = run_case(c, mesh, x, gy, true);
        const char* names[] = {"y", "dx"};
        for (size_t i = 0; i < expected.size(); ++i)
          EXPECT_LE(testing::relative_error(actual[i], expected[i]), 1e-12)
              << names[i] << " case " << index << " mesh " << testing::shape_str(mesh.shape())
              << " " << c.str();
        // The one-rank result against the definition: y[j] = x[j - lo] inside, else value.
        const Tensor y = expected[0].contiguous(), xc = x.contiguous();
        const Shape& ys = y.shape();
        const int rank = static_cast<int>(ys.size());
        int64_t mismatches = 0;
        for (int64_t flat = 0; flat < y.numel(); ++flat) {
          int64_t rest = flat, source = 0, stride = 1;
          bool inside = true;
          for (int d = rank - 1; d >= 0; --d) {
            const int64_t j = rest % ys[d];
            rest /= ys[d];
            const int pair = rank - 1 - d;
            const int64_t lo =
                2 * pair < static_cast<int>(c.options.pad.size()) ? c.options.pad[2 * pair] : 0;
            const int64_t t = j - lo;
            inside = inside && t >= 0 && t < c.x_shape[d];
            source += t * stride;
            stride *= c.x_shape[d];
          }
          const double want = inside ? xc.data<double>()[source] : c.options.value;
          mismatches += y.data<double>()[flat] != want;
        }
        EXPECT_EQ(mismatches, 0) << c.str();
      }
    }
    if (comm->rank() == 0) total_cases += cases;
  });
  if (!testing::mpi_backend()) {
    EXPECT_GE(total_cases, 200);
  }
}

/// sum(pad(x) * gy) for the full x, on `mesh` with x laid out as the case says.
double loss_of(const PadCase& c, const DeviceMesh& mesh, const Tensor& x, const Tensor& gy) {
  const ShardTensor y = testing::pad(c, ShardTensor::distribute(x, mesh, c.placements, c.extents));
  const Tensor full = y.full_tensor().contiguous();
  double loss = 0.0;
  for (int64_t i = 0; i < full.numel(); ++i) loss += full.data<double>()[i] * gy.data<double>()[i];
  return loss;
}

// Central differences of sum(pad(x) * gy) against dx on 2 ranks (x sharded unevenly along the
// last dim, with a shard thinner than the padding), every mode.
TEST(PadSharded, GradientMatchesCentralFiniteDifferences) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    const char* modes[] = {"constant", "reflect", "replicate", "circular"};
    int checked = 0;
    for (int index = 0; index < 12; ++index) {
      CaseRng rng(testing::case_seed(82, 2, 0, index));
      PadCase c;
      c.options.mode = modes[index % 4];
      const int count = 1 + (index / 4) % 3;
      c.x_shape = {2};
      for (int i = 0; i < count; ++i) c.x_shape.push_back(count == 3 ? 4 : 6);
      for (int i = 0; i < count; ++i) {
        c.options.pad.push_back(rng.uniform(0, 3));
        c.options.pad.push_back(rng.uniform(0, 3));
      }
      c.options.value = 0.5;
      const int last = static_cast<int>(c.x_shape.size()) - 1;
      c.placements = {Placement::shard(last)};
      c.extents = {{c.x_shape[last] - 1, 1}};
      const Tensor x = testing::random_interpolate_input(c.x_shape, rng);
      const ShardTensor probe =
          testing::pad(c, ShardTensor::distribute(x, mesh, c.placements, c.extents));
      const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
      const Tensor dx = run_case(c, mesh, x, gy, true)[1].contiguous();
      const double step = 1e-6;
      double worst = 0.0;
      for (int64_t i = 0; i < x.numel(); ++i) {
        Tensor plus = x.clone(), minus = x.clone();
        plus.data<double>()[i] += step;
        minus.data<double>()[i] -= step;
        const double numeric =
            (loss_of(c, mesh, plus, gy) - loss_of(c, mesh, minus, gy)) / (2 * step);
        worst = std::max(worst, std::fabs(numeric - dx.data<double>()[i]));
      }
      EXPECT_LT(worst, 1e-6) << c.str();
      ++checked;
    }
    EXPECT_EQ(checked, 12);
  });
}

std::string error_of(const Shape& shape, const ops::PadOptions& options) {
  return testing::error_of(shape, [&](const ShardTensor& x) { return ops::pad(x, options); });
}

TEST(PadSharded, BadAttributesThrowOneErrorNamingTheOpAndTheAttribute) {
  using ::testing::AllOf;
  using ::testing::HasSubstr;
  using ::testing::StartsWith;
  const auto error = [](const std::string& attribute) {
    return AllOf(StartsWith("[pad]"), HasSubstr(attribute));
  };
  auto options = [](std::vector<int64_t> pad, std::string mode) {
    return ops::PadOptions{.pad = std::move(pad), .mode = std::move(mode)};
  };
  EXPECT_THAT(error_of({1, 1, 8}, options({1}, "constant")), error("'pad'"));
  EXPECT_THAT(error_of({1, 1, 8}, options({}, "constant")), error("'pad'"));
  EXPECT_THAT(error_of({1, 1, 8}, options({1, 1, 1, 1, 1, 1, 1, 1}, "constant")), error("'pad'"));
  EXPECT_THAT(error_of({8}, options({1, 1, 1, 1}, "constant")), error("'pad'"));
  // Four pairs are constant mode's alone (as PyTorch).
  EXPECT_THAT(error_of({1, 1, 3, 3, 3, 3}, options({1, 1, 1, 1, 1, 1, 1, 1}, "replicate")),
              error("'pad'"));
  // Crops: a reflect or replicate dim keeps one cell at least, a constant or circular one may
  // end empty; circular does not crop one side of a dim and pad the other.
  EXPECT_THAT(error_of({1, 1, 8}, options({-5, -4}, "constant")), error("leaves -1 cells"));
  EXPECT_THAT(error_of({1, 1, 8}, options({-4, -4}, "reflect")), error("leaves 0 cells"));
  EXPECT_THAT(error_of({1, 1, 8}, options({-9, 1}, "replicate")), error("leaves 0 cells"));
  EXPECT_THAT(error_of({1, 1, 8}, options({-2, 3}, "circular")), error("cropped on one side"));
  EXPECT_THAT(error_of({1, 1, 8}, options({-(int64_t{1} << 41), 1}, "constant")), error("2^40"));
  EXPECT_THAT(error_of({1, 1, 8}, options({1, 1}, "wrap")), error("'mode'"));
  EXPECT_THAT(error_of({8}, options({1, 1}, "reflect")), error("'pad'"));
  EXPECT_THAT(error_of({1, 1, 1, 8}, options({1, 1}, "reflect")), error("'pad'"));
  EXPECT_THAT(error_of({1, 1, 4}, options({4, 0}, "reflect")), error("'reflect'"));
  EXPECT_THAT(error_of({1, 1, 4}, options({0, 5}, "circular")), error("'circular'"));
}

}  // namespace
}  // namespace tessera
