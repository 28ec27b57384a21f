// ops::permute: a relabelling of the layout. On meshes of 1..4 ranks with uneven shards of any
// dims (empty shards included), the result equals the permuted tensor exactly, each mesh dim
// shards the output dim its input dim moved to with the same extents (no communication), and the
// gradient of sum(permute(x) * g) is g permuted back, exactly.
#include <gtest/gtest.h>

#include <random>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

/// `x` (contiguous f64) permuted by plain loops: output dim i is input dim dims[i].
Tensor permuted(const Tensor& x, const std::vector<int64_t>& dims) {
  Shape shape;
  for (int64_t d : dims) shape.push_back(x.shape(static_cast<int>(d)));
  Tensor out = Tensor::empty(shape, DType::f64);
  const std::vector<int64_t> strides = contiguous_strides(x.shape());
  std::vector<int64_t> index(shape.size(), 0);
  for (int64_t flat = 0; flat < out.numel(); ++flat) {
    int64_t source = 0;
    for (size_t i = 0; i < dims.size(); ++i) source += index[i] * strides[dims[i]];
    out.data<double>()[flat] = x.data<double>()[source];
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

Tensor random_tensor(const Shape& shape, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  Tensor t = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = normal(rng);
  return t;
}

TEST(PermuteSharded, RelabelsTheLayoutAndMatchesTheUnshardedResultAndGradient) {
  const std::vector<std::vector<int64_t>> perms = {{0, 2, 3, 1}, {0, 3, 1, 2}, {3, 2, 1, 0},
                                                   {1, 0, 2, 3}, {0, 1, 2, 3}, {-1, 0, 1, 2}};
  for (int world = 1; world <= 4; ++world) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      std::mt19937 rng(world);
      const std::vector<int> mesh_shape =
          world == 4 ? std::vector<int>{2, 2} : std::vector<int>{world};
      DeviceMesh mesh(comm, mesh_shape);
      const Shape shape{2, 5, 3, 4};
      for (const std::vector<int64_t>& perm : perms)
        for (int first = 0; first < 4; ++first) {
          const Tensor x_full = random_tensor(shape, rng);
          std::vector<Placement> placements;
          std::vector<std::vector<int64_t>> extents;
          for (int m = 0; m < mesh.ndim(); ++m) {
            const int dim = (first + 2 * m) % 4;
            placements.push_back(Placement::shard(dim));
            extents.push_back(testing::lopsided(shape[dim], mesh.size(m)));
          }
          ShardTensor x = ShardTensor::distribute(x_full, mesh, placements, extents);
          x.set_requires_grad();
          Tape tape;
          const ShardTensor y = ops::permute(x, perm);
          std::vector<int64_t> dims;
          for (int64_t d : perm) dims.push_back(d < 0 ? d + 4 : d);
          const std::string where = fmt::format("perm {} first {} on {} ranks", perm, first, world);
          EXPECT_EQ(bitwise_equal(y.full_tensor(), permuted(x_full, dims)), true) << where;
          // No data moved: every shard's dim moved, its extents kept.
          for (int m = 0; m < mesh.ndim(); ++m) {
            EXPECT_TRUE(y.placements()[m].is_shard()) << where;
            EXPECT_EQ(dims[y.placements()[m].dim], placements[m].dim) << where;
            EXPECT_EQ(y.spec().extents[m], x.spec().extents[m]) << where;
          }
          EXPECT_EQ(y.to_local().numel(), x.to_local().numel()) << where;
          const Tensor g_full = random_tensor(y.global_shape(), rng);
          const ShardTensor g =
              ShardTensor::distribute(g_full, mesh, y.placements(), y.spec().extents);
          tape.backward(ops::sum(ops::mul(y, g)));
          std::vector<int64_t> inverse(4);
          for (int64_t i = 0; i < 4; ++i) inverse[dims[i]] = i;
          ASSERT_TRUE(tape.grad(x)) << where;
          EXPECT_TRUE(bitwise_equal(tape.grad(x)->full_tensor(), permuted(g_full, inverse)))
              << where;
        }
    });
  }
}

TEST(PermuteSharded, BadDimsAreOneErrorNamingTheAttribute) {
  testing::run_world(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    const ShardTensor x =
        ShardTensor::distribute(Tensor::zeros({2, 3}, DType::f64), mesh, {Placement::replicate()});
    for (const std::vector<int64_t>& dims :
         {std::vector<int64_t>{0}, std::vector<int64_t>{0, 0}, std::vector<int64_t>{0, 2}}) {
      try {
        ops::permute(x, dims);
        ADD_FAILURE() << "expected an error for " << fmt::format("{}", dims);
      } catch (const InvalidArgument& error) {
        EXPECT_EQ(std::string(error.what()).rfind("[permute] attribute 'dims' = [", 0), 0u)
            << error.what();
      }
    }
  });
}

}  // namespace
}  // namespace tessera
