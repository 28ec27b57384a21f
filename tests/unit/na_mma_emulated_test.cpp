// The register-tiled (mma) neighborhood-attention forward (ops/attention/na_mma_forward.cuh) run
// on the cpu under the emulation of the CUDA thread model and of its warp primitives
// (tests/emu/cuda_block_emulator.hpp):
//  - the emulator itself: mma.m16n8k16 of known f16/bf16 matrices equals their product plus C;
//    ldmatrix.x4 and .x4.trans give each lane the elements the PTX ISA names; asynchronous copies
//    land only at their wait_group; __shfl_xor_sync exchanges; a lane that skips a collective, a
//    __syncthreads at two call sites and __trap abort with a message;
//  - the kernel: on random calls (1-d, 2-d, 3-d; odd and even kernels, dilation, causal, a bias;
//    query pieces with key tiles at offsets; extents not multiples of the tile) launched with the
//    grid of launch_dim (na_cuda_mma.cu), o and lse equal the reference na_forward on the same
//    rounded inputs within the GPU test's bounds (f16 1e-2, bf16 5e-2 of the largest value; lse
//    1e-3), in both thread schedules, and nothing outside o and lse is written;
//  - the backward kernels (na_mma_backward.cuh, launched as launch_backward_dim does) on the same
//    kind of calls with a random gradient of o and of lse: dq, dk and dv equal the reference
//    na_backward within the same bounds, every row written, nothing outside them.
// Proves the kernel's indexing, masking, softmax and synchronisation under the ISA's definition of
// the instructions; not its speed or anything of the hardware beyond that definition.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ops/attention/na_problem.hpp"
#include "ops/attention/na_reference.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/na_cases.hpp"
#include "tests/dist/shard_cases.hpp"
#include "tests/emu/cuda_block_emulator.hpp"
// The backward kernels, after the emulator (which includes na_mma.cuh and the forward).
#include "ops/attention/na_mma_backward.cuh"

namespace tessera {
namespace {

namespace mma = ops::kernels::mma_detail;
using testing::CaseRng;

uint16_t bits_of(float value, __nv_bfloat16) {
  const __nv_bfloat16 rounded = __float2bfloat16_rn(value);
  uint16_t bits;
  std::memcpy(&bits, &rounded, 2);
  return bits;
}
uint16_t bits_of(float value, __half) {
  const __half rounded = __float2half_rn(value);
  uint16_t bits;
  std::memcpy(&bits, &rounded, 2);
  return bits;
}
uint32_t pair(uint16_t low, uint16_t high) {
  return uint32_t(low) | uint32_t(high) << 16;
}

template <typename T>
void expect_mma_is_the_product() {
  // Small integers and halves: exact in f16 and bf16, so the product is exact too.
  float a[16][16], b[16][8], c[16][8];
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < 16; ++k) a[i][k] = static_cast<float>((i * 7 + k * 3) % 11 - 5) * 0.5f;
  for (int k = 0; k < 16; ++k)
    for (int j = 0; j < 8; ++j) b[k][j] = static_cast<float>((k * 5 + j * 9) % 13 - 6);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) c[i][j] = static_cast<float>(i - j) * 0.25f;
  float d[16][8];
  for (auto& row : d) std::fill(std::begin(row), std::end(row), std::nanf(""));
  emu::launch(dim3(1), 32, 16, [&] {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    auto bits = [](float x) { return bits_of(x, T{}); };
    const uint32_t fragment[4] = {pair(bits(a[g][2 * t]), bits(a[g][2 * t + 1])),
                                  pair(bits(a[g + 8][2 * t]), bits(a[g + 8][2 * t + 1])),
                                  pair(bits(a[g][2 * t + 8]), bits(a[g][2 * t + 9])),
                                  pair(bits(a[g + 8][2 * t + 8]), bits(a[g + 8][2 * t + 9]))};
    const uint32_t b0 = pair(bits(b[2 * t][g]), bits(b[2 * t + 1][g]));
    const uint32_t b1 = pair(bits(b[2 * t + 8][g]), bits(b[2 * t + 9][g]));
    float acc[4] = {c[g][2 * t], c[g][2 * t + 1], c[g + 8][2 * t], c[g + 8][2 * t + 1]};
    mma::mma(acc, fragment, b0, b1, T{});
    d[g][2 * t] = acc[0];
    d[g][2 * t + 1] = acc[1];
    d[g + 8][2 * t] = acc[2];
    d[g + 8][2 * t + 1] = acc[3];
  });
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      float expected = c[i][j];
      for (int k = 0; k < 16; ++k) expected += a[i][k] * b[k][j];
      EXPECT_EQ(d[i][j], expected) << "row " << i << " col " << j;
    }
}

