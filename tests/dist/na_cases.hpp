// Random sharded neighborhood attention cases (geometry, options, bias, placements and extents)
// and their run through the tape, shared by the cpu sweep (na_sharded_test.cpp) and the cuda one
// (tests/gpu/na_gpu_test.cpp); and random single-rank kernel calls (a query piece and the key tile
// its windows read), shared by the cuda kernel tests and the emulated mma kernel tests
// (tests/unit/na_mma_emulated_test.cpp).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/autograd.hpp"
#include "ops/attention/na_cuda_plan.hpp"
#include "ops/attention/na_reference.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera::testing {

struct NaCase {
  Shape shape;  // [B, X.., heads, D]
  ops::NaOptions options;
  bool rpb = false;
  bool v_replicated = false;  // v arrives in another layout than q (the rule moves it)
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;

  std::string str() const {
    std::vector<std::string> names;
    for (const Placement& placement : placements) names.push_back(placement.str());
    return fmt::format("shape {} kernel {} dilation {} causal {} rpb {} placements [{}] extents {}",
                       shape, options.kernel_size, options.dilation, options.causal, rpb,
                       fmt::join(names, ", "), extents);
  }
};

/// Extents of n over `parts` made of empty and one-element shards, the rest on one part.
inline std::vector<int64_t> thin_extents(int64_t n, int parts, CaseRng& rng) {
  std::vector<int64_t> extents(parts, 0);
  int64_t left = n;
  for (int p = 0; p < parts && left > 0; ++p)
    if (rng.chance(0.6)) {
      extents[p] = 1;
      --left;
    }
  extents[rng.uniform(0, parts - 1)] += left;
  return extents;
}

inline NaCase random_na_case(const std::vector<int>& mesh_shape, CaseRng& rng) {
  NaCase c;
  const int spatial = static_cast<int>(rng.uniform(1, 3));
  const int64_t max_length = spatial == 1 ? 16 : spatial == 2 ? 9 : 6;
  c.shape.push_back(rng.uniform(1, 2));
  c.options.kernel_size.clear();
  c.options.dilation.clear();
  c.options.causal.clear();
  bool rpb_allowed = true;
  for (int a = 0; a < spatial; ++a) {
    const int64_t kernel = rng.uniform(1, spatial == 3 ? 3 : 5);
    const int64_t dilation = rng.chance(0.5) ? 1 : rng.uniform(2, 3);
    const int64_t causal = rng.chance(0.3) ? 1 : 0;
    c.shape.push_back(std::max(kernel * dilation, rng.uniform(1, max_length)));
    c.options.kernel_size.push_back(kernel);
    c.options.dilation.push_back(dilation);
    c.options.causal.push_back(causal);
    rpb_allowed = rpb_allowed && !causal && kernel % 2 == 1;
  }
  c.shape.push_back(rng.uniform(1, 2));  // heads
  c.shape.push_back(rng.uniform(1, 3));  // D
  c.rpb = rpb_allowed && rng.chance(0.5);
  if (rng.chance(0.2)) c.options.scale = 0.3 + 0.1 * static_cast<double>(rng.uniform(0, 5));
  c.v_replicated = rng.chance(0.15);
  // Mesh dims shard distinct spatial dims, sometimes the batch or the heads dim, or replicate.
  const int heads_dim = spatial + 1;
  std::vector<bool> used(c.shape.size(), false);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    const double pick = std::uniform_real_distribution<double>(0, 1)(rng.engine());
    const int dim = pick < 0.12  ? 0
                    : pick < 0.2 ? heads_dim
                                 : static_cast<int>(rng.uniform(1, spatial));
    if (used[dim] || rng.chance(0.1)) {
      c.placements.push_back(Placement::replicate());
      c.extents.emplace_back();
      continue;
    }
    used[dim] = true;
    c.placements.push_back(Placement::shard(dim));
    const double kind = std::uniform_real_distribution<double>(0, 1)(rng.engine());
    c.extents.push_back(kind < 0.3   ? default_split(c.shape[dim], mesh_shape[m])
                        : kind < 0.6 ? thin_extents(c.shape[dim], mesh_shape[m], rng)
                                     : testing::random_extents(c.shape[dim], mesh_shape[m], rng));
  }
  return c;
}

