// The index math of interpolate (ops/interpolate/interpolate_taps.hpp, source_output_extents in
// ops/op_helpers.hpp): PyTorch's source cells and weights for hand-checked cases, source cells
// that never decrease with the output index and stay inside the input, and output ownership by
// the owner of the source cell.
#include "ops/interpolate/interpolate_taps.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/op_helpers.hpp"

namespace tessera {
namespace {

using ops::kernels::interp_source;
using ops::kernels::InterpMode;

TEST(InterpolateTaps, SourceCellsFollowPyTorchsRules) {
  // nearest, L=5 -> 3 (s = 5/3): floor(0), floor(5/3), floor(10/3).
  const int64_t nearest[] = {0, 1, 3};
  for (int64_t o = 0; o < 3; ++o)
    EXPECT_EQ(interp_source(InterpMode::nearest, 5.0 / 3, false, 5, o).i0, nearest[o]);
  // nearest-exact, L=5 -> 3: floor(0.5 s), floor(1.5 s), floor(2.5 s) = 0, 2, 4.
  const int64_t exact[] = {0, 2, 4};
  for (int64_t o = 0; o < 3; ++o)
    EXPECT_EQ(interp_source(InterpMode::nearest_exact, 5.0 / 3, false, 5, o).i0, exact[o]);
  // linear, L=4 -> 8 (s = 0.5): o=0 clamps to 0, o=3 at 1.25, the last at 3.25 clamps to cell 3.
  auto tap = interp_source(InterpMode::linear, 0.5, false, 4, 0);
  EXPECT_EQ(tap.i0, 0);
  EXPECT_EQ(tap.i1, 1);
  EXPECT_EQ(tap.w1, 0.0);
  tap = interp_source(InterpMode::linear, 0.5, false, 4, 3);
  EXPECT_EQ(tap.i0, 1);
  EXPECT_EQ(tap.i1, 2);
  EXPECT_DOUBLE_EQ(tap.w1, 0.25);
  EXPECT_DOUBLE_EQ(tap.w0, 0.75);
  tap = interp_source(InterpMode::linear, 0.5, false, 4, 7);
  EXPECT_EQ(tap.i0, 3);
  EXPECT_EQ(tap.i1, 3);
  // align_corners, L=4 -> 7 (s = 0.5): o=5 at exactly 2.5.
  tap = interp_source(InterpMode::linear, 0.5, true, 4, 5);
  EXPECT_EQ(tap.i0, 2);
  EXPECT_DOUBLE_EQ(tap.w1, 0.5);
}

TEST(InterpolateTaps, SourcesNeverDecreaseAndStayInside) {
  for (int mode = 0; mode < 3; ++mode)
    for (int64_t length = 1; length <= 9; ++length)
      for (int64_t out = 1; out <= 20; ++out)
        for (bool corners : {false, true}) {
          const double s = corners ? (out > 1 ? double(length - 1) / double(out - 1) : 0.0)
                                   : double(length) / double(out);
          int64_t last = 0;
          for (int64_t o = 0; o < out; ++o) {
            const auto tap = interp_source(static_cast<InterpMode>(mode), s, corners, length, o);
            EXPECT_GE(tap.i0, last);
            EXPECT_GE(tap.i1, tap.i0);
            EXPECT_LT(tap.i1, length);
            EXPECT_NEAR(tap.w0 + tap.w1, 1.0, 1e-15);
            last = tap.i0;
          }
        }
}

TEST(InterpolateTaps, OutputsGoToTheOwnerOfTheirSourceCell) {
  // 7 inputs split 3, 0, 4; 14 outputs reading o/2: outputs 0..5 to part 0, 6..13 to part 2.
  EXPECT_EQ(ops::source_output_extents({3, 0, 4}, 7, 14, [](int64_t o) { return o / 2; }),
            (std::vector<int64_t>{6, 0, 8}));
  // Downsampling 8 -> 2 (o*4): part 1 of {2, 2, 4} owns no output.
  EXPECT_EQ(ops::source_output_extents({2, 2, 4}, 8, 2, [](int64_t o) { return o * 4; }),
            (std::vector<int64_t>{1, 0, 1}));
}

}  // namespace
}  // namespace tessera