TEST(NaMmaEmulated, MmaOfKnownMatricesIsTheirProductPlusC) {
  expect_mma_is_the_product<__nv_bfloat16>();
  expect_mma_is_the_product<__half>();
}

TEST(NaMmaEmulated, LdmatrixGivesEachLaneTheElementsTheIsaNames) {
  // Four 8x8 matrices in shared memory, rows 24 elements apart (padded like the kernels' tiles),
  // element (m, r, c) holding the value m * 64 + r * 8 + c.
  constexpr int kLd = 24;
  uint32_t plain[32][4], transposed[32][4];
  emu::launch(dim3(1), 32, 4 * 8 * kLd * 2, [&] {
    auto* tile = reinterpret_cast<uint16_t*>(emu::shared_memory());
    const int lane = threadIdx.x;
    if (lane == 0)
      for (int m = 0; m < 4; ++m)
        for (int r = 0; r < 8; ++r)
          for (int c = 0; c < 8; ++c) tile[(m * 8 + r) * kLd + c] = uint16_t(m * 64 + r * 8 + c);
    __syncthreads();
    const uint16_t* row = tile + (lane / 8 * 8 + lane % 8) * kLd;
    mma::load_matrices(plain[lane], row);
    mma::load_matrices_transposed(transposed[lane], row);
  });
  for (int lane = 0; lane < 32; ++lane)
    for (int m = 0; m < 4; ++m) {
      const int r = lane / 4, c = 2 * (lane % 4);
      EXPECT_EQ(plain[lane][m],
                pair(uint16_t(m * 64 + r * 8 + c), uint16_t(m * 64 + r * 8 + c + 1)))
          << "lane " << lane << " matrix " << m;
      // .trans: the lane's pair runs down a column: (2 (l % 4), l / 4) and the row below.
      EXPECT_EQ(transposed[lane][m],
                pair(uint16_t(m * 64 + c * 8 + r), uint16_t(m * 64 + (c + 1) * 8 + r)))
          << "lane " << lane << " matrix " << m;
    }
}

TEST(NaMmaEmulated, AsyncCopiesLandOnlyAtTheirWait) {
  alignas(16) static const uint32_t source[2][4] = {{1, 2, 3, 4}, {5, 6, 7, 8}};
  uint32_t seen[4][3];
  emu::launch(dim3(1), 1, 48, [&] {
    auto* shared = reinterpret_cast<uint32_t*>(emu::shared_memory());
    mma::copy_async(shared, source[0], true);
    mma::commit_async();
    mma::copy_async(shared + 4, source[1], true);
    mma::copy_async(shared + 8, source[1], false);  // zeros, nothing read
    mma::commit_async();
    seen[0][0] = shared[0];
    seen[0][1] = shared[4];
    seen[0][2] = shared[8];
    mma::wait_async<1>();
    seen[1][0] = shared[0];
    seen[1][1] = shared[4];
    seen[1][2] = shared[8];
    mma::wait_async<0>();
    seen[2][0] = shared[0];
    seen[2][1] = shared[4];
    seen[2][2] = shared[8];
  });
  const uint32_t fill = 0xFFFFFFFFu;
  EXPECT_EQ(seen[0][0], fill);
  EXPECT_EQ(seen[0][1], fill);
  EXPECT_EQ(seen[0][2], fill);
  EXPECT_EQ(seen[1][0], 1u);
  EXPECT_EQ(seen[1][1], fill);
  EXPECT_EQ(seen[1][2], fill);
  EXPECT_EQ(seen[2][0], 1u);
  EXPECT_EQ(seen[2][1], 5u);
  EXPECT_EQ(seen[2][2], 0u);
}

