// `attention` over a sharded sequence (ring attention): a seeded sweep of random cases (batch,
// sequence lengths 0..10 for queries and keys, heads, D and Dv, causal or not, scale or the
// default) on every mesh of 1..max ranks, the sequence sharded unevenly (empty shards, shards
// of one) and batch or heads sharded by other mesh dims, k and v in layouts of their own: o,
// lse and the gradients of q, k, v equal the one-rank results within 1e-12 relative in f64 and a
// dense reference written here; central finite differences check the backward.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/autograd.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;

struct AttentionCase {
  Shape q, k, v;
  ops::AttentionOptions options;
};

Tensor random_tensor(const Shape& shape, CaseRng& rng) {
  Tensor t = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data<double>()[i] = static_cast<double>(rng.uniform(-1000, 1000)) / 700.0;
  return t;
}

/// Dense attention in plain loops: o [B, Sq, H, Dv], lse [B, Sq, H].
std::pair<Tensor, Tensor> dense(const AttentionCase& c, const Tensor& q, const Tensor& k,
                                const Tensor& v) {
  const int64_t b = c.q[0], sq = c.q[1], h = c.q[2], d = c.q[3], sk = c.k[1], dv = c.v[3];
  const double scale = c.options.scale ? *c.options.scale : 1 / std::sqrt(static_cast<double>(d));
  Tensor o = Tensor::zeros({b, sq, h, dv}, DType::f64), lse = Tensor::empty({b, sq, h}, DType::f64);
  auto at = [](const Tensor& t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    const Shape& s = t.shape();
    return t.data<double>()[((i0 * s[1] + i1) * s[2] + i2) * s[3] + i3];
  };
  for (int64_t bb = 0; bb < b; ++bb)
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t hh = 0; hh < h; ++hh) {
        std::vector<double> s(sk, -std::numeric_limits<double>::infinity());
        double peak = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < sk; ++j) {
          if (c.options.causal && j > i) continue;
          s[j] = 0;
          for (int64_t e = 0; e < d; ++e) s[j] += at(q, bb, i, hh, e) * at(k, bb, j, hh, e);
          s[j] *= scale;
          peak = std::max(peak, s[j]);
        }
        double total = 0;
        for (int64_t j = 0; j < sk; ++j)
          if (s[j] > -std::numeric_limits<double>::infinity()) total += std::exp(s[j] - peak);
        lse.data<double>()[(bb * sq + i) * h + hh] = peak + std::log(total);
        for (int64_t e = 0; e < dv; ++e) {
          double sum = 0;
          for (int64_t j = 0; j < sk; ++j)
            if (s[j] > -std::numeric_limits<double>::infinity())
              sum += std::exp(s[j] - peak) / total * at(v, bb, j, hh, e);
          o.data<double>()[((bb * sq + i) * h + hh) * dv + e] = sum;
        }
      }
  return {o, lse};
}

/// Random layout of a [B, S, H, D] tensor: the sequence on one mesh dim (most of the time),
/// batch or heads on others, uneven extents with zeros.
ShardSpec random_layout(const Shape& shape, const DeviceMesh& mesh, CaseRng& rng) {
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
  std::vector<bool> used(4, false);
  for (int m = 0; m < mesh.ndim(); ++m) {
    const int dim = m == 0 && rng.chance(0.8) ? 1 : static_cast<int>(rng.uniform(0, 3));
    if (used[dim] || rng.chance(0.15)) {
      placements.push_back(Placement::replicate());
      extents.emplace_back();
      continue;
    }
    used[dim] = true;
    placements.push_back(Placement::shard(dim));
    extents.push_back(testing::random_extents(shape[dim], mesh.size(m), rng));
  }
  return ShardSpec::make(shape, mesh.shape(), placements, extents);
}

AttentionCase random_case(CaseRng& rng) {
  AttentionCase c;
  const int64_t b = rng.uniform(1, 2), h = rng.uniform(1, 3), d = rng.uniform(1, 4),
                dv = rng.uniform(1, 4), sq = rng.uniform(0, 10);
  const int64_t sk = rng.chance(0.6) ? sq : rng.uniform(0, 10);
  c.q = {b, sq, h, d};
  c.k = {b, sk, h, d};
  c.v = {b, sk, h, dv};
  c.options.causal = rng.chance(0.5);
  if (rng.chance(0.3)) c.options.scale = static_cast<double>(rng.uniform(1, 20)) / 10.0;
  return c;
}

