// Sharded transposed convolution: for a seeded sweep of random cases (conv_transpose1d/2d/3d,
// kernels 1..4, stride 1..3 below, equal to and above the kernel, padding, output_padding,
// dilation, groups, bias; 1-d..3-d meshes, uneven, empty and thin shards, batch sharding), the
// sharded forward and every gradient (dx, dw, db through the autograd tape) equal the same code
// run unsharded on one rank; the gradients match central finite differences; the geometry of a
// rank's piece (conv_transpose_span) and the output ownership (upsampled_output_extents) agree
// with brute force; bad attributes throw one error tagged with the op.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "core/autograd.hpp"
#include "ops/op_helpers.hpp"
#include "ops/ops.hpp"
#include "tests/dist/conv_cases.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;
using testing::ConvTransposeCase;
using testing::random_conv_transpose_case;

/// Forward and gradients on `mesh`: y, dx, dw[, db] (full tensors).
std::vector<Tensor> run_case(const ConvTransposeCase& c, const DeviceMesh& mesh, const Tensor& x,
                             const Tensor& w, const Tensor& b, const Tensor& gy, bool sharded) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  Tape tape;
  ShardTensor xs = sharded ? ShardTensor::distribute(x, mesh, c.placements, c.extents)
                           : ShardTensor::distribute(x, mesh, replicated);
  xs.set_requires_grad();
  ShardTensor ws = ShardTensor::distribute(w, mesh, replicated);
  ws.set_requires_grad();
  std::optional<ShardTensor> bs;
  if (c.bias) bs = ShardTensor::distribute(b, mesh, replicated).set_requires_grad();
  const ShardTensor y = ops::conv_transpose(xs, ws, bs, c.options);
  // loss = sum(y * gy), so d loss / dy = gy.
  const ShardTensor gys = ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents);
  tape.backward(ops::sum(ops::mul(y, gys)));
  std::vector<Tensor> results{y.full_tensor(), tape.grad(xs)->full_tensor(),
                              tape.grad(ws)->full_tensor()};
  EXPECT_EQ(tape.grad(xs)->spec(), xs.spec()) << "dx comes back in x's layout";
  EXPECT_EQ(tape.grad(ws)->placements(), replicated) << "dw is reduced to replicated exactly once";
  if (c.bias) results.push_back(tape.grad(*bs)->full_tensor());
  return results;
}

/// The global output shape of a case.
Shape output_shape(const ConvTransposeCase& c) {
  Shape shape{c.x_shape[0], c.w_shape[1] * c.options.groups};
  for (size_t i = 0; i + 2 < c.x_shape.size(); ++i)
    shape.push_back(ops::conv_transpose_extent(c.x_shape[2 + i], c.w_shape[2 + i],
                                               c.options.stride[i], c.options.padding[i],
                                               c.options.dilation[i], c.options.output_padding[i]));
  return shape;
}

TEST(ConvTransposeSharded, RandomCasesMatchUnshardedForwardAndGradients) {
  int total_cases = 0;
  testing::run_every_world([&](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    // The unsharded reference runs the same code on a one-rank mesh of this rank alone.
    auto self = comm->split(comm->rank(), 0);
    DeviceMesh single(self, {1});
    int cases = 0;
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < testing::cases_per_mesh(comm->size(), 45); ++index, ++cases) {
        CaseRng rng(testing::case_seed(71, comm->size(), static_cast<int>(mesh_index), index));
        const ConvTransposeCase c = random_conv_transpose_case(mesh.shape(), rng);
        const Tensor x = testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
        const Tensor w = testing::integer_tensor(c.w_shape, DType::f64, rng, -3, 3);
        const Tensor b =
            testing::integer_tensor({c.w_shape[1] * c.options.groups}, DType::f64, rng, -3, 3);
        const Tensor gy = testing::integer_tensor(output_shape(c), DType::f64, rng, -3, 3);
        const auto expected = run_case(c, single, x, w, b, gy, false);
        const auto actual = run_case(c, mesh, x, w, b, gy, true);
        const char* names[] = {"y", "dx", "dw", "db"};
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

// f32 (on cpu through oneDNN's conv data and weight gradients when it is built in) against f64,
// sharded on 2 ranks: integer inputs, so f64 is exact and f32 is within its roundoff.
TEST(ConvTransposeSharded, F32MatchesF64) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    for (int index = 0; index < 40; ++index) {
      CaseRng rng(testing::case_seed(74, 2, 0, index));
      const ConvTransposeCase c = random_conv_transpose_case(mesh.shape(), rng);
      const Tensor x = testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
      const Tensor w = testing::integer_tensor(c.w_shape, DType::f64, rng, -3, 3);
      const Tensor b =
          testing::integer_tensor({c.w_shape[1] * c.options.groups}, DType::f64, rng, -3, 3);
      const Tensor gy = testing::integer_tensor(output_shape(c), DType::f64, rng, -3, 3);
      const auto reference = run_case(c, mesh, x, w, b, gy, true);
      const auto low = run_case(c, mesh, x.to_dtype(DType::f32), w.to_dtype(DType::f32),
                                b.to_dtype(DType::f32), gy.to_dtype(DType::f32), true);
      for (size_t i = 0; i < low.size(); ++i)
        EXPECT_LE(testing::relative_error(low[i].to_dtype(DType::f64), reference[i]), 1e-6)
            << i << " " << c.str();
    }
  });
}