TEST(NaMmaEmulated, ShuffleXorAndBarriersAcrossWarps) {
  for (const bool reverse : {false, true}) {
    std::vector<float> out(128), neighbor(128);
    emu::LaunchOptions options;
    options.reverse = reverse;
    emu::launch(
        dim3(2, 3), 128, 128 * 4,
        [&] {
          auto* shared = reinterpret_cast<float*>(emu::shared_memory());
          const int t = threadIdx.x;
          const float mine = static_cast<float>(t + 1000 * (blockIdx.x + 2 * blockIdx.y));
          float x = __shfl_xor_sync(0xffffffffu, mine, 1);
          x += __shfl_xor_sync(0xffffffffu, mine, 16);
          shared[t] = mine;
          __syncthreads();
          if (blockIdx.x == 1 && blockIdx.y == 2) {
            out[t] = x;
            neighbor[t] = shared[(t + 64) % 128];  // written by another warp before the barrier
          }
        },
        options);
    const float base = 1000.0f * 5;
    for (int t = 0; t < 128; ++t) {
      EXPECT_EQ(out[t], (base + (t ^ 1)) + (base + (t ^ 16))) << t << " reverse " << reverse;
      EXPECT_EQ(neighbor[t], base + (t + 64) % 128) << t << " reverse " << reverse;
    }
    EXPECT_EQ(emu::last_launch_stats().blocks, 6u);
    EXPECT_EQ(emu::last_launch_stats().barriers, 6u);
    EXPECT_EQ(emu::last_launch_stats().warp_collectives, 6u * 4 * 2);
  }
}

TEST(NaMmaEmulatedDeathTest, KernelBugsAbortWithAMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The kernels are written out of the EXPECT_DEATH macros: inside one, every call site would
  // share the macro's line.
  const auto skipped_shuffle = [] {
    float x = 1.0f;
    if (threadIdx.x != 7) x = __shfl_xor_sync(0xffffffffu, x, 1);
    (void)x;
  };
  const auto two_barriers = [] {
    if (threadIdx.x < 32)
      __syncthreads();
    else
      __syncthreads();
  };
  const auto row_outside = [] {
    uint32_t r[4];
    mma::load_matrices(r, emu::shared_memory() + 16 * threadIdx.x);
  };
  const auto unaligned_copy = [] {
    mma::copy_async(emu::shared_memory() + 8, emu::shared_memory() + 32, true);
  };
  alignas(16) static const uint16_t rows[32][8] = {};
  const auto read_before_wait = [] {
    unsigned char* tile = emu::shared_memory() + 16 * threadIdx.x;
    mma::copy_async(tile, rows[threadIdx.x], true);
    mma::commit_async();
    uint32_t r[4];
    mma::load_matrices(r, tile);
  };
  const auto copy_over_a_read = [] {
    const int lane = threadIdx.x % 32;
    unsigned char* tile = emu::shared_memory() + 16 * lane;
    if (threadIdx.x < 32) {
      uint32_t r[4];
      mma::load_matrices(r, tile);
    } else {
      mma::copy_async(tile, rows[lane], true);  // warp 1, with no barrier after warp 0's read
      mma::commit_async();
      mma::wait_async<0>();
    }
  };
  EXPECT_DEATH(emu::launch(dim3(1), 32, 512, read_before_wait),
               "ldmatrix at .* reads shared bytes whose cp.async by thread 0 .* has not landed");
  EXPECT_DEATH(emu::launch(dim3(1), 64, 512, copy_over_a_read),
               "cp.async at .* into shared bytes another warp read with ldmatrix");
  EXPECT_DEATH(emu::launch(dim3(1), 32, 16, skipped_shuffle),
               "thread 7 .* exited while lanes of its warp wait at __shfl_xor_sync");
  EXPECT_DEATH(emu::launch(dim3(1), 64, 16, two_barriers),
               "reached __syncthreads at .* while threads wait at __syncthreads");
  EXPECT_DEATH(emu::launch(dim3(1), 32, 64, row_outside),
               "ldmatrix row of lane 4 at .* outside the block's 64 bytes");
  EXPECT_DEATH(emu::launch(dim3(1), 1, 64, unaligned_copy),
               "cp.async destination .* not a multiple of 16");
  EXPECT_DEATH(emu::launch(dim3(1), 1, 16, [] { __trap(); }), "__trap");
}

