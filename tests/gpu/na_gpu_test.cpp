// The neighborhood attention cuda kernels on a GPU (skipped, with the reason printed, when none
// is visible):
//  - every PyTorch fixture (tests/fixtures/na) through ops::neighborhood_attention on cuda
//    tensors in f64 on 1, 2 and 4 local ranks sharing the GPU: o, lse and every gradient within
//    1e-10 of PyTorch;
//  - the random cases of the cpu sweep (tests/dist/na_cases.hpp) sharded over 1, 2 and 4 local
//    ranks on the GPU equal the cpu op on one rank: f64 within 1e-12, f32 within 1e-5, f16 and
//    bf16 within their roundoff (1e-2, 5e-2 of the largest value); the same with a head dim of
//    32, where f16/bf16 calls take the tensor-core kernels (mma by default);
//  - the fused kernels (forward and backward) equal the plain kernels and the reference on the
//    same inputs (1-d/2-d/3-d, odd and even kernels, dilation, causal, rpb, extents not multiples
//    of the tile, query pieces with key tiles at offsets);
//  - the plain kernels equal the reference in f64 and f32 on such pieces, head dims on and off
//    the tiled sizes;
//  - the mma kernels (S, P and the accumulators in registers): the forward equals the reference
//    and the fused forward on the same kind of cases, and the mma backward from its output and
//    lse equals the reference's; the sharded sweep and the determinism test run them as the
//    default, and the fused kernels under TESSERA_NA_CUDA_KERNEL=fused (scripts/gpu-check.sh);
//  - the backward is deterministic: two runs give the same bits;
//  - sharded steps on 4 local ranks make no thread wait for the device.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/autograd.hpp"
#include "core/gpu_runtime.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/attention/na_cuda.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/na_cases.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;
using testing::CaseRng;
const Device kGpu = Device::cuda(0);

#define SKIP_WITHOUT_GPU()                                                                  \
  if (gpu::device_count() == 0)                                                             \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the neighborhood " \
                  "attention cuda kernel tests need a GPU"

/// The bound on the relative error of a dtype's results against the cpu op in the same dtype.
double bound_of(DType dtype) {
  return dtype == DType::f64   ? 1e-12
         : dtype == DType::f32 ? 1e-5
         : dtype == DType::f16 ? 1e-2
                               : 5e-2;
}

TEST(NaGpu, FixturesMatchPyTorchOnCuda) {
  SKIP_WITHOUT_GPU();
  const std::string dir = testing::fixture_dir("na");
  const Json manifest = testing::read_manifest(dir);
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      for (const Json& fixture : manifest["cases"]) {
        const int spatial = fixture["dims"];
        testing::NaCase c;
        c.shape = fixture["q_shape"].get<Shape>();
        c.options.kernel_size = fixture["kernel_size"].get<std::vector<int64_t>>();
        c.options.dilation = fixture["dilation"].get<std::vector<int64_t>>();
        c.options.causal = fixture["causal"].get<std::vector<int64_t>>();
        c.options.scale = fixture["scale"].get<double>();
        c.rpb = fixture["has_rpb"];
        const bool square = world == 4 && spatial >= 2;
        DeviceMesh mesh(comm, square ? std::vector<int>{2, 2} : std::vector<int>{world});
        for (int m = 0; m < mesh.ndim(); ++m) {
          const int dim = spatial + 1 - mesh.ndim() + m;
          c.placements.push_back(Placement::shard(dim));
          c.extents.push_back(testing::lopsided(c.shape[dim], mesh.size(m)));
        }
        Shape lse_shape = c.shape;
        lse_shape.pop_back();
        const Shape rpb_shape = fixture["rpb_shape"].get<Shape>();
        const Json& files = fixture["files"];
        auto read = [&](const char* key, const Shape& shape) {
          return testing::read_fixture(dir, files[key], shape);
        };
        testing::NaData data{read("q", c.shape),
                             read("k", c.shape),
                             read("v", c.shape),
                             c.rpb ? read("rpb", rpb_shape) : Tensor::zeros(rpb_shape, DType::f64),
                             read("go", c.shape),
                             Tensor::zeros(lse_shape, DType::f64)};
        const auto result = testing::run_na_case(c, mesh, data, true, DType::f64, kGpu);
        const std::string where =
            fmt::format("{} on {} rank(s)", std::string(fixture["name"]), world);
        EXPECT_LT(max_abs_diff(result[0], read("o", c.shape)), 1e-10) << where;
        EXPECT_LT(max_abs_diff(result[1], read("lse", lse_shape)), 1e-10) << where;
        EXPECT_LT(max_abs_diff(result[2], read("gq", c.shape)), 1e-10) << where;
        EXPECT_LT(max_abs_diff(result[3], read("gk", c.shape)), 1e-10) << where;
        EXPECT_LT(max_abs_diff(result[4], read("gv", c.shape)), 1e-10) << where;
        if (c.rpb) {
          EXPECT_LT(max_abs_diff(result[5], read("grpb", rpb_shape)), 1e-10) << where;
        }
      }
    });
  }
}