/// o, lse and the gradients of q, k, v of sum(o * go) + sum(lse * glse) on `mesh`.
std::vector<Tensor> run(const AttentionCase& c, const DeviceMesh& mesh,
                        const std::vector<Tensor>& values, const std::vector<ShardSpec>& layouts,
                        const Tensor& go, const Tensor& glse) {
  Tape tape;
  std::vector<ShardTensor> in;
  for (size_t i = 0; i < 3; ++i) {
    in.push_back(
        ShardTensor::distribute(values[i], mesh, layouts[i].placements, layouts[i].extents));
    in.back().set_requires_grad();
  }
  const auto out = ops::attention(in[0], in[1], in[2], c.options);
  const ShardTensor gos =
      ShardTensor::distribute(go, mesh, out[0].placements(), out[0].spec().extents);
  const ShardTensor glses =
      ShardTensor::distribute(glse, mesh, out[1].placements(), out[1].spec().extents);
  tape.backward(ops::add(ops::sum(ops::mul(out[0], gos)), ops::sum(ops::mul(out[1], glses))));
  std::vector<Tensor> results{out[0].full_tensor(), out[1].full_tensor()};
  for (const ShardTensor& input : in) results.push_back(tape.grad(input)->full_tensor());
  return results;
}

/// Largest |a - b| relative to 1 + max|b| (NaN where both are NaN counts as equal).
double relative_error(const Tensor& a, const Tensor& b) {
  double worst = 0, largest = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    const double x = a.data<double>()[i], y = b.data<double>()[i];
    if (std::isnan(x) && std::isnan(y)) continue;
    if (std::isinf(x) && x == y) continue;
    largest = std::max(largest, std::fabs(y));
    worst = std::max(worst, std::isfinite(x - y) ? std::fabs(x - y) : 1e300);
  }
  return worst / (1 + largest);
}

TEST(RingAttention, ShardedEqualsOneRankAndDenseForwardAndBackward) {
  int compared = 0;
  testing::run_every_world([&](std::shared_ptr<Comm> comm) {
    DeviceMesh single(comm->split(comm->rank(), 0), {1});
    const auto meshes = testing::mesh_factorizations(comm->size(), 2);
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < 12; ++index) {
        CaseRng rng(testing::case_seed(81, comm->size(), static_cast<int>(mesh_index), index));
        const AttentionCase c = random_case(rng);
        const std::vector<Tensor> values{random_tensor(c.q, rng), random_tensor(c.k, rng),
                                         random_tensor(c.v, rng)};
        const Tensor go = random_tensor({c.q[0], c.q[1], c.q[2], c.v[3]}, rng);
        const Tensor glse = random_tensor({c.q[0], c.q[1], c.q[2]}, rng);
        std::vector<ShardSpec> layouts, single_layouts;
        for (const Shape& shape : {c.q, c.k, c.v}) {
          layouts.push_back(random_layout(shape, mesh, rng));
          single_layouts.push_back(ShardSpec::make(shape, {1}, {Placement::replicate()}));
        }
        const std::string where =
            fmt::format("q {} k {} v {} causal {} scale {} layouts {} / {} / {}", c.q, c.k, c.v,
                        c.options.causal, c.options.scale.value_or(-1), layouts[0].str(),
                        layouts[1].str(), layouts[2].str());
        const auto sharded = run(c, mesh, values, layouts, go, glse);
        const auto one = run(c, single, values, single_layouts, go, glse);
        for (size_t r = 0; r < sharded.size(); ++r)
          EXPECT_LT(relative_error(sharded[r], one[r]), 1e-12) << where << " result " << r;
        const auto [o, lse] = dense(c, values[0], values[1], values[2]);
        EXPECT_LT(relative_error(one[0], o), 1e-12) << where << " o vs dense";
        EXPECT_LT(relative_error(one[1], lse), 1e-12) << where << " lse vs dense";
        if (comm->rank() == 0) ++compared;
      }
    }
  });
  if (!testing::mpi_backend()) {
    EXPECT_GE(compared, 200);
  }
}

/// The sequence of `shape` sharded over a 1-d mesh with random extents (empty shards, shards of
/// one) or, now and then, the default split or replicated.
ShardSpec sequence_layout(const Shape& shape, const DeviceMesh& mesh, CaseRng& rng) {
  if (rng.chance(0.1)) return ShardSpec::make(shape, mesh.shape(), {Placement::replicate()});
  std::vector<int64_t> extents = rng.chance(0.2)
                                     ? default_split(shape[1], mesh.size(0))
                                     : testing::random_extents(shape[1], mesh.size(0), rng);
  return ShardSpec::make(shape, mesh.shape(), {Placement::shard(1)}, {extents});
}