/// sum(conv_transpose(x, w, b) * gy) on one rank.
double loss_of(const ConvTransposeCase& c, const DeviceMesh& mesh, const Tensor& x, const Tensor& w,
               const Tensor& b, const Tensor& gy) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  std::optional<ShardTensor> bs;
  if (c.bias) bs = ShardTensor::distribute(b, mesh, replicated);
  const ShardTensor y =
      ops::conv_transpose(ShardTensor::distribute(x, mesh, replicated),
                          ShardTensor::distribute(w, mesh, replicated), bs, c.options);
  return ops::sum(ops::mul(y, ShardTensor::distribute(gy, mesh, replicated)))
      .full_tensor()
      .item_as_double({});
}

TEST(ConvTransposeSharded, GradientsMatchCentralFiniteDifferences) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    auto self = comm->split(comm->rank(), 0);
    DeviceMesh single(self, {1});
    for (int index = 0; index < 9; ++index) {
      CaseRng rng(testing::case_seed(72, 2, 0, index));
      ConvTransposeCase c = random_conv_transpose_case(mesh.shape(), rng);
      c.bias = true;
      const Tensor x = testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
      const Tensor w = testing::integer_tensor(c.w_shape, DType::f64, rng, -3, 3);
      const Tensor b =
          testing::integer_tensor({c.w_shape[1] * c.options.groups}, DType::f64, rng, -3, 3);
      const Tensor gy = testing::integer_tensor(output_shape(c), DType::f64, rng, -3, 3);
      // The analytic gradients come from the sharded op (the layout of the case).
      const auto analytic = run_case(c, mesh, x, w, b, gy, true);
      const Tensor* operands[] = {&x, &w, &b};
      const char* names[] = {"dx", "dw", "db"};
      const double step = 1e-6;
      for (int k = 0; k < 3; ++k) {
        const Tensor grad = analytic[1 + k].contiguous();
        double worst = 0.0;
        for (int64_t i = 0; i < operands[k]->numel(); ++i) {
          Tensor plus = operands[k]->clone(), minus = operands[k]->clone();
          plus.data<double>()[i] += step;
          minus.data<double>()[i] -= step;
          auto with = [&](const Tensor& changed) {
            return loss_of(c, single, k == 0 ? changed : x, k == 1 ? changed : w,
                           k == 2 ? changed : b, gy);
          };
          const double numeric = (with(plus) - with(minus)) / (2 * step);
          worst = std::max(worst, std::fabs(numeric - grad.data<double>()[i]));
        }
        EXPECT_LT(worst, 1e-6) << names[k] << " " << c.str();
      }
    }
  });
}