/// The cuda sweep: on 1, 2 and 4 local ranks and every mesh of them, about `per_world` random
/// cases per world (head dim `dim`, or the case's own when 0), sharded on the GPU in each of
/// `dtypes` against the cpu op on one rank in the same dtype. Returns the number of cases.
int expect_sweep_matches_cpu(int seed, int per_world, int64_t dim,
                             const std::vector<DType>& dtypes) {
  int total = 0;
  for (int world : {1, 2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      const auto meshes = testing::mesh_factorizations(comm->size());
      DeviceMesh single(comm->split(comm->rank(), 0), {1});
      int cases = 0;
      for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
        DeviceMesh mesh(comm, meshes[mesh_index]);
        for (int index = 0; index < testing::cases_per_mesh(world, testing::sweep_cases(per_world));
             ++index, ++cases) {
          CaseRng rng(testing::case_seed(seed, world, static_cast<int>(mesh_index), index));
          testing::NaCase c = testing::random_na_case(mesh.shape(), rng);
          if (dim > 0) c.shape.back() = dim;
          const testing::NaData data = testing::random_na_data(c, rng);
          for (DType dtype : dtypes) {
            const auto expected =
                testing::run_na_case(c, single, data, false, dtype, Device::cpu());
            const auto actual = testing::run_na_case(c, mesh, data, true, dtype, kGpu);
            const char* names[] = {"o", "lse", "dq", "dk", "dv", "drpb"};
            for (size_t i = 0; i < expected.size(); ++i)
              EXPECT_LE(testing::relative_error(actual[i], expected[i]), bound_of(dtype))
                  << names[i] << " " << dtype_name(dtype) << " world " << world << " mesh "
                  << testing::shape_str(mesh.shape()) << " " << c.str();
          }
        }
      }
      if (comm->rank() == 0) total += cases;
    });
  }
  return total;
}

TEST(NaGpu, ShardedOnOneTwoAndFourLocalRanksMatchesTheCpuOnOneRank) {
  SKIP_WITHOUT_GPU();
  const int cases =
      expect_sweep_matches_cpu(71, 100, 0, {DType::f64, DType::f32, DType::f16, DType::bf16});
  EXPECT_GE(cases, 3 * testing::sweep_cases(100));
}

TEST(NaGpu, ShardedFusedKernelMatchesTheCpuOnOneRank) {
  SKIP_WITHOUT_GPU();
  EXPECT_GE(expect_sweep_matches_cpu(73, 30, 32, {DType::f16, DType::bf16}),
            3 * testing::sweep_cases(30));
}

// The forward in two parts on the device (the interior queries while the k/v halos travel, the
// rest once they land; halo overlap is off by default on cuda, docs/gpu.md): the same results.
TEST(NaGpu, ShardedWithTheHaloOverlapSplitMatchesTheCpuOnOneRank) {
  SKIP_WITHOUT_GPU();
  const bool was = halo_overlap(Device::Kind::cuda);
  set_halo_overlap(Device::Kind::cuda, true);
  const int cases = expect_sweep_matches_cpu(79, 40, 0, {DType::f64, DType::bf16});
  set_halo_overlap(Device::Kind::cuda, was);
  EXPECT_GE(cases, 3 * testing::sweep_cases(40));
}