// --- The kernel against the reference ---------------------------------------------------------

/// A random single-rank call (as tests/gpu/na_gpu_test.cpp's kernel cases): q the local
/// piece [first, last) of each axis, k and v the tile of the keys its windows read.
struct KernelCase {
  ops::NaGeometry geometry;
  ops::NaPieces pieces;
  Tensor q, k, v, rpb;
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
    return testing::random_na_tensor(shape, rng).to_dtype(dtype);
  };
  c.q = call.piece(random(call.full), false);
  c.k = call.piece(random(call.full), true);
  c.v = call.piece(random(call.full), true);
  if (c.has_rpb) c.rpb = random(ops::na_rpb_shape(call.heads, c.geometry));
  c.str = call.str(c.q, c.k, dtype);
  return c;
}

/// Elements of guard on each side of the outputs: they must keep their pattern.
constexpr int64_t kGuard = 64;

/// o and lse of mma_forward<T, D, kBias, kBlocks> on the case, launched as launch_dim does;
/// checks the guards.
template <typename T, int D, int kBlocks = 1>
ops::NaForward run_emulated(const KernelCase& c, const emu::LaunchOptions& options) {
  const ops::na_detail::Problem p = ops::na_detail::make_problem(
      c.q, c.k, c.v, c.has_rpb ? &c.rpb : nullptr, c.geometry, c.pieces);
  const ops::kernels::NaCall call = ops::na_detail::make_na_call(p, c.geometry);
  ops::kernels::NaTileShape tile{};
  ops::kernels::na_fused_tile_shape(call.spatial, tile.extent);
  const mma::MaskTables tables = mma::mask_tables(call, tile);
  const int64_t tiles = ops::kernels::na_tile_count(call, tile, false);
  const int64_t rows = c.q.numel() / D;
  // o starts as NaN (0xFFFF): a row the kernel leaves unwritten fails the comparison.
  std::vector<uint16_t> o(rows * D + 2 * kGuard, 0xFFFF);
  std::vector<float> lse(rows + 2 * kGuard, std::nanf(""));
  const uint16_t guard_bits = 0x5A5A;
  const float guard_value = -12345.0f;
  std::fill(o.begin(), o.begin() + kGuard, guard_bits);
  std::fill(o.end() - kGuard, o.end(), guard_bits);
  std::fill(lse.begin(), lse.begin() + kGuard, guard_value);
  std::fill(lse.end() - kGuard, lse.end(), guard_value);
  const T* q = static_cast<const T*>(c.q.raw_data());
  const T* k = static_cast<const T*>(c.k.raw_data());
  const T* v = static_cast<const T*>(c.v.raw_data());
  const T* rpb = c.has_rpb ? static_cast<const T*>(c.rpb.raw_data()) : nullptr;
  T* o_data = reinterpret_cast<T*>(o.data() + kGuard);
  float* lse_data = lse.data() + kGuard;
  if (tiles > 0 && call.batch * call.heads > 0) {
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(call.batch * call.heads));
    emu::launch(
        grid, mma::kMmaWarps * mma::kWarp, mma::MmaLayout<D>::bytes + tables.bytes,
        [&] {
          if (call.has_rpb)
            mma::mma_forward<T, D, true, kBlocks>(call, tile, tables, q, k, v, rpb, o_data,
                                                  lse_data);
          else
            mma::mma_forward<T, D, false, kBlocks>(call, tile, tables, q, k, v, rpb, o_data,
                                                   lse_data);
        },
        options);
  }
  for (int64_t i = 0; i < kGuard; ++i) {
    EXPECT_EQ(o[i], guard_bits) << "o written before its start: " << c.str;
    EXPECT_EQ(o[o.size() - 1 - i], guard_bits) << "o written past its end: " << c.str;
    EXPECT_EQ(lse[i], guard_value) << "lse written before its start: " << c.str;
    EXPECT_EQ(lse[lse.size() - 1 - i], guard_value) << "lse written past its end: " << c.str;
  }
  Shape lse_shape = c.q.shape();
  lse_shape.pop_back();
  ops::NaForward result{Tensor::empty(c.q.shape(), c.q.dtype()),
                        Tensor::empty(lse_shape, DType::f32)};
  std::memcpy(result.output.raw_data(), o_data, rows * D * sizeof(uint16_t));
  std::memcpy(result.lse.raw_data(), lse_data, rows * sizeof(float));
  return result;
}

