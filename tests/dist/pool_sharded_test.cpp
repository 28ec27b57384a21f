// Sharded pooling: for a seeded sweep of random cases (max_pool and avg_pool, 1/2/3-d, kernels
// 1..4, strides below, equal to and above the kernel, padding up to half the kernel, dilation,
// ceil_mode, count_include_pad, divisor_override; 1-d..3-d meshes of 1..8 ranks sharding spatial,
// batch and channel dims with uneven, empty and thinner-than-the-halo shards), the sharded
// forward and dx (through the autograd tape) equal the same code run unsharded on one rank; dx
// matches central finite differences (avg_pool, and max_pool with no ties); bad attributes
// throw one error tagged with the op.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/op_cases.hpp"
#include "tests/dist/pool_cases.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;
using testing::PoolCase;
using testing::random_input;
using testing::random_pool_case;

/// Forward and dx on `mesh` (full tensors), x sharded as the case says or replicated.
std::vector<Tensor> run_case(const PoolCase& c, const DeviceMesh& mesh, const Tensor& x,
                             const Tensor& gy, bool sharded) {
  return testing::forward_and_grad([&](const ShardTensor& xs) { return testing::pool(c, xs); },
                                   mesh, x, gy, c.placements, c.extents, sharded);
}

/// Whether a and b (f64, one shape) hold infinities at the same places with the same signs; both
/// get zeros there, so that the finite rest can be compared (a max_pool window with no real cell
/// is -inf, as in PyTorch).
bool zero_matching_infinities(Tensor& a, Tensor& b) {
  a = a.contiguous().clone();
  b = b.contiguous().clone();
  bool same = a.shape() == b.shape();
  for (int64_t i = 0; same && i < a.numel(); ++i) {
    double& left = a.data<double>()[i];
    double& right = b.data<double>()[i];
    if (std::isinf(left) || std::isinf(right)) {
      same = left == right;
      left = right = 0.0;
    }
  }
  return same;
}

TEST(PoolSharded, RandomCasesMatchUnshardedForwardAndGradient) {
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
        CaseRng rng(testing::case_seed(61, comm->size(), static_cast<int>(mesh_index), index));
        const PoolCase c = random_pool_case(mesh.shape(), rng);
        const Tensor x = random_input(c.x_shape, rng);
        const ShardTensor probe =
            testing::pool(c, ShardTensor::distribute(x, single, {Placement::replicate()}));
        const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
        auto expected = run_case(c, single, x, gy, false);
        auto actual = run_case(c, mesh, x, gy, true);
        const char* names[] = {"y", "dx"};
        for (size_t i = 0; i < expected.size(); ++i)
          EXPECT_TRUE(zero_matching_infinities(actual[i], expected[i]) &&
                      testing::relative_error(actual[i], expected[i]) <= 1e-12)
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

// avg_pool's forward (whose windows that are whole along the last dim run side by side) gives,
// bit for bit, each window's real cells summed in window order and divided by its divisor: 2-d,
// f64 and f32, strides 1 and 2, padding with and without count_include_pad.
TEST(PoolSharded, AvgPoolEqualsWindowSumsInWindowOrderBitForBit) {
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    const std::vector<Placement> replicated{Placement::replicate()};
    std::mt19937_64 engine(5);
    std::uniform_real_distribution<double> uniform(-1.0, 1.0);
    const int64_t planes = 3, rows = 9, columns = 37;
    Tensor x = Tensor::empty({1, planes, rows, columns}, DType::f64);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<double>()[i] = uniform(engine);
    for (DType dtype : {DType::f64, DType::f32})
      for (int64_t stride : {1, 2})
        for (int64_t padding : {0, 1})
          for (bool include_pad : {true, false}) {
            ops::PoolOptions options;
            options.kernel_size = {3};
            options.stride = {stride};
            options.padding = {padding};
            options.count_include_pad = include_pad;
            const Tensor input = x.to_dtype(dtype);
            const Tensor y =
                ops::avg_pool(ShardTensor::distribute(input, mesh, replicated), options)
                    .full_tensor()
                    .to_dtype(DType::f64);
            const int64_t out_rows = (rows + 2 * padding - 3) / stride + 1;
            const int64_t out_columns = (columns + 2 * padding - 3) / stride + 1;
            ASSERT_EQ(y.shape(), (Shape{1, planes, out_rows, out_columns}));
            const Tensor in = input.to_dtype(DType::f64);
            int64_t differing = 0;
            for (int64_t p = 0; p < planes; ++p)
              for (int64_t i = 0; i < out_rows; ++i)
                for (int64_t j = 0; j < out_columns; ++j) {
                  // In x's dtype, as the kernel sums (f32 in float).
                  double sum64 = 0;
                  float sum32 = 0;
                  int64_t real = 0;
                  for (int64_t a = i * stride - padding; a < i * stride - padding + 3; ++a)
                    for (int64_t b = j * stride - padding; b < j * stride - padding + 3; ++b) {
                      if (a < 0 || a >= rows || b < 0 || b >= columns) continue;
                      const double value = in.data<double>()[(p * rows + a) * columns + b];
                      sum64 += value;
                      sum32 += static_cast<float>(value);
                      ++real;
                    }
                  const double divisor = include_pad ? 9.0 : static_cast<double>(real);
                  const double expected =
                      dtype == DType::f64
                          ? sum64 / divisor
                          : static_cast<double>(sum32 / static_cast<float>(divisor));
                  differing += y.data<double>()[(p * out_rows + i) * out_columns + j] != expected;
                }
            EXPECT_EQ(differing, 0) << dtype_name(dtype) << " stride " << stride << " padding "
                                    << padding << " count_include_pad " << include_pad;
          }
  });
}