// 4 local ranks sharing the GPU (a 2x2 mesh over the spatial axes, bf16: the mma kernels): after
// one warm-up step, three steps of the sharded forward and backward (k/v halo exchanges, the
// halo adjoints) make no thread wait for the device (gpu::host_waits unchanged), so the ranks
// queue work ahead of the GPU rather than draining it at every exchange.
TEST(NaGpu, ShardedStepsOnFourLocalRanksBlockNoThreadOnTheDevice) {
  SKIP_WITHOUT_GPU();
  std::atomic<uint64_t> before{0}, after{0};
  testing::run_world(4, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2, 2});
    const Shape shape{1, 64, 64, 2, 32};
    CaseRng rng(97);  // the same draws on every rank: one global tensor each
    auto input = [&] {
      const Tensor global = testing::random_na_tensor(shape, rng).to_dtype(DType::bf16);
      const ShardTensor t =
          ShardTensor::distribute(global, mesh, {Placement::shard(1), Placement::shard(2)});
      return ShardTensor(t.to_local().to(kGpu), t.mesh(), t.spec());
    };
    ShardTensor q = input(), k = input(), v = input();
    const ShardTensor grad = input();
    q.set_requires_grad();
    k.set_requires_grad();
    v.set_requires_grad();
    ops::NaOptions options;
    options.kernel_size = {7};
    auto step = [&] {
      Tape tape;
      const ops::NaResult out = ops::neighborhood_attention(q, k, v, options);
      tape.backward(out.output, grad);
    };
    step();  // plans, the allocator's blocks
    synchronize(compute_stream_for(kGpu));
    comm->barrier();  // a host rendezvous: no device wait
    if (comm->rank() == 0) before = gpu::host_waits();
    comm->barrier();
    for (int i = 0; i < 3; ++i) step();
    comm->barrier();
    if (comm->rank() == 0) after = gpu::host_waits();
    comm->barrier();
    synchronize(compute_stream_for(kGpu));
  });
  EXPECT_EQ(after - before, 0u) << "host waits for the device during 3 sharded steps on 4 ranks";
}

/// A random single-rank call for the kernel comparisons: q the local piece [offset, offset + n)
/// of each axis, k and v the tile of the keys its windows read.
struct KernelCase {
  ops::NaGeometry geometry;
  ops::NaPieces pieces;
  Tensor q, k, v, rpb, go, glse;
  bool has_rpb = false;
  std::string str;
};

KernelCase random_kernel_case(CaseRng& rng, int64_t dim, DType dtype) {
  const testing::NaKernelCall call = testing::random_na_kernel_call(rng, dim);
  KernelCase c;
  c.geometry = call.geometry;
  c.pieces = call.pieces;
  c.has_rpb = call.has_rpb;
  auto random = [&](const Shape& shape) {
    return testing::random_na_tensor(shape, rng).to_dtype(dtype).to(kGpu);
  };
  c.q = call.piece(random(call.full), false);
  c.k = call.piece(random(call.full), true);
  c.v = call.piece(random(call.full), true);
  c.go = call.piece(random(call.full), false);
  Shape lse_shape = c.q.shape();
  lse_shape.pop_back();
  c.glse = testing::random_na_tensor(lse_shape, rng).to_dtype(DType::f32).to(kGpu);
  if (dtype == DType::f64) c.glse = c.glse.to_dtype(DType::f64);
  if (c.has_rpb) c.rpb = random(ops::na_rpb_shape(call.heads, c.geometry));
  c.str = call.str(c.q, c.k, dtype);
  return c;
}

/// The exact reference's forward and gradients on the case's inputs (on the cpu).
std::pair<ops::NaForward, ops::NaGradients> reference_of(const KernelCase& c) {
  auto cpu = [](const Tensor& t) { return t.to(Device::cpu()); };
  const Tensor rpb_host = c.has_rpb ? cpu(c.rpb) : Tensor();
  const Tensor glse_host = cpu(c.glse);
  return {ops::na_forward(cpu(c.q), cpu(c.k), cpu(c.v), c.has_rpb ? &rpb_host : nullptr, c.geometry,
                          c.pieces),
          ops::na_backward(cpu(c.q), cpu(c.k), cpu(c.v), c.has_rpb ? &rpb_host : nullptr, cpu(c.go),
                           &glse_host, c.geometry, c.pieces)};
}

Tensor host(const Tensor& t) {
  return t.to(Device::cpu()).to_dtype(DType::f64);
}

