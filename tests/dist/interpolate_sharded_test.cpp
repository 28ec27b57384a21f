// Sharded interpolate: for a seeded sweep of random cases (1/2/3-d, nearest, nearest-exact and
// the linear modes, size or scale_factor up and down, recomputed or not, align_corners; 1-d..3-d
// meshes of 1..8 ranks sharding spatial, batch and channel dims with uneven, empty and thin
// shards), the sharded forward and dx (through the autograd tape) equal the same code run
// unsharded on one rank; the linear modes' dx matches central finite differences; f32/f16/bf16
// follow f64 within their roundoff; bad attributes throw one error tagged [interpolate].
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "ops/nn/layers.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/interpolate_cases.hpp"
#include "tests/dist/op_cases.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;
using testing::InterpolateCase;
using testing::random_interpolate_case;
using testing::random_interpolate_input;

/// Forward and dx on `mesh` (full tensors), x sharded as the case says or replicated.
std::vector<Tensor> run_case(const InterpolateCase& c, const DeviceMesh& mesh, const Tensor& x,
                             const Tensor& gy, bool sharded) {
  return testing::forward_and_grad(
      [&](const ShardTensor& xs) { return testing::interpolate(c, xs); }, mesh, x, gy, c.placements,
      c.extents, sharded);
}

TEST(InterpolateSharded, RandomCasesMatchUnshardedForwardAndGradient) {
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
        const InterpolateCase c = random_interpolate_case(mesh.shape(), rng);
        const Tensor x = random_interpolate_input(c.x_shape, rng);
        const ShardTensor probe =
            testing::interpolate(c, ShardTensor::distribute(x, single, {Placement::replicate()}));
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

// f32, f16 and bf16 (computed in float) against f64 on 2 ranks, sharded: the nearest modes copy
// (exact in every dtype), the linear ones are within the dtype's roundoff.
TEST(InterpolateSharded, LowPrecisionDtypesMatchF64WithinTheirRoundoff) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    for (int index = 0; index < 40; ++index) {
      CaseRng rng(testing::case_seed(74, 2, 0, index));
      const InterpolateCase c = random_interpolate_case(mesh.shape(), rng);
      const Tensor x = random_interpolate_input(c.x_shape, rng);
      const ShardTensor probe =
          testing::interpolate(c, ShardTensor::distribute(x, mesh, c.placements, c.extents));
      const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
      const auto reference = run_case(c, mesh, x, gy, true);
      const bool nearest = c.options.mode.rfind("nearest", 0) == 0;
      for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
        const auto low = run_case(c, mesh, x.to_dtype(dtype), gy.to_dtype(dtype), true);
        const double bound = dtype == DType::f32 ? 1e-6 : dtype == DType::f16 ? 4e-3 : 3e-2;
        for (size_t i = 0; i < low.size(); ++i)
          EXPECT_LE(testing::relative_error(low[i].to_dtype(DType::f64), reference[i]),
                    nearest && i == 0 ? 0 : bound)
              << (i == 0 ? "y " : "dx ") << dtype_name(dtype) << " " << c.str();
      }
    }
  });
}

/// sum(interpolate(x) * gy) for the full x, on `mesh` with x laid out as the case says.
double loss_of(const InterpolateCase& c, const DeviceMesh& mesh, const Tensor& x,
               const Tensor& gy) {
  const ShardTensor y =
      testing::interpolate(c, ShardTensor::distribute(x, mesh, c.placements, c.extents));
  const Tensor full = y.full_tensor().contiguous();
  double loss = 0.0;
  for (int64_t i = 0; i < full.numel(); ++i) loss += full.data<double>()[i] * gy.data<double>()[i];
  return loss;
}