// f32, f16 and bf16 (computed in float) against f64 on 2 ranks, sharded: the inputs are exact in
// every dtype, so max_pool's forward is exact and the rest is within the dtype's roundoff.
TEST(PoolSharded, LowPrecisionDtypesMatchF64WithinTheirRoundoff) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    for (int index = 0; index < 40; ++index) {
      CaseRng rng(testing::case_seed(64, 2, 0, index));
      const PoolCase c = random_pool_case(mesh.shape(), rng);
      const Tensor x = random_input(c.x_shape, rng);
      const ShardTensor probe =
          testing::pool(c, ShardTensor::distribute(x, mesh, c.placements, c.extents));
      const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
      const auto reference = run_case(c, mesh, x, gy, true);
      for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
        const auto low = run_case(c, mesh, x.to_dtype(dtype), gy.to_dtype(dtype), true);
        const double bound = dtype == DType::f32 ? 1e-6 : dtype == DType::f16 ? 4e-3 : 3e-2;
        for (size_t i = 0; i < low.size(); ++i) {
          Tensor actual = low[i].to_dtype(DType::f64), expected = reference[i];
          EXPECT_TRUE(zero_matching_infinities(actual, expected) &&
                      testing::relative_error(actual, expected) <= (c.max && i == 0 ? 0 : bound))
              << (i == 0 ? "y " : "dx ") << dtype_name(dtype) << " " << c.str();
        }
      }
    }
  });
}