TEST(NaGpu, FusedKernelsMatchThePlainKernelsAndTheReference) {
  SKIP_WITHOUT_GPU();
  using ops::kernels::NaKernel;
  const Tensor probe = Tensor::zeros({1, 8, 1, 32}, DType::bf16, kGpu);
  if (ops::na_cuda_kernel_for(probe) == NaKernel::plain)
    GTEST_SKIP() << "the fused kernels need bf16 tensor cores (sm_80 or newer), which "
                 << kGpu.str() << " lacks";
  for (int index = 0; index < testing::sweep_cases(120); ++index) {
    CaseRng rng(testing::case_seed(79, 1, 0, index));
    const DType dtype = index % 2 == 0 ? DType::f16 : DType::bf16;
    const int64_t dims[] = {32, 64, 128};
    const KernelCase c = random_kernel_case(rng, dims[index % 3], dtype);
    ASSERT_NE(ops::na_cuda_kernel_for(c.q), NaKernel::plain) << c.str;
    const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
    const Stream stream = compute_stream_for(kGpu);
    const ops::NaForward fused =
        ops::na_cuda_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, stream, NaKernel::fused);
    const ops::NaForward plain =
        ops::na_cuda_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, stream, NaKernel::plain);
    const ops::NaGradients fused_grads =
        ops::na_cuda_backward(c.q, c.k, c.v, rpb, &fused.output, fused.lse, c.go, &c.glse,
                              c.geometry, c.pieces, stream, NaKernel::fused);
    const ops::NaGradients plain_grads =
        ops::na_cuda_backward(c.q, c.k, c.v, rpb, &plain.output, plain.lse, c.go, &c.glse,
                              c.geometry, c.pieces, stream, NaKernel::plain);
    const auto [reference, reference_grads] = reference_of(c);
    const double bound = bound_of(dtype);
    EXPECT_LE(testing::relative_error(host(fused.output), host(plain.output)), bound) << c.str;
    EXPECT_LE(testing::relative_error(host(fused.output), host(reference.output)), bound) << c.str;
    EXPECT_LE(testing::relative_error(host(fused.lse), host(reference.lse)), 1e-3) << c.str;
    EXPECT_LE(testing::relative_error(host(plain.lse), host(reference.lse)), 1e-5) << c.str;
    const char* names[] = {"dq", "dk", "dv", "drpb"};
    const Tensor* fused_list[] = {&fused_grads.dq, &fused_grads.dk, &fused_grads.dv,
                                  &fused_grads.drpb};
    const Tensor* plain_list[] = {&plain_grads.dq, &plain_grads.dk, &plain_grads.dv,
                                  &plain_grads.drpb};
    const Tensor* reference_list[] = {&reference_grads.dq, &reference_grads.dk, &reference_grads.dv,
                                      &reference_grads.drpb};
    for (int i = 0; i < (c.has_rpb ? 4 : 3); ++i) {
      EXPECT_LE(testing::relative_error(host(*fused_list[i]), host(*reference_list[i])), bound)
          << names[i] << " fused " << c.str;
      EXPECT_LE(testing::relative_error(host(*plain_list[i]), host(*reference_list[i])), bound)
          << names[i] << " plain " << c.str;
    }
  }
}

TEST(NaGpu, MmaKernelsMatchTheReferenceAndTheFusedForward) {
  SKIP_WITHOUT_GPU();
  using ops::kernels::NaKernel;
  const Tensor probe = Tensor::zeros({1, 8, 1, 32}, DType::bf16, kGpu);
  if (ops::na_cuda_kernel_for(probe) == NaKernel::plain)
    GTEST_SKIP() << "the mma forward needs bf16 tensor cores (sm_80 or newer), which " << kGpu.str()
                 << " lacks";
  for (int index = 0; index < testing::sweep_cases(150); ++index) {
    CaseRng rng(testing::case_seed(83, 1, 0, index));
    const DType dtype = index % 2 == 0 ? DType::bf16 : DType::f16;
    const int64_t dims[] = {64, 32, 128};
    const KernelCase c = random_kernel_case(rng, dims[index % 3], dtype);
    const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
    const Stream stream = compute_stream_for(kGpu);
    const ops::NaForward mma =
        ops::na_cuda_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, stream, NaKernel::mma);
    const ops::NaForward fused =
        ops::na_cuda_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, stream, NaKernel::fused);
    // The mma backward from the mma forward's output and lse.
    const ops::NaGradients grads =
        ops::na_cuda_backward(c.q, c.k, c.v, rpb, &mma.output, mma.lse, c.go, &c.glse, c.geometry,
                              c.pieces, stream, NaKernel::mma);
    const auto [reference, reference_grads] = reference_of(c);
    const double bound = bound_of(dtype);
    EXPECT_LE(testing::relative_error(host(mma.output), host(reference.output)), bound) << c.str;
    EXPECT_LE(testing::relative_error(host(mma.output), host(fused.output)), bound) << c.str;
    EXPECT_LE(testing::relative_error(host(mma.lse), host(reference.lse)), 1e-3) << c.str;
    const char* names[] = {"dq", "dk", "dv", "drpb"};
    const Tensor* got[] = {&grads.dq, &grads.dk, &grads.dv, &grads.drpb};
    const Tensor* want[] = {&reference_grads.dq, &reference_grads.dk, &reference_grads.dv,
                            &reference_grads.drpb};
    for (int i = 0; i < (c.has_rpb ? 4 : 3); ++i)
      EXPECT_LE(testing::relative_error(host(*got[i]), host(*want[i])), bound)
          << names[i] << " of the mma backward " << c.str;
  }
}