/// run_emulated for a head dim of `dim`; `blocks` 4: the variant for 4 blocks per SM (Q's
/// fragments re-read per n-tile; the default, TESSERA_NA_MMA_FORWARD_BLOCKS=4), which head dims
/// 32 and 64 run.
template <typename T>
ops::NaForward run_emulated_dim(const KernelCase& c, int64_t dim, const emu::LaunchOptions& options,
                                int blocks = 0) {
  if (blocks == 4 && dim == 32) return run_emulated<T, 32, 4>(c, options);
  if (blocks == 4 && dim == 64) return run_emulated<T, 64, 4>(c, options);
  switch (dim) {
    case 32: return run_emulated<T, 32>(c, options);
    case 64: return run_emulated<T, 64>(c, options);
    default: return run_emulated<T, 128>(c, options);
  }
}

Tensor as_f64(const Tensor& t) {
  return t.to_dtype(DType::f64);
}

TEST(NaMmaEmulated, ForwardMatchesTheReferenceOnRandomCalls) {
  constexpr int kCalls = 120;
  const auto start = std::chrono::steady_clock::now();
  uint64_t switches = 0, collectives = 0, blocks = 0;
  int spatial_seen[4] = {};
  double worst_o[2] = {0, 0}, worst_lse[2] = {0, 0};  // f16, bf16
  for (int index = 0; index < kCalls; ++index) {
    CaseRng rng(testing::case_seed(97, 1, 0, index));
    const DType dtype = index % 2 == 0 ? DType::bf16 : DType::f16;
    const int64_t dims[] = {32, 64, 128};
    const int64_t dim = dims[index / 2 % 3];
    const KernelCase c = random_kernel_case(rng, dim, dtype);
    ++spatial_seen[c.geometry.extent.size()];
    emu::LaunchOptions options;
    options.reverse = index % 4 >= 2;
    // Every dtype and head dim with both variants: 6 calls each in turn.
    const int variant = index / 6 % 2 == 1 ? 4 : 0;
    const ops::NaForward emulated = dtype == DType::bf16
                                        ? run_emulated_dim<__nv_bfloat16>(c, dim, options, variant)
                                        : run_emulated_dim<__half>(c, dim, options, variant);
    switches += emu::last_launch_stats().switches;
    collectives += emu::last_launch_stats().warp_collectives;
    blocks += emu::last_launch_stats().blocks;
    const ops::NaForward reference =
        ops::na_forward(c.q, c.k, c.v, c.has_rpb ? &c.rpb : nullptr, c.geometry, c.pieces);
    const double bound = dtype == DType::f16 ? 1e-2 : 5e-2;
    const double o_error =
        testing::relative_error(as_f64(emulated.output), as_f64(reference.output));
    const double lse_error = testing::relative_error(as_f64(emulated.lse), as_f64(reference.lse));
    const std::string how = std::string(options.reverse ? " (reverse schedule)" : "") +
                            (variant == 4 && dim <= 64 ? " (4 blocks per SM)" : "");
    EXPECT_LE(o_error, bound) << "o " << c.str << how;
    EXPECT_LE(lse_error, 1e-3) << "lse " << c.str << how;
    const int slot = dtype == DType::f16 ? 0 : 1;
    worst_o[slot] = std::max(worst_o[slot], o_error);
    worst_lse[slot] = std::max(worst_lse[slot], lse_error);
  }
  EXPECT_GT(spatial_seen[1], 0);
  EXPECT_GT(spatial_seen[2], 0);
  EXPECT_GT(spatial_seen[3], 0);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "[emulated mma forward] %d calls, %llu blocks, %llu warp collectives, %llu context "
      "switches in %.1f s; worst relative error of o f16 %.2e bf16 %.2e, of lse f16 %.2e bf16 "
      "%.2e\n",
      kCalls, static_cast<unsigned long long>(blocks), static_cast<unsigned long long>(collectives),
      static_cast<unsigned long long>(switches), seconds, worst_o[0], worst_o[1], worst_lse[0],
      worst_lse[1]);
}