/// A case on one sequence: batch 1..2, heads 1..3, D and Dv 1..max_d, Sq 0..max_s, Sk = Sq with
/// chance `same_keys` (else 0..max_s), causal with chance `causal`, and with chance 0.4 a scale of
/// 1..20 / scale_divisor (else the default).
AttentionCase random_sequence_case(CaseRng& rng, int64_t max_d, int64_t max_s, double same_keys,
                                   double causal, double scale_divisor) {
  AttentionCase c;
  const int64_t b = rng.uniform(1, 2), h = rng.uniform(1, 3), d = rng.uniform(1, max_d),
                dv = rng.uniform(1, max_d), sq = rng.uniform(0, max_s);
  const int64_t sk = rng.chance(same_keys) ? sq : rng.uniform(0, max_s);
  c.q = {b, sq, h, d};
  c.k = {b, sk, h, d};
  c.v = {b, sk, h, dv};
  c.options.causal = rng.chance(causal);
  if (rng.chance(0.4)) c.options.scale = static_cast<double>(rng.uniform(1, 20)) / scale_divisor;
  return c;
}

// Causal attention on a sharded sequence runs on the zigzag assignment (rows moved there and
// back inside the op): sequences of 0..23 (rarely a multiple of 2P), every rank count 1..6,
// uneven and empty shards, k and v sharded their own way; o, lse and the gradients equal one
// rank and dense attention within 1e-12 relative, causal or not.
TEST(RingAttention, ZigzagShardedEqualsOneRankAndDenseForwardAndBackward) {
  int compared = 0;
  for (int world = 1; world <= 6; ++world)
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      DeviceMesh mesh(comm, {comm->size()});
      for (int index = 0; index < 40; ++index) {
        CaseRng rng(testing::case_seed(87, comm->size(), 0, index));
        const AttentionCase c = random_sequence_case(rng, 4, 23, 0.75, 0.7, 10.0);
        const int64_t b = c.q[0], sq = c.q[1], h = c.q[2], dv = c.v[3];
        const std::vector<Tensor> values{random_tensor(c.q, rng), random_tensor(c.k, rng),
                                         random_tensor(c.v, rng)};
        const Tensor go = random_tensor({b, sq, h, dv}, rng);
        const Tensor glse = random_tensor({b, sq, h}, rng);
        std::vector<ShardSpec> layouts, single_layouts;
        for (const Shape& shape : {c.q, c.k, c.v}) {
          layouts.push_back(sequence_layout(shape, mesh, rng));
          single_layouts.push_back(ShardSpec::make(shape, {1}, {Placement::replicate()}));
        }
        const std::string where =
            fmt::format("ranks {} q {} k {} v {} causal {} scale {} layouts {} / {} / {}",
                        comm->size(), c.q, c.k, c.v, c.options.causal, c.options.scale.value_or(-1),
                        layouts[0].str(), layouts[1].str(), layouts[2].str());
        const auto sharded = run(c, mesh, values, layouts, go, glse);
        const auto one = run(c, single, values, single_layouts, go, glse);
        for (size_t r = 0; r < sharded.size(); ++r)
          EXPECT_LT(relative_error(sharded[r], one[r]), 1e-12) << where << " result " << r;
        const auto [o, lse] = dense(c, values[0], values[1], values[2]);
        EXPECT_LT(relative_error(sharded[0], o), 1e-12) << where << " o vs dense";
        EXPECT_LT(relative_error(sharded[1], lse), 1e-12) << where << " lse vs dense";
        if (comm->rank() == 0) ++compared;
      }
    });
  if (!testing::mpi_backend()) {
    EXPECT_GE(compared, 200);
  }
}