// Ties, NaN and -inf as torch.nn.functional.max_pool1d (1.13) treats them, on 1 rank and sharded
// over 2 (values, indices and gradients below are PyTorch's, gy = 1, 2, 3, ...): the first
// maximum in window order wins a tie, the last NaN wins over everything, and a window whose real
// cells are all -inf has its first real cell as its index and sends its gradient there.
TEST(PoolSharded, MaxPoolTiesNaNAndInfinityFollowPyTorch) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::vector<double> x;
    int64_t kernel, padding;
    std::vector<double> y, gx;
    std::vector<int64_t> indices;
  };
  const std::vector<Case> cases{{{1, 3, 3, 2}, 3, 0, {3, 3}, {0, 3, 0, 0}, {1, 1}},
                                {{1, nan, 3, nan, 2, 0},
                                 3,
                                 1,
                                 {nan, nan, nan, nan, nan, 2},
                                 {0, 3, 0, 12, 6, 0},
                                 {1, 1, 3, 3, 3, 4}},
                                {{-inf, -inf, 5, -inf, -inf, -inf},
                                 2,
                                 1,
                                 {-inf, -inf, 5, 5, -inf, -inf, -inf},
                                 {3, 0, 7, 5, 6, 7},
                                 {0, 0, 2, 2, 3, 4, 5}}};
  for (int world : {1, 2}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh mesh(comm, {world});
      for (const Case& c : cases) {
        const int64_t length = static_cast<int64_t>(c.x.size());
        PoolCase pool_case;
        pool_case.x_shape = {1, 1, length};
        pool_case.options =
            ops::PoolOptions{.kernel_size = {c.kernel}, .stride = {1}, .padding = {c.padding}};
        pool_case.placements = {Placement::shard(2)};
        pool_case.extents = {world == 1 ? std::vector<int64_t>{length}
                                        : std::vector<int64_t>{length / 2, length - length / 2}};
        const Tensor x = Tensor::from_values<double>({1, 1, length}, c.x);
        const int64_t outputs = static_cast<int64_t>(c.y.size());
        std::vector<double> g(outputs);
        for (int64_t i = 0; i < outputs; ++i) g[i] = static_cast<double>(i + 1);
        const auto result =
            run_case(pool_case, mesh, x, Tensor::from_values<double>({1, 1, outputs}, g), true);
        const Tensor y = result[0].contiguous(), gx = result[1].contiguous();
        for (int64_t i = 0; i < outputs; ++i) {
          const double value = y.data<double>()[i];
          EXPECT_TRUE(std::isnan(c.y[i]) ? std::isnan(value) : value == c.y[i])
              << "y[" << i << "] = " << value << " on " << world << " rank(s)";
        }
        for (int64_t i = 0; i < length; ++i)
          EXPECT_EQ(gx.data<double>()[i], c.gx[i]) << "gx[" << i << "] on " << world << " rank(s)";
        const ShardTensor indices =
            ops::max_pool_with_indices(
                ShardTensor::distribute(x, mesh, pool_case.placements, pool_case.extents),
                pool_case.options)
                .second;
        const Tensor full = indices.full_tensor().contiguous();
        EXPECT_EQ(std::vector<int64_t>(full.data<int64_t>(), full.data<int64_t>() + full.numel()),
                  c.indices)
            << "indices on " << world << " rank(s)";
      }
    });
  }
}

/// max_pool's index of every output of `c` on the full x, computed the plain way: per (n, c)
/// plane and output, the window's cells in order (padding skipped), the first maximum or the last
/// NaN, the first real cell when all are -inf, -1 with no real cell; flat in the spatial plane.
std::vector<int64_t> reference_indices(const PoolCase& c, const Tensor& x, const Shape& y_shape) {
  const Tensor input = x.contiguous();
  const int spatial = static_cast<int>(c.x_shape.size()) - 2;
  const auto option = [&](const std::vector<int64_t>& values, int i, int64_t fallback) {
    return values.empty() ? fallback : values[values.size() == 1 ? 0 : i];
  };
  int64_t in_plane = 1, out_plane = 1;
  for (int i = 0; i < spatial; ++i) {
    in_plane *= c.x_shape[2 + i];
    out_plane *= y_shape[2 + i];
  }
  std::vector<int64_t> indices;
  for (int64_t p = 0; p < c.x_shape[0] * c.x_shape[1]; ++p)
    for (int64_t o = 0; o < out_plane; ++o) {
      // The output's coordinates, then every kernel cell in window order.
      std::vector<int64_t> out(spatial), kernel(spatial), start(spatial);
      int64_t rest = o, cells = 1;
      for (int i = spatial - 1; i >= 0; --i) {
        out[i] = rest % y_shape[2 + i];
        rest /= y_shape[2 + i];
        kernel[i] = option(c.options.kernel_size, i, 1);
        start[i] =
            out[i] * option(c.options.stride, i, kernel[i]) - option(c.options.padding, i, 0);
        cells *= kernel[i];
      }
      double best = -std::numeric_limits<double>::infinity();
      int64_t arg = -1;
      for (int64_t k = 0; k < cells; ++k) {
        int64_t krest = k, flat = 0, scale = 1;
        bool real = true;
        for (int i = spatial - 1; i >= 0; --i) {
          const int64_t t = krest % kernel[i];
          krest /= kernel[i];
          const int64_t at = start[i] + t * option(c.options.dilation, i, 1);
          real = real && at >= 0 && at < c.x_shape[2 + i];
          flat += at * scale;
          scale *= c.x_shape[2 + i];
        }
        if (!real) continue;
        const double value = input.data<double>()[p * in_plane + flat];
        if (arg < 0 || value > best || std::isnan(value)) {
          arg = flat;
          best = value;
        }
      }
      indices.push_back(arg);
    }
  return indices;
}