// conv_transpose_span against brute force: the inputs whose taps land in [out_lo, out_hi) lie in
// [in_lo, in_hi), which is the formula of docs/ops.md clipped to [0, L); the conv of the piece maps
// the outputs padded by (pad_lo, pad_hi) to exactly in_hi - in_lo inputs, and input i's tap j lands
// on local output i*s - p + j*d - out_lo in that conv's coordinates.
TEST(ConvTransposeGeometry, SpanMatchesBruteForce) {
  CaseRng rng(7301);
  int checked = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const int64_t length = rng.uniform(1, 9), kernel = rng.uniform(1, 4);
    const int64_t stride = rng.uniform(1, 4), dilation = rng.uniform(1, 3);
    const int64_t output_padding = rng.uniform(0, std::max(stride, dilation) - 1);
    const int64_t padding = rng.uniform(0, 3);
    const int64_t outputs =
        ops::conv_transpose_extent(length, kernel, stride, padding, dilation, output_padding);
    if (outputs < 1) continue;
    const int64_t out_lo = rng.uniform(0, outputs);
    const int64_t out_hi = rng.uniform(out_lo, outputs);
    const ops::ConvTransposeSpan span =
        ops::conv_transpose_span(length, kernel, stride, padding, dilation, out_lo, out_hi);
    const std::string where = fmt::format("L {} k {} s {} p {} d {} outputs [{}, {})", length,
                                          kernel, stride, padding, dilation, out_lo, out_hi);
    ASSERT_LE(0, span.in_lo) << where;
    ASSERT_LE(span.in_lo, span.in_hi) << where;
    ASSERT_LE(span.in_hi, length) << where;
    int64_t first = length, last = -1;
    for (int64_t i = 0; i < length; ++i)
      for (int64_t j = 0; j < kernel; ++j) {
        const int64_t o = i * stride - padding + j * dilation;
        if (o < out_lo || o >= out_hi) continue;
        first = std::min(first, i);
        last = std::max(last, i);
        EXPECT_TRUE(i >= span.in_lo && i < span.in_hi) << where << " input " << i;
        // In the piece's conv: conv output (i - in_lo) reads conv input (i - in_lo)*s - pad_lo
        // + j*d, which is the local output o - out_lo.
        EXPECT_EQ((i - span.in_lo) * stride - span.pad_lo + j * dilation, o - out_lo) << where;
      }
    if (last < 0) {
      // No tap lands: the piece may still read inputs whose taps skip the box (dilation), but
      // for a box before the first tap or past the last nothing is read.
      if (out_hi <= out_lo) {
        EXPECT_EQ(span.in_lo, span.in_hi) << where;
      }
    } else {
      // The range is exactly the formula of docs/ops.md clipped to [0, L).
      const int64_t reach = dilation * (kernel - 1);
      int64_t lo = out_lo + padding - reach;
      lo = lo <= 0 ? -((-lo) / stride) : (lo + stride - 1) / stride;
      EXPECT_EQ(span.in_lo, std::max<int64_t>(lo, 0)) << where;
      EXPECT_EQ(span.in_hi, std::min<int64_t>((out_hi - 1 + padding) / stride + 1, length))
          << where;
    }
    if (span.in_hi > span.in_lo) {
      // The conv of the piece: padded outputs of exactly (m-1)*s + d*(k-1) + 1 cells give m
      // inputs.
      const int64_t padded = out_hi - out_lo + span.pad_lo + span.pad_hi;
      EXPECT_EQ(padded, (span.in_hi - span.in_lo - 1) * stride + dilation * (kernel - 1) + 1)
          << where;
    }
    ++checked;
  }
  EXPECT_GT(checked, 3000);
}

TEST(ConvTransposeGeometry, OutputExtentIsPyTorchs) {
  // torch.nn.ConvTranspose1d: (L-1)*s - 2p + d*(k-1) + output_padding + 1.
  EXPECT_EQ(ops::conv_transpose_extent(5, 3, 2, 1, 1, 1), 10);
  EXPECT_EQ(ops::conv_transpose_extent(6, 2, 3, 0, 1, 2), 19);
  EXPECT_EQ(ops::conv_transpose_extent(7, 3, 2, 2, 2, 1), 14);
  EXPECT_EQ(ops::conv_transpose_extent(4, 2, 2, 0, 1, 0), 8);
}