TEST(NaGpu, PlainKernelsMatchTheReferenceOnPiecesWithTilesAtOffsets) {
  SKIP_WITHOUT_GPU();
  for (int index = 0; index < testing::sweep_cases(60); ++index) {
    CaseRng rng(testing::case_seed(83, 1, 0, index));
    const DType dtype = index % 2 == 0 ? DType::f64 : DType::f32;
    const int64_t dims[] = {1, 5, 32, 130};
    const KernelCase c = random_kernel_case(rng, dims[index % 4], dtype);
    const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
    const Stream stream = compute_stream_for(kGpu);
    const ops::NaForward forward =
        ops::na_cuda_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, stream);
    const ops::NaGradients grads =
        ops::na_cuda_backward(c.q, c.k, c.v, rpb, &forward.output, forward.lse, c.go, &c.glse,
                              c.geometry, c.pieces, stream);
    auto cpu = [](const Tensor& t) { return t.to(Device::cpu()); };
    const Tensor rpb_host = c.has_rpb ? cpu(c.rpb) : Tensor();
    const Tensor glse_host = cpu(c.glse);
    const ops::NaForward ref_forward = ops::na_forward(
        cpu(c.q), cpu(c.k), cpu(c.v), c.has_rpb ? &rpb_host : nullptr, c.geometry, c.pieces);
    const ops::NaGradients ref_grads =
        ops::na_backward(cpu(c.q), cpu(c.k), cpu(c.v), c.has_rpb ? &rpb_host : nullptr, cpu(c.go),
                         &glse_host, c.geometry, c.pieces);
    const double bound = bound_of(dtype);
    EXPECT_LE(testing::relative_error(host(forward.output), host(ref_forward.output)), bound)
        << c.str;
    EXPECT_LE(testing::relative_error(host(forward.lse), host(ref_forward.lse)), bound) << c.str;
    EXPECT_LE(testing::relative_error(host(grads.dq), host(ref_grads.dq)), bound) << c.str;
    EXPECT_LE(testing::relative_error(host(grads.dk), host(ref_grads.dk)), bound) << c.str;
    EXPECT_LE(testing::relative_error(host(grads.dv), host(ref_grads.dv)), bound) << c.str;
    if (c.has_rpb) {
      EXPECT_LE(testing::relative_error(host(grads.drpb), host(ref_grads.drpb)), bound) << c.str;
    }
  }
}

TEST(NaGpu, BackwardIsBitwiseReproducible) {
  SKIP_WITHOUT_GPU();
  for (int index = 0; index < testing::sweep_cases(24); ++index) {
    CaseRng rng(testing::case_seed(89, 1, 0, index));
    const DType dtypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64};
    const DType dtype = dtypes[index % 4];
    const KernelCase c = random_kernel_case(rng, index % 3 == 0 ? 64 : 7, dtype);
    const Tensor* rpb = c.has_rpb ? &c.rpb : nullptr;
    const Stream stream = compute_stream_for(kGpu);
    const ops::NaForward forward =
        ops::na_cuda_forward(c.q, c.k, c.v, rpb, c.geometry, c.pieces, stream);
    const ops::NaGradients first =
        ops::na_cuda_backward(c.q, c.k, c.v, rpb, &forward.output, forward.lse, c.go, &c.glse,
                              c.geometry, c.pieces, stream);
    const ops::NaGradients second =
        ops::na_cuda_backward(c.q, c.k, c.v, rpb, &forward.output, forward.lse, c.go, &c.glse,
                              c.geometry, c.pieces, stream);
    EXPECT_EQ(max_abs_diff(host(first.dq), host(second.dq)), 0.0) << c.str;
    EXPECT_EQ(max_abs_diff(host(first.dk), host(second.dk)), 0.0) << c.str;
    EXPECT_EQ(max_abs_diff(host(first.dv), host(second.dv)), 0.0) << c.str;
    if (c.has_rpb) {
      EXPECT_EQ(max_abs_diff(host(first.drpb), host(second.drpb)), 0.0) << c.str;
    }
  }
}

}  // namespace
}  // namespace tessera