// max_pool's indices (PyTorch's return_indices: the flat index of each window's maximum in the
// global input's spatial plane): for a seeded sweep of max cases on every mesh of 1..8 ranks, the
// sharded indices equal the ones computed the plain way on the full input, they are i64 and take
// no gradient, and y is x at the indices.
TEST(PoolSharded, MaxPoolIndicesAreTheGlobalArgmaxOnEveryLayout) {
  int total_cases = 0;
  testing::run_every_world([&](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    int cases = 0;
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < testing::cases_per_mesh(comm->size(), 60); ++index) {
        CaseRng rng(testing::case_seed(67, comm->size(), static_cast<int>(mesh_index), index));
        const PoolCase c = random_pool_case(mesh.shape(), rng);
        if (!c.max) continue;
        ++cases;
        const Tensor x = random_input(c.x_shape, rng);
        ShardTensor xs = ShardTensor::distribute(x, mesh, c.placements, c.extents);
        xs.set_requires_grad();
        Tape tape;
        const auto [y, indices] = ops::max_pool_with_indices(xs, c.options);
        EXPECT_EQ(indices.dtype(), DType::i64);
        EXPECT_FALSE(indices.requires_grad());
        EXPECT_EQ(indices.spec(), y.spec());
        const Tensor full = indices.full_tensor().contiguous();
        const std::vector<int64_t> expected = reference_indices(c, x, y.global_shape());
        EXPECT_EQ(std::vector<int64_t>(full.data<int64_t>(), full.data<int64_t>() + full.numel()),
                  expected)
            << "case " << index << " mesh " << testing::shape_str(mesh.shape()) << " " << c.str();
        // y is x at the indices (-inf where a window has no real cell).
        const Tensor y_full = y.full_tensor().contiguous();
        const int64_t out_plane = y_full.numel() / (c.x_shape[0] * c.x_shape[1]);
        const int64_t in_plane = x.numel() / (c.x_shape[0] * c.x_shape[1]);
        int64_t wrong = 0;
        for (int64_t o = 0; o < y_full.numel(); ++o) {
          const int64_t at = expected[o];
          const double value = at < 0 ? -std::numeric_limits<double>::infinity()
                                      : x.data<double>()[(o / out_plane) * in_plane + at];
          wrong += y_full.data<double>()[o] != value;
        }
        EXPECT_EQ(wrong, 0) << "case " << index << " " << c.str();
      }
    }
    if (comm->rank() == 0) total_cases += cases;
  });
  if (!testing::mpi_backend()) {
    EXPECT_GE(total_cases, 200);
  }
}

/// sum(pool(x) * gy) for the full x, on `mesh` with x laid out as the case says.
double loss_of(const PoolCase& c, const DeviceMesh& mesh, const Tensor& x, const Tensor& gy) {
  const ShardTensor y = testing::pool(c, ShardTensor::distribute(x, mesh, c.placements, c.extents));
  const Tensor full = y.full_tensor().contiguous();
  double loss = 0.0;
  for (int64_t i = 0; i < full.numel(); ++i) loss += full.data<double>()[i] * gy.data<double>()[i];
  return loss;
}