struct NaData {
  Tensor q, k, v, rpb, go, glse;
};

inline Tensor random_na_tensor(const Shape& shape, CaseRng& rng) {
  std::normal_distribution<double> normal;
  Tensor tensor = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.data<double>()[i] = normal(rng.engine());
  return tensor;
}

/// Forward and gradients on `mesh`: o, lse, dq, dk, dv (and d rpb), full tensors as f64 on the
/// cpu. Every rank's pieces of the inputs are in `dtype` on `device` (lse and its gradient in
/// f32 for f16/bf16).
inline std::vector<Tensor> run_na_case(const NaCase& c, const DeviceMesh& mesh, const NaData& data,
                                       bool sharded, DType dtype = DType::f64,
                                       Device device = Device::cpu()) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  auto placed = [&](const ShardTensor& t, DType as) {
    return ShardTensor(t.to_local().to_dtype(as).to(device), t.mesh(), t.spec());
  };
  auto layout = [&](const Tensor& t, bool keep_replicated) {
    return placed(sharded && !keep_replicated
                      ? ShardTensor::distribute(t, mesh, c.placements, c.extents)
                      : ShardTensor::distribute(t, mesh, replicated),
                  dtype);
  };
  Tape tape;
  ShardTensor q = layout(data.q, false).set_requires_grad();
  ShardTensor k = layout(data.k, false).set_requires_grad();
  ShardTensor v = layout(data.v, c.v_replicated).set_requires_grad();
  ops::NaOptions options = c.options;
  if (c.rpb)
    options.rpb =
        placed(ShardTensor::distribute(data.rpb, mesh, replicated), dtype).set_requires_grad();
  const ops::NaResult result = ops::neighborhood_attention(q, k, v, options);
  // loss = sum(o * go) + sum(lse * glse): gradients reach both outputs. For f16/bf16 lse is f32
  // while o is not, so the first sum is cast to lse's dtype before the two are added (add takes
  // one dtype; cast's gradient is the f32 one cast back, exactly 1 here).
  const ShardTensor go = placed(ShardTensor::distribute(data.go, mesh, result.output.placements(),
                                                        result.output.spec().extents),
                                dtype);
  const ShardTensor glse = placed(
      ShardTensor::distribute(data.glse, mesh, result.lse.placements(), result.lse.spec().extents),
      result.lse.dtype());
  tape.backward(ops::add(ops::cast(ops::sum(ops::mul(result.output, go)), result.lse.dtype()),
                         ops::sum(ops::mul(result.lse, glse))));
  auto full = [](const ShardTensor& t) {
    return t.full_tensor().to(Device::cpu()).to_dtype(DType::f64);
  };
  std::vector<Tensor> results{full(result.output), full(result.lse), full(*tape.grad(q)),
                              full(*tape.grad(k)), full(*tape.grad(v))};
  EXPECT_EQ(tape.grad(k)->spec(), k.spec()) << "dk comes back in k's layout";
  if (c.rpb) {
    EXPECT_EQ(tape.grad(*options.rpb)->placements(), replicated)
        << "d rpb is reduced to replicated exactly once";
    results.push_back(full(*tape.grad(*options.rpb)));
  }
  return results;
}

/// The inputs of a case: q, k, v, rpb, go, glse drawn from a standard normal.
inline NaData random_na_data(const NaCase& c, CaseRng& rng) {
  Shape lse_shape = c.shape;
  lse_shape.pop_back();
  Shape rpb_shape{c.shape[c.shape.size() - 2]};
  for (int64_t kernel : c.options.kernel_size) rpb_shape.push_back(2 * kernel - 1);
  return NaData{random_na_tensor(c.shape, rng), random_na_tensor(c.shape, rng),
                random_na_tensor(c.shape, rng), random_na_tensor(rpb_shape, rng),
                random_na_tensor(c.shape, rng), random_na_tensor(lse_shape, rng)};
}

