// The warp-per-row statistics of softmax and log_softmax on cuda (ops/softmax/softmax_rows.cuh)
// run on the cpu under the emulation of the CUDA thread model and its warp shuffles
// (tests/emu/cuda_block_emulator.hpp): on rows of 0 to 1000 elements, more rows than the grid's
// warps (the grid-stride loop) and fewer, in f32, f64, f16 and bf16, the peak of every row is its
// largest element (NaN when one is NaN, -inf when empty), the totals are the f64 sums of
// exp(x - peak), of g and of g * y within 1e-13 of the sums in order, in both thread schedules,
// and nothing past the last row is written.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "ops/softmax/softmax_cuda.cuh"  // (with cuda_runtime.h) before the emulator's macros
#include "tests/dist/shard_cases.hpp"
#include "tests/emu/cuda_block_emulator.hpp"
// The kernels under test, after the emulator (which defines the built-ins they name).
#include "ops/softmax/softmax_rows.cuh"

namespace tessera {
namespace {

namespace rows = ops::kernels::rows;
using testing::CaseRng;

template <typename T>
T stored(double value) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(static_cast<float>(value));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(static_cast<float>(value));
  else
    return static_cast<T>(value);
}

template <typename T>
void expect_row_statistics(const char* type) {
  constexpr double kUnset = 12345.0;  // what the outputs hold before the kernels
  int case_index = 0;
  for (int64_t length : {0, 1, 5, 31, 32, 33, 100, 1000})
    for (int64_t outer : {1, 3, 70})
      for (bool reverse : {false, true}) {
        const std::string name = std::string(type) + " rows " + std::to_string(outer) + " x " +
                                 std::to_string(length) + (reverse ? " reversed" : "");
        CaseRng rng(testing::case_seed(101, static_cast<int>(length), case_index++, 0));
        std::vector<T> x(static_cast<size_t>(outer * length)), g(x.size()), y(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
          x[i] = stored<T>(0.01 * static_cast<double>(rng.uniform(-800, 800)));
          g[i] = stored<T>(0.01 * static_cast<double>(rng.uniform(-100, 100)));
          y[i] = stored<T>(0.001 * static_cast<double>(rng.uniform(0, 1000)));
        }
        if (outer > 1 && length > 2) x[static_cast<size_t>(length + length / 2)] = stored<T>(NAN);
        const ops::kernels::SoftmaxSlots s{outer, length, 1};
        // One more slot than rows: nothing may be written there.
        std::vector<double> peak(outer + 1, kUnset), total(outer + 1, kUnset),
            grad_log(outer + 1, kUnset), grad(outer + 1, kUnset);
        // Two blocks of two warps: 70 rows take the grid-stride loop 18 times.
        const emu::LaunchOptions options{.reverse = reverse};
        emu::launch(
            dim3(2), 64, 0, [&] { rows::row_peak_kernel<T>(s, x.data(), peak.data()); }, options);
        emu::launch(
            dim3(2), 64, 0,
            [&] { rows::row_total_kernel<T>(s, x.data(), peak.data(), total.data()); }, options);
        emu::launch(
            dim3(2), 64, 0,
            [&] { rows::row_grad_total_kernel<T>(s, y.data(), g.data(), true, grad_log.data()); },
            options);
        emu::launch(
            dim3(2), 64, 0,
            [&] { rows::row_grad_total_kernel<T>(s, y.data(), g.data(), false, grad.data()); },
            options);
        int64_t wrong = 0;
        for (int64_t r = 0; r < outer; ++r) {
          double best = -INFINITY, sum = 0, g_sum = 0, gy_sum = 0, magnitude = 0;
          bool nan = false;
          for (int64_t l = 0; l < length; ++l) {
            const double v = rows::widen(x[r * length + l]);
            nan |= std::isnan(v);
            best = std::max(best, v);
          }
          if (nan) best = NAN;
          for (int64_t l = 0; l < length; ++l) {
            const size_t at = static_cast<size_t>(r * length + l);
            sum += std::exp(rows::widen(x[at]) - best);
            g_sum += rows::widen(g[at]);
            gy_sum += rows::widen(g[at]) * rows::widen(y[at]);
            magnitude += std::fabs(rows::widen(g[at]));
          }
          wrong += nan ? !std::isnan(peak[r]) : peak[r] != best;
          wrong += nan ? !std::isnan(total[r]) : !(std::fabs(total[r] - sum) <= 1e-13 * (sum + 1));
          wrong += !(std::fabs(grad_log[r] - g_sum) <= 1e-13 * (magnitude + 1));
          wrong += !(std::fabs(grad[r] - gy_sum) <= 1e-13 * (magnitude + 1));
          if (length == 0) wrong += peak[r] != -INFINITY || total[r] != 0;
        }
        wrong += peak[outer] != kUnset || total[outer] != kUnset || grad[outer] != kUnset ||
                 grad_log[outer] != kUnset;
        EXPECT_EQ(wrong, 0) << name;
      }
}

TEST(SoftmaxRowsEmulated, WarpPerRowStatisticsAreTheRowsMaxAndSums) {
  expect_row_statistics<float>("f32");
  expect_row_statistics<double>("f64");
  expect_row_statistics<__half>("f16");
  expect_row_statistics<__nv_bfloat16>("bf16");
}

}  // namespace
}  // namespace tessera