/// An output buffer of `count` 16-bit elements between guards, starting as NaN (0xFFFF) so that
/// an unwritten element fails the comparison.
struct Guarded {
  explicit Guarded(int64_t count) : bits(count + 2 * kGuard, 0xFFFF) {
    std::fill(bits.begin(), bits.begin() + kGuard, kBits);
    std::fill(bits.end() - kGuard, bits.end(), kBits);
  }
  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(bits.data() + kGuard);
  }
  void expect_guards(const std::string& name, const std::string& what) const {
    for (int64_t i = 0; i < kGuard; ++i) {
      EXPECT_EQ(bits[i], kBits) << name << " written before its start: " << what;
      EXPECT_EQ(bits[bits.size() - 1 - i], kBits) << name << " written past its end: " << what;
    }
  }
  Tensor tensor(const Shape& shape, DType dtype) const {
    Tensor t = Tensor::empty(shape, dtype);
    std::memcpy(t.raw_data(), bits.data() + kGuard, t.numel() * sizeof(uint16_t));
    return t;
  }
  static constexpr uint16_t kBits = 0x5A5A;
  std::vector<uint16_t> bits;
};

/// dq, dk, dv of the mma backward kernels on the case with gradients go (of o) and glse (of lse),
/// from the reference forward's lse and delta' = go . o - glse, launched as launch_backward_dim
/// does.
template <typename T, int D>
ops::NaGradients run_emulated_backward(const KernelCase& c, const Tensor& go, const Tensor& glse,
                                       const emu::LaunchOptions& options) {
  const ops::na_detail::Problem p = ops::na_detail::make_problem(
      c.q, c.k, c.v, c.has_rpb ? &c.rpb : nullptr, c.geometry, c.pieces);
  const ops::kernels::NaCall call = ops::na_detail::make_na_call(p, c.geometry);
  const ops::NaForward forward =
      ops::na_forward(c.q, c.k, c.v, c.has_rpb ? &c.rpb : nullptr, c.geometry, c.pieces);
  const int64_t rows = c.q.numel() / D;
  const Tensor o = forward.output.to_dtype(DType::f64), g = go.to_dtype(DType::f64);
  const Tensor lse = forward.lse.to_dtype(DType::f32), gl = glse.to_dtype(DType::f64);
  std::vector<float> delta(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0;
    for (int64_t e = 0; e < D; ++e)
      dot += o.data<double>()[r * D + e] * g.data<double>()[r * D + e];
    delta[r] = static_cast<float>(dot - gl.data<double>()[r]);
  }
  ops::kernels::NaTileShape tile{};
  ops::kernels::na_fused_tile_shape(call.spatial, tile.extent);
  const int64_t query_tiles = ops::kernels::na_tile_count(call, tile, false),
                key_tiles = ops::kernels::na_tile_count(call, tile, true);
  Guarded dq(c.q.numel()), dk(c.k.numel()), dv(c.v.numel());
  const mma::MmaBackward<T> args{static_cast<const T*>(c.q.raw_data()),
                                 static_cast<const T*>(c.k.raw_data()),
                                 static_cast<const T*>(c.v.raw_data()),
                                 c.has_rpb ? static_cast<const T*>(c.rpb.raw_data()) : nullptr,
                                 static_cast<const T*>(go.raw_data()),
                                 lse.data<float>(),
                                 delta.data(),
                                 dq.data<T>(),
                                 dk.data<T>(),
                                 dv.data<T>()};
  const unsigned pairs = static_cast<unsigned>(call.batch * call.heads);
  const mma::MaskTables tables = mma::mask_tables(call, tile);
  const size_t bytes = mma::MmaBackwardLayout<D>::bytes + tables.bytes;
  if (query_tiles > 0 && pairs > 0)
    emu::launch(
        dim3(static_cast<unsigned>(query_tiles), pairs), mma::kMmaWarps * mma::kWarp, bytes,
        [&] {
          if (call.has_rpb)
            mma::mma_backward_query<T, D, true>(call, tile, tables, args);
          else
            mma::mma_backward_query<T, D, false>(call, tile, tables, args);
        },
        options);
  if (key_tiles > 0 && pairs > 0)
    emu::launch(
        dim3(static_cast<unsigned>(key_tiles), pairs), mma::kMmaWarps * mma::kWarp, bytes,
        [&] {
          if (call.has_rpb)
            mma::mma_backward_key<T, D, true>(call, tile, tables, args);
          else
            mma::mma_backward_key<T, D, false>(call, tile, tables, args);
        },
        options);
  dq.expect_guards("dq", c.str);
  dk.expect_guards("dk", c.str);
  dv.expect_guards("dv", c.str);
  return ops::NaGradients{dq.tensor(c.q.shape(), c.q.dtype()), dk.tensor(c.k.shape(), c.k.dtype()),
                          dv.tensor(c.v.shape(), c.v.dtype()), Tensor()};
}

