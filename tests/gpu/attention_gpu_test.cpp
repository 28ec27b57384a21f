// The attention cuda kernels on a GPU (skipped, with the reason printed, when none is visible):
// random cases (causal or not, cross attention, uneven and empty sequence shards, zigzag rings)
// sharded over 1, 2 and 4 local ranks sharing the GPU, o, lse and the gradients of q, k, v
// against the cpu op on one rank: f64 within 1e-12 (the backward's atomic adds sum in another
// order), f32 within 1e-4, f16 and bf16 within their roundoff.
#include <gtest/gtest.h>

#include <cmath>

#include "core/autograd.hpp"
#include "core/gpu_runtime.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;

#define SKIP_WITHOUT_GPU()                                                                    \
  if (gpu::device_count() == 0)                                                               \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the attention cuda " \
                  "kernel tests need a GPU"

Tensor random_tensor(const Shape& shape, CaseRng& rng) {
  Tensor t = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data<double>()[i] = static_cast<double>(rng.uniform(-1000, 1000)) / 700.0;
  return t;
}

/// o, lse, dq, dk, dv (full, f64 on the cpu) with q, k, v in `dtype` on `device`, the sequence
/// sharded with `extents` (empty: replicated).
std::vector<Tensor> run(const DeviceMesh& mesh, const std::vector<Tensor>& values,
                        const std::vector<std::vector<int64_t>>& extents, const Tensor& go,
                        const Tensor& glse, const ops::AttentionOptions& options, DType dtype,
                        Device device) {
  auto placed = [&](const ShardTensor& t) {
    return ShardTensor(t.to_local().to_dtype(dtype).to(device), t.mesh(), t.spec());
  };
  Tape tape;
  std::vector<ShardTensor> in;
  for (size_t i = 0; i < 3; ++i) {
    in.push_back(placed(
        extents[i].empty()
            ? ShardTensor::distribute(values[i], mesh, {Placement::replicate()})
            : ShardTensor::distribute(values[i], mesh, {Placement::shard(1)}, {extents[i]})));
    in.back().set_requires_grad();
  }
  const auto out = ops::attention(in[0], in[1], in[2], options);
  const ShardTensor gos =
      placed(ShardTensor::distribute(go, mesh, out[0].placements(), out[0].spec().extents));
  const ShardTensor glses =
      placed(ShardTensor::distribute(glse, mesh, out[1].placements(), out[1].spec().extents));
  tape.backward(ops::add(ops::sum(ops::mul(out[0], gos)), ops::sum(ops::mul(out[1], glses))));
  std::vector<Tensor> results{out[0].full_tensor(), out[1].full_tensor()};
  for (const ShardTensor& input : in) results.push_back(tape.grad(input)->full_tensor());
  for (Tensor& t : results) t = t.to(Device::cpu()).to_dtype(DType::f64);
  return results;
}

/// Largest |a - b| relative to 1 + max|b| (equal infinities count as equal).
double relative_error(const Tensor& a, const Tensor& b) {
  double worst = 0, largest = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    const double x = a.data<double>()[i], y = b.data<double>()[i];
    if (std::isinf(x) && x == y) continue;
    largest = std::max(largest, std::fabs(y));
    worst = std::max(worst, std::isfinite(x - y) ? std::fabs(x - y) : 1e300);
  }
  return worst / (1 + largest);
}

TEST(AttentionGpu, ShardedOnCudaMatchesCpuOneRankEveryDtype) {
  SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (const int world : {1, 2, 4})
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      DeviceMesh mesh(comm, {comm->size()});
      for (int index = 0; index < testing::sweep_cases(10); ++index) {
        CaseRng rng(testing::case_seed(89, world, 0, index));
        const int64_t b = rng.uniform(1, 2), h = rng.uniform(1, 3), d = rng.uniform(1, 40),
                      dv = rng.uniform(1, 40), sq = rng.uniform(0, 70);
        const int64_t sk = rng.chance(0.7) ? sq : rng.uniform(0, 70);
        ops::AttentionOptions options;
        options.causal = rng.chance(0.6);
        if (rng.chance(0.3)) options.scale = static_cast<double>(rng.uniform(1, 20)) / 10.0;
        const std::vector<Tensor> values{random_tensor({b, sq, h, d}, rng),
                                         random_tensor({b, sk, h, d}, rng),
                                         random_tensor({b, sk, h, dv}, rng)};
        const Tensor go = random_tensor({b, sq, h, dv}, rng);
        const Tensor glse = random_tensor({b, sq, h}, rng);
        const std::vector<std::vector<int64_t>> extents{testing::random_extents(sq, world, rng),
                                                        testing::random_extents(sk, world, rng),
                                                        testing::random_extents(sk, world, rng)};
        const std::vector<std::vector<int64_t>> replicated(3);
        for (const DType dtype : {DType::f64, DType::f32, DType::f16, DType::bf16}) {
          const auto expected =
              run(single, values, replicated, go, glse, options, dtype, Device::cpu());
          const auto actual = run(mesh, values, extents, go, glse, options, dtype, gpu);
          const double bound = dtype == DType::f64   ? 1e-12
                               : dtype == DType::f32 ? 1e-4
                               : dtype == DType::f16 ? 2e-2
                                                     : 1e-1;
          const char* names[] = {"o", "lse", "dq", "dk", "dv"};
          for (size_t r = 0; r < expected.size(); ++r)
            EXPECT_LE(relative_error(actual[r], expected[r]), bound)
                << names[r] << " " << dtype_name(dtype) << " world " << world << " q [" << b << ", "
                << sq << ", " << h << ", " << d << "] sk " << sk << " dv " << dv << " causal "
                << options.causal;
        }
      }
    });
}

}  // namespace
}  // namespace tessera