/// A random single-rank kernel call: 1-d, 2-d or 3-d; odd and even kernels, dilation, causal
/// axes; a query piece [first, last) per axis (half the time the whole axis) and the key tile
/// [lo, hi) its windows read; whether a bias fits (no causal axis, odd kernels) and is drawn.
struct NaKernelCall {
  ops::NaGeometry geometry;
  ops::NaPieces pieces;
  Shape full;  ///< [B, extents.., heads, dim]
  std::vector<int64_t> query_end, key_end;
  int64_t heads = 1;
  bool has_rpb = false;

  /// The call's piece of a full tensor: the query piece (q, go) or the key tile (k, v).
  Tensor piece(const Tensor& full_tensor, bool keys) const {
    Tensor t = full_tensor;
    for (size_t a = 0; a < query_end.size(); ++a) {
      const int dim = 1 + static_cast<int>(a);
      t = keys ? t.slice(dim, pieces.key_offset[a], key_end[a])
               : t.slice(dim, pieces.query_offset[a], query_end[a]);
    }
    return t.contiguous();
  }
  std::string str(const Tensor& q, const Tensor& k, DType dtype) const {
    return fmt::format(
        "q {} (piece at {}) tile {} (at {}) kernel {} dilation {} causal {} rpb {} {}", q.shape(),
        pieces.query_offset, k.shape(), pieces.key_offset, geometry.kernel, geometry.dilation,
        geometry.causal, has_rpb, dtype_name(dtype));
  }
};

inline NaKernelCall random_na_kernel_call(CaseRng& rng, int64_t dim) {
  NaKernelCall c;
  const int spatial = static_cast<int>(rng.uniform(1, 3));
  const int64_t max_length = spatial == 1 ? 150 : spatial == 2 ? 21 : 9;
  c.full = Shape{rng.uniform(1, 2)};
  bool rpb_allowed = true;
  for (int a = 0; a < spatial; ++a) {
    const int64_t kernel = rng.uniform(1, spatial == 3 ? 4 : 9);
    const int64_t dilation = rng.chance(0.6) ? 1 : rng.uniform(2, 3);
    const int64_t causal = rng.chance(0.25) ? 1 : 0;
    const int64_t length = std::max(kernel * dilation, rng.uniform(1, max_length));
    c.full.push_back(length);
    c.geometry.extent.push_back(length);
    c.geometry.kernel.push_back(kernel);
    c.geometry.dilation.push_back(dilation);
    c.geometry.causal.push_back(causal);
    rpb_allowed = rpb_allowed && !causal && kernel % 2 == 1;
  }
  c.heads = rng.uniform(1, 3);
  c.full.push_back(c.heads);
  c.full.push_back(dim);
  c.geometry.scale = 1.0 / std::sqrt(static_cast<double>(dim));
  c.has_rpb = rpb_allowed && rng.chance(0.5);
  for (int a = 0; a < spatial; ++a) {
    const int64_t length = c.full[1 + a];
    int64_t first = 0, last = length;
    if (rng.chance(0.5)) {
      first = rng.uniform(0, length - 1);
      last = rng.uniform(first + 1, length);
    }
    ops::kernels::NaAxis axis;
    axis.length = length;
    axis.kernel = c.geometry.kernel[a];
    axis.dilation = c.geometry.dilation[a];
    axis.causal = static_cast<int>(c.geometry.causal[a]);
    int64_t lo, hi;
    ops::kernels::na_axis_key_range(axis, first, last, lo, hi);
    c.pieces.query_offset.push_back(first);
    c.query_end.push_back(last);
    c.pieces.key_offset.push_back(lo);
    c.key_end.push_back(hi);
  }
  return c;
}

}  // namespace tessera::testing