// Output o goes to the part owning input clamp(floor((o + offset) / stride), 0, L-1).
TEST(ConvTransposeGeometry, UpsampledOutputOwnershipMatchesBruteForce) {
  CaseRng rng(7302);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t length = rng.uniform(1, 12), stride = rng.uniform(1, 4),
                  offset = rng.uniform(0, 4), outputs = rng.uniform(0, 40);
    const int parts = static_cast<int>(rng.uniform(1, 5));
    const std::vector<int64_t> extents = testing::random_extents(length, parts, rng);
    std::vector<int64_t> expected(parts, 0);
    for (int64_t o = 0; o < outputs; ++o) {
      int64_t input = (o + offset) / stride;
      input = std::clamp<int64_t>(input, 0, length - 1);
      int64_t start = 0;
      for (int p = 0; p < parts; ++p) {
        if (input >= start && input < start + extents[p]) {
          ++expected[p];
          break;
        }
        start += extents[p];
      }
    }
    EXPECT_EQ(ops::upsampled_output_extents(extents, length, outputs, stride, offset), expected)
        << "L " << length << " s " << stride << " offset " << offset << " outputs " << outputs
        << " extents " << fmt::format("{}", extents);
  }
}

std::string error_of(const Shape& x_shape, const Shape& w_shape, std::optional<Shape> b_shape,
                     const ops::ConvTransposeOptions& options) {
  std::string message;
  // One rank, or under mpiexec the launched world (every rank throws the same error).
  const int world = testing::mpi_backend() ? mpi_world()->size() : 1;
  testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {world});
    auto full = [&](const Shape& shape) {
      return ShardTensor::distribute(Tensor::zeros(shape, DType::f64), mesh,
                                     {Placement::replicate()});
    };
    std::optional<ShardTensor> b;
    if (b_shape) b = full(*b_shape);
    try {
      ops::conv_transpose(full(x_shape), full(w_shape), b, options);
    } catch (const InvalidArgument& error) {
      message = error.what();
    }
  });
  return message;
}

TEST(ConvTransposeSharded, BadAttributesThrowOneErrorNamingTheOpAndTheAttribute) {
  using ::testing::AllOf;
  using ::testing::HasSubstr;
  using ::testing::StartsWith;
  auto options = [](std::vector<int64_t> stride, std::vector<int64_t> padding,
                    std::vector<int64_t> output_padding, std::vector<int64_t> dilation,
                    int64_t groups) {
    ops::ConvTransposeOptions result;
    result.stride = std::move(stride);
    result.padding = std::move(padding);
    result.output_padding = std::move(output_padding);
    result.dilation = std::move(dilation);
    result.groups = groups;
    return result;
  };
  const Shape x{1, 2, 6}, w{2, 3, 3};
  EXPECT_THAT(error_of(x, w, {}, options({2}, {0}, {2}, {1}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("'output_padding'")));
  EXPECT_THAT(error_of(x, w, {}, options({1}, {0}, {1}, {1}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("'output_padding'")));
  EXPECT_THAT(error_of(x, w, {}, options({0}, {0}, {0}, {1}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("'stride'")));
  EXPECT_THAT(error_of(x, w, {}, options({1}, {0}, {0}, {0}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("'dilation'")));
  EXPECT_THAT(error_of(x, w, {}, options({1}, {-1}, {0}, {1}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("'padding'")));
  EXPECT_THAT(error_of(x, w, {}, options({1, 1}, {0}, {0}, {1}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("'stride'")));
  EXPECT_THAT(error_of(x, w, {}, options({1}, {0}, {0}, {1}, 4)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("'groups'")));
  EXPECT_THAT(error_of(x, w, {}, options({1}, {5}, {0}, {1}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("too small")));
  EXPECT_THAT(error_of(x, {3, 3, 3}, {}, options({1}, {0}, {0}, {1}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("input channels")));
  EXPECT_THAT(error_of(x, w, Shape{2}, options({1}, {0}, {0}, {1}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("bias")));
  EXPECT_THAT(error_of({1, 6}, {2, 3}, {}, options({1}, {0}, {0}, {1}, 1)),
              AllOf(StartsWith("[conv_transpose]"), HasSubstr("[N, C, spatial..]")));
}

}  // namespace
}  // namespace tessera