template <typename T>
ops::NaGradients run_emulated_backward_dim(const KernelCase& c, int64_t dim, const Tensor& go,
                                           const Tensor& glse, const emu::LaunchOptions& options) {
  switch (dim) {
    case 32: return run_emulated_backward<T, 32>(c, go, glse, options);
    case 64: return run_emulated_backward<T, 64>(c, go, glse, options);
    default: return run_emulated_backward<T, 128>(c, go, glse, options);
  }
}

TEST(NaMmaEmulated, BackwardMatchesTheReferenceOnRandomCalls) {
  constexpr int kCalls = 90;
  double worst[2][3] = {};  // f16, bf16 x dq, dk, dv
  int spatial_seen[4] = {};
  for (int index = 0; index < kCalls; ++index) {
    CaseRng rng(testing::case_seed(101, 1, 0, index));
    const DType dtype = index % 2 == 0 ? DType::bf16 : DType::f16;
    const int64_t dims[] = {32, 64, 128};
    const int64_t dim = dims[index / 2 % 3];
    const KernelCase c = random_kernel_case(rng, dim, dtype);
    ++spatial_seen[c.geometry.extent.size()];
    std::normal_distribution<double> normal;
    auto random = [&](const Shape& shape, DType type) {
      Tensor t = Tensor::empty(shape, DType::f64);
      for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = normal(rng.engine());
      return t.to_dtype(type);
    };
    Shape lse_shape = c.q.shape();
    lse_shape.pop_back();
    const Tensor go = random(c.q.shape(), dtype), glse = random(lse_shape, DType::f32);
    emu::LaunchOptions options;
    options.reverse = index % 4 >= 2;
    const ops::NaGradients emulated =
        dtype == DType::bf16 ? run_emulated_backward_dim<__nv_bfloat16>(c, dim, go, glse, options)
                             : run_emulated_backward_dim<__half>(c, dim, go, glse, options);
    const ops::NaGradients reference = ops::na_backward(c.q, c.k, c.v, c.has_rpb ? &c.rpb : nullptr,
                                                        go, &glse, c.geometry, c.pieces);
    const double bound = dtype == DType::f16 ? 1e-2 : 5e-2;
    const char* names[] = {"dq", "dk", "dv"};
    const Tensor* got[] = {&emulated.dq, &emulated.dk, &emulated.dv};
    const Tensor* want[] = {&reference.dq, &reference.dk, &reference.dv};
    for (int i = 0; i < 3; ++i) {
      const double error = testing::relative_error(as_f64(*got[i]), as_f64(*want[i]));
      EXPECT_LE(error, bound) << names[i] << " " << c.str
                              << (options.reverse ? " (reverse schedule)" : "");
      double& slot = worst[dtype == DType::f16 ? 0 : 1][i];
      slot = std::max(slot, error);
    }
  }
  EXPECT_GT(spatial_seen[1], 0);
  EXPECT_GT(spatial_seen[2], 0);
  EXPECT_GT(spatial_seen[3], 0);
  std::printf(
      "[emulated mma backward] %d calls; worst relative error f16 dq %.2e dk %.2e dv %.2e, bf16 "
      "dq %.2e dk %.2e dv %.2e\n",
      kCalls, worst[0][0], worst[0][1], worst[0][2], worst[1][0], worst[1][1], worst[1][2]);
}