// f32 inputs run the f32 block kernels (vectorised over keys and D; the rows' running maximum,
// sum and output, dq and the travelling dk, dv stay in f64): o, lse and the gradients of q, k, v
// on 1..4 ranks (contiguous or zigzag, uneven and empty shards) equal the f64 op on one rank
// on the same values within f32 rounding (1e-5 relative to the largest value; seen: under 5e-7),
// causal or not, sequences up to 70 so that the 16-lane loops and their tails both run, D and Dv up
// to 40.
TEST(RingAttention, F32ShardedEqualsTheF64OneRankWithinF32Rounding) {
  int compared = 0;
  for (int world = 1; world <= 4; ++world)
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      DeviceMesh mesh(comm, {comm->size()});
      for (int index = 0; index < 15; ++index) {
        CaseRng rng(testing::case_seed(91, comm->size(), 0, index));
        const AttentionCase c = random_sequence_case(rng, 40, 70, 0.7, 0.5, 40.0);
        const int64_t b = c.q[0], sq = c.q[1], h = c.q[2], dv = c.v[3];
        // The values as f32 holds them, so that both runs see the same inputs.
        const auto rounded = [](const Tensor& t) { return t.to_dtype(DType::f32); };
        const std::vector<Tensor> f32{rounded(random_tensor(c.q, rng)),
                                      rounded(random_tensor(c.k, rng)),
                                      rounded(random_tensor(c.v, rng))};
        const Tensor go = rounded(random_tensor({b, sq, h, dv}, rng));
        const Tensor glse = rounded(random_tensor({b, sq, h}, rng));
        std::vector<Tensor> f64;
        for (const Tensor& t : f32) f64.push_back(t.to_dtype(DType::f64));
        std::vector<ShardSpec> layouts, single_layouts;
        for (const Shape& shape : {c.q, c.k, c.v}) {
          layouts.push_back(sequence_layout(shape, mesh, rng));
          single_layouts.push_back(ShardSpec::make(shape, {1}, {Placement::replicate()}));
        }
        const std::string where =
            fmt::format("ranks {} q {} k {} v {} causal {} layouts {}", comm->size(), c.q, c.k, c.v,
                        c.options.causal, layouts[0].str());
        const auto sharded = run(c, mesh, f32, layouts, go, glse);
        const auto exact =
            run(c, single, f64, single_layouts, go.to_dtype(DType::f64), glse.to_dtype(DType::f64));
        for (size_t r = 0; r < sharded.size(); ++r) {
          EXPECT_EQ(sharded[r].dtype(), DType::f32) << where << " result " << r;
          EXPECT_LT(relative_error(sharded[r].to_dtype(DType::f64), exact[r]), 1e-5)
              << where << " result " << r;
        }
        if (comm->rank() == 0) ++compared;
      }
    });
  if (!testing::mpi_backend()) {
    EXPECT_GE(compared, 60);
  }
}

TEST(RingAttention, GradientsEqualCentralFiniteDifferences) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    for (int index = 0; index < 6; ++index) {
      CaseRng rng(testing::case_seed(83, 1, 0, index));
      AttentionCase c = random_case(rng);
      c.q[1] = std::max<int64_t>(c.q[1], 2);
      c.k[1] = c.v[1] = std::max<int64_t>(c.k[1], 1);
      const std::vector<Tensor> values{random_tensor(c.q, rng), random_tensor(c.k, rng),
                                       random_tensor(c.v, rng)};
      const Tensor go = random_tensor({c.q[0], c.q[1], c.q[2], c.v[3]}, rng);
      const Tensor glse = random_tensor({c.q[0], c.q[1], c.q[2]}, rng);
      std::vector<ShardSpec> layouts;
      for (const Shape& shape : {c.q, c.k, c.v})
        layouts.push_back(ShardSpec::make(shape, {1}, {Placement::replicate()}));
      const auto grads = run(c, mesh, values, layouts, go, glse);
      auto loss = [&](const std::vector<Tensor>& at) {
        const auto [o, lse] = dense(c, at[0], at[1], at[2]);
        double sum = 0;
        for (int64_t i = 0; i < o.numel(); ++i) sum += o.data<double>()[i] * go.data<double>()[i];
        for (int64_t i = 0; i < lse.numel(); ++i)
          if (std::isfinite(lse.data<double>()[i]))
            sum += lse.data<double>()[i] * glse.data<double>()[i];
        return sum;
      };
      for (size_t input = 0; input < 3; ++input)
        for (int probe = 0; probe < 4; ++probe) {
          const int64_t i = rng.uniform(0, values[input].numel() - 1);
          std::vector<Tensor> plus = values, minus = values;
          plus[input] = values[input].clone();
          minus[input] = values[input].clone();
          const double h = 1e-6;
          plus[input].data<double>()[i] += h;
          minus[input].data<double>()[i] -= h;
          const double numeric = (loss(plus) - loss(minus)) / (2 * h);
          const double analytic = grads[2 + input].data<double>()[i];
          EXPECT_NEAR(analytic, numeric, 1e-6 * (1 + std::fabs(numeric)))
              << "case " << index << " input " << input << " element " << i;
        }
    }
  });
}

TEST(RingAttention, BadShapesAndAttributesAreOneError) {
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    auto t = [&](const Shape& shape) {
      return ShardTensor::distribute(Tensor::zeros(shape, DType::f64), mesh, {Placement::shard(1)});
    };
    EXPECT_THROW(ops::attention(t({1, 4, 2, 3}), t({1, 4, 2, 2}), t({1, 4, 2, 3})),
                 InvalidArgument);
    EXPECT_THROW(ops::attention(t({1, 4, 2, 3}), t({1, 5, 2, 3}), t({1, 4, 2, 3})),
                 InvalidArgument);
    EXPECT_THROW(ops::attention(t({1, 4, 2, 3}), t({1, 4, 2, 3}), t({1, 4, 2, 3}),
                                {.scale = std::numeric_limits<double>::infinity()}),
                 InvalidArgument);
  });
}

}  // namespace
}  // namespace tessera