// Central differences of sum(pool(x) * gy) against dx on 2 ranks (x sharded along the last
// spatial dim, uneven): avg_pool everywhere, max_pool on distinct values spaced far wider than
// the step (no ties, so the maximum never changes hands).
TEST(PoolSharded, GradientMatchesCentralFiniteDifferences) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    int checked = 0;
    for (int index = 0; index < 12; ++index) {
      CaseRng rng(testing::case_seed(62, 2, 0, index));
      PoolCase c;
      c.max = index % 2 == 0;
      const int spatial = 1 + (index / 2) % 3;
      c.x_shape = {2, 2};
      c.options.kernel_size.clear();
      c.options.padding.clear();
      c.options.dilation.clear();
      for (int i = 0; i < spatial; ++i) {
        const int64_t kernel = rng.uniform(2, 3);
        c.x_shape.push_back(spatial == 3 ? 4 : 7);
        c.options.kernel_size.push_back(kernel);
        c.options.stride.push_back(rng.uniform(1, 3));
        c.options.padding.push_back(rng.uniform(0, 1));
        c.options.dilation.push_back(c.max ? rng.uniform(1, 2) : 1);
      }
      c.options.ceil_mode = index % 4 < 2;
      c.options.count_include_pad = index % 3 != 0;
      const int last = static_cast<int>(c.x_shape.size()) - 1;
      c.placements = {Placement::shard(last)};
      c.extents = {{c.x_shape[last] - 2, 2}};
      // Distinct values: a random permutation of 0..n-1, scaled.
      const int64_t count = shape_numel(c.x_shape);
      std::vector<double> values(count);
      std::iota(values.begin(), values.end(), 0.0);
      std::mt19937_64 shuffle(static_cast<uint64_t>(index) + 5);
      std::shuffle(values.begin(), values.end(), shuffle);
      Tensor x = Tensor::empty(c.x_shape, DType::f64);
      for (int64_t i = 0; i < count; ++i) x.data<double>()[i] = values[i] * 0.01 - 0.3;
      const ShardTensor probe =
          testing::pool(c, ShardTensor::distribute(x, mesh, c.placements, c.extents));
      const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
      const Tensor dx = run_case(c, mesh, x, gy, true)[1].contiguous();
      const double step = 1e-6;
      double worst = 0.0;
      for (int64_t i = 0; i < count; ++i) {
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

std::string error_of(bool max, const Shape& shape, const ops::PoolOptions& options) {
  return testing::error_of(shape, [&](const ShardTensor& x) {
    return max ? ops::max_pool(x, options) : ops::avg_pool(x, options);
  });
}

TEST(PoolSharded, BadAttributesThrowOneErrorNamingTheOpAndTheAttribute) {
  using ::testing::HasSubstr;
  using ::testing::StartsWith;
  auto options = [](std::vector<int64_t> kernel, std::vector<int64_t> stride,
                    std::vector<int64_t> padding, std::vector<int64_t> dilation) {
    ops::PoolOptions result;
    result.kernel_size = std::move(kernel);
    result.stride = std::move(stride);
    result.padding = std::move(padding);
    result.dilation = std::move(dilation);
    return result;
  };
  EXPECT_THAT(error_of(true, {1, 1, 8}, options({3}, {}, {2}, {1})),
              AllOf(StartsWith("[max_pool]"), HasSubstr("'padding'")));
  EXPECT_THAT(error_of(true, {1, 1, 8}, options({0}, {}, {0}, {1})),
              AllOf(StartsWith("[max_pool]"), HasSubstr("'kernel_size'")));
  EXPECT_THAT(error_of(true, {1, 1, 8}, options({2}, {0}, {0}, {1})),
              AllOf(StartsWith("[max_pool]"), HasSubstr("'stride'")));
  EXPECT_THAT(error_of(true, {1, 1, 8}, options({2}, {}, {0}, {0})),
              AllOf(StartsWith("[max_pool]"), HasSubstr("'dilation'")));
  EXPECT_THAT(error_of(true, {1, 1, 8, 8}, options({2, 2, 2}, {}, {0}, {1})),
              AllOf(StartsWith("[max_pool]"), HasSubstr("'kernel_size'")));
  EXPECT_THAT(error_of(true, {1, 1, 3}, options({3}, {}, {0}, {2})),
              AllOf(StartsWith("[max_pool]"), HasSubstr("too small")));
  EXPECT_THAT(error_of(true, {1, 8}, options({2}, {}, {0}, {1})),
              AllOf(StartsWith("[max_pool]"), HasSubstr("[N, C, spatial..]")));
  EXPECT_THAT(error_of(false, {1, 1, 8}, options({2}, {}, {0}, {2})),
              AllOf(StartsWith("[avg_pool]"), HasSubstr("dilation")));
  ops::PoolOptions negative = options({2}, {}, {0}, {1});
  negative.divisor_override = -1;
  EXPECT_THAT(error_of(false, {1, 1, 8}, negative),
              AllOf(StartsWith("[avg_pool]"), HasSubstr("'divisor_override'")));
}

// The sweep of the gpu test (tests/gpu/pool_gpu_test.cpp, same seed) with the cpu in the
// device's place: its cases include max_pool windows with no real cell, whose y is -inf on both
// sides, and the comparison must accept those (and only equal infinities).
TEST(PoolSharded, TheGpuSweepOnTheCpuAcceptsWindowsWithNoRealCell) {
  testing::expect_cuda_sweep_matches_cpu(
      63, Device::cpu(),
      [](const std::vector<int>& mesh, CaseRng& rng) { return random_pool_case(mesh, rng); },
      [](const Shape& shape, CaseRng& rng) { return random_input(shape, rng); },
      [](const auto& c, const ShardTensor& x) { return testing::pool(c, x); });
  // One case of that sweep: along H (2 cells, padding 1, dilation 3) the only window reads
  // cells -1 and 2, both padding, so y holds -inf.
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    PoolCase c;
    c.x_shape = {2, 3, 5, 2, 5};
    c.options.kernel_size = {3, 2, 3};
    c.options.padding = {0, 1, 1};
    c.options.dilation = {2, 3, 3};
    c.options.ceil_mode = true;
    CaseRng rng(5);
    const Tensor y = testing::pool(c, ShardTensor::distribute(random_input(c.x_shape, rng), mesh,
                                                              {Placement::replicate()}))
                         .full_tensor();
    int64_t infinite = 0;
    for (int64_t i = 0; i < y.numel(); ++i)
      infinite += y.data<double>()[i] == -std::numeric_limits<double>::infinity();
    EXPECT_EQ(infinite, y.numel());
    EXPECT_EQ(testing::relative_error(y, y.clone()), 0.0);
  });
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> base{-inf, 1.0, 2.0};
  const Tensor reference = Tensor::from_values<double>({3}, base);
  EXPECT_EQ(testing::relative_error(reference, reference), 0.0);
  const std::vector<double> close{-inf, 1.0, 2.0 + 2e-12};
  EXPECT_NEAR(testing::relative_error(Tensor::from_values<double>({3}, close), reference), 1e-12,
              1e-15);
  for (const std::vector<double>& wrong :
       {std::vector<double>{inf, 1.0, 2.0}, std::vector<double>{0.0, 1.0, 2.0},
        std::vector<double>{-inf, -inf, 2.0}})
    EXPECT_EQ(testing::relative_error(Tensor::from_values<double>({3}, wrong), reference), inf);
  const std::vector<double> nan{-inf, std::numeric_limits<double>::quiet_NaN(), 2.0};
  EXPECT_TRUE(
      std::isnan(testing::relative_error(Tensor::from_values<double>({3}, nan), reference)));
}

}  // namespace
}  // namespace tessera