TEST(NaMmaEmulated, LongKeyBoxesOfLargeWindowsMatchTheReference) {
  // 2-d 40 x 36, k 13 x 11 and 3-d 12 x 10 x 9, k 5: key boxes of 300-1000 keys, 5-16 chunks per
  // tile through the two-stage pipeline; D 64, bf16, no bias, a key tile at an offset.
  struct Geometry {
    Shape extent, kernel;
  };
  const Geometry geometries[] = {{{40, 36}, {13, 11}}, {{12, 10, 9}, {5, 5, 5}}};
  for (const Geometry& geometry : geometries) {
    CaseRng rng(testing::case_seed(103, 1, 0, static_cast<int>(geometry.extent.size())));
    KernelCase c;
    Shape full{1};
    for (size_t a = 0; a < geometry.extent.size(); ++a) {
      full.push_back(geometry.extent[a]);
      c.geometry.extent.push_back(geometry.extent[a]);
      c.geometry.kernel.push_back(geometry.kernel[a]);
      c.geometry.dilation.push_back(1);
      c.geometry.causal.push_back(0);
    }
    full.push_back(2);
    full.push_back(64);
    c.geometry.scale = 0.125;
    std::normal_distribution<double> normal;
    auto random = [&](const Shape& shape) {
      Tensor t = Tensor::empty(shape, DType::f64);
      for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = normal(rng.engine());
      return t.to_dtype(DType::bf16);
    };
    Tensor q = random(full), k = random(full), v = random(full);
    // The queries from 3 on along the first axis, the keys their windows read.
    for (size_t a = 0; a < geometry.extent.size(); ++a) {
      const int64_t first = a == 0 ? 3 : 0, length = geometry.extent[a];
      ops::kernels::NaAxis axis;
      axis.length = length;
      axis.kernel = geometry.kernel[a];
      int64_t lo, hi;
      ops::kernels::na_axis_key_range(axis, first, length, lo, hi);
      q = q.slice(1 + static_cast<int>(a), first, length);
      k = k.slice(1 + static_cast<int>(a), lo, hi);
      v = v.slice(1 + static_cast<int>(a), lo, hi);
      c.pieces.query_offset.push_back(first);
      c.pieces.key_offset.push_back(lo);
    }
    c.q = q.contiguous();
    c.k = k.contiguous();
    c.v = v.contiguous();
    c.str = fmt::format("q {} tile {} kernel {}", c.q.shape(), c.k.shape(), c.geometry.kernel);
    Shape lse_shape = c.q.shape();
    lse_shape.pop_back();
    const Tensor go = random(c.q.shape());
    Tensor glse = Tensor::empty(lse_shape, DType::f64);
    for (int64_t i = 0; i < glse.numel(); ++i) glse.data<double>()[i] = normal(rng.engine());
    glse = glse.to_dtype(DType::f32);
    const ops::NaForward emulated = run_emulated<__nv_bfloat16, 64>(c, {});
    const ops::NaForward reference = ops::na_forward(c.q, c.k, c.v, nullptr, c.geometry, c.pieces);
    EXPECT_LE(testing::relative_error(as_f64(emulated.output), as_f64(reference.output)), 5e-2)
        << c.str;
    EXPECT_LE(testing::relative_error(as_f64(emulated.lse), as_f64(reference.lse)), 1e-3) << c.str;
    const ops::NaGradients grads = run_emulated_backward<__nv_bfloat16, 64>(c, go, glse, {});
    const ops::NaGradients want =
        ops::na_backward(c.q, c.k, c.v, nullptr, go, &glse, c.geometry, c.pieces);
    EXPECT_LE(testing::relative_error(as_f64(grads.dq), as_f64(want.dq)), 5e-2) << "dq " << c.str;
    EXPECT_LE(testing::relative_error(as_f64(grads.dk), as_f64(want.dk)), 5e-2) << "dk " << c.str;
    EXPECT_LE(testing::relative_error(as_f64(grads.dv), as_f64(want.dv)), 5e-2) << "dv " << c.str;
  }
}

}  // namespace
}  // namespace tessera