// Central differences of sum(interpolate(x) * gy) against dx on 2 ranks (x sharded unevenly along
// the last spatial dim), for the linear modes: 1/2/3-d, size and scale_factor, align_corners.
TEST(InterpolateSharded, LinearGradientMatchesCentralFiniteDifferences) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    int checked = 0;
    for (int index = 0; index < 12; ++index) {
      CaseRng rng(testing::case_seed(72, 2, 0, index));
      InterpolateCase c;
      const int spatial = 1 + index % 3;
      c.x_shape = {2, 2};
      for (int i = 0; i < spatial; ++i) c.x_shape.push_back(spatial == 3 ? 4 : 6);
      c.options.mode = testing::linear_mode(spatial);
      if (index % 4 != 3) c.options.align_corners = index % 4 == 1;
      const double factors[] = {0.6, 1.7, 2.0, 2.5};
      if (index % 2 == 0) {
        for (int i = 0; i < spatial; ++i)
          c.options.scale_factor.push_back(factors[rng.uniform(0, 3)]);
      } else {
        for (int i = 0; i < spatial; ++i) c.options.size.push_back(rng.uniform(2, 9));
      }
      const int last = static_cast<int>(c.x_shape.size()) - 1;
      c.placements = {Placement::shard(last)};
      c.extents = {{c.x_shape[last] - 2, 2}};
      const Tensor x = random_interpolate_input(c.x_shape, rng);
      const ShardTensor probe =
          testing::interpolate(c, ShardTensor::distribute(x, mesh, c.placements, c.extents));
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

// nn::Upsample is interpolate with its options, without parameters, sharded as its input.
TEST(InterpolateSharded, UpsampleModuleIsInterpolate) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    CaseRng rng(73);
    const Tensor x = random_interpolate_input({1, 2, 5, 6}, rng);
    const ShardTensor xs = ShardTensor::distribute(x, mesh, {Placement::shard(3)}, {{4, 2}});
    const ops::InterpolateOptions options{
        .scale_factor = {1.7, 2.0}, .mode = "bilinear", .align_corners = false};
    nn::Upsample upsample(options);
    EXPECT_TRUE(upsample.parameters().empty());
    const ShardTensor y = upsample.forward(xs);
    EXPECT_EQ(y.global_shape(), (Shape{1, 2, 8, 12}));
    EXPECT_EQ(y.placements(), xs.placements());
    EXPECT_TRUE(bitwise_equal(y.full_tensor(), ops::interpolate(xs, options).full_tensor()));
  });
}

std::string error_of(const Shape& shape, const ops::InterpolateOptions& options) {
  return testing::error_of(shape,
                           [&](const ShardTensor& x) { return ops::interpolate(x, options); });
}

TEST(InterpolateSharded, BadAttributesThrowOneErrorNamingTheOpAndTheAttribute) {
  using ::testing::AllOf;
  using ::testing::HasSubstr;
  using ::testing::StartsWith;
  auto options = [](std::vector<int64_t> size, std::vector<double> scale, std::string mode) {
    ops::InterpolateOptions result;
    result.size = std::move(size);
    result.scale_factor = std::move(scale);
    result.mode = std::move(mode);
    return result;
  };
  const auto error = [](const std::string& attribute) {
    return AllOf(StartsWith("[interpolate]"), HasSubstr(attribute));
  };
  EXPECT_THAT(error_of({1, 1, 8}, options({4}, {2.0}, "nearest")), error("exactly one"));
  EXPECT_THAT(error_of({1, 1, 8}, options({}, {}, "nearest")), error("exactly one"));
  EXPECT_THAT(error_of({1, 1, 8}, options({4}, {}, "bilinear")), error("'mode'"));
  EXPECT_THAT(error_of({1, 1, 8, 8}, options({4}, {}, "linear")), error("'mode'"));
  EXPECT_THAT(error_of({1, 1, 8, 8, 8}, options({4}, {}, "bilinear")), error("'mode'"));
  EXPECT_THAT(error_of({1, 1, 8}, options({4}, {}, "bicubic")), error("'mode'"));
  EXPECT_THAT(error_of({1, 1, 8}, options({0}, {}, "nearest")), error("'size'"));
  EXPECT_THAT(error_of({1, 1, 8, 8}, options({4, 4, 4}, {}, "nearest")), error("'size'"));
  EXPECT_THAT(error_of({1, 1, 8}, options({}, {-2.0}, "nearest")), error("'scale_factor'"));
  EXPECT_THAT(error_of({1, 1, 8}, options({}, {0.1}, "nearest")), error("'scale_factor'"));
  EXPECT_THAT(error_of({1, 1, 8, 8}, options({}, {2, 2, 2}, "nearest")), error("'scale_factor'"));
  EXPECT_THAT(error_of({1, 8}, options({4}, {}, "nearest")), error("[N, C, spatial..]"));
  ops::InterpolateOptions corners = options({4}, {}, "nearest");
  corners.align_corners = false;
  EXPECT_THAT(error_of({1, 1, 8}, corners), error("'align_corners'"));
  ops::InterpolateOptions recompute = options({4}, {}, "linear");
  recompute.recompute_scale_factor = true;
  EXPECT_THAT(error_of({1, 1, 8}, recompute), error("'recompute_scale_factor'"));
}

}  // namespace
}  // namespace tessera
