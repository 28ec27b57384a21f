// The host-and-device window logic of the neighborhood attention cuda kernels
// (ops/attention/na_cuda_plan.hpp), checked exhaustively for small extents on the cpu: the
// window equals the reference's na_window; the inverse window of a key is exactly the set of
// local queries whose window holds it (every local piece); the key range of a run of queries is
// the union of their windows and the query range of a run of keys the union of their inverse
// windows; and the dispatch sends only half types with a tiled head dim (on a device with bf16
// tensor cores, aligned rows, a grid that fits) to the fused kernel; and the kernels' view of a
// validated call (what the launches receive) carries its bias flag, pieces and tiles.
#include "ops/attention/na_cuda_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "ops/attention/na_problem.hpp"
#include "ops/attention/na_reference.hpp"

namespace tessera {
namespace {

using ops::kernels::NaAxis;
using ops::kernels::NaSpan;

/// Calls fn(axis) for every extent up to `max_length`, kernel, dilation with k * d <= L, causal
/// flag and local query piece [offset, offset + queries) (the tile is the whole axis).
template <typename Fn>
void for_each_axis(int64_t max_length, Fn&& fn) {
  for (int64_t length = 1; length <= max_length; ++length)
    for (int64_t kernel = 1; kernel <= length; ++kernel)
      for (int64_t dilation = 1; kernel * dilation <= length; ++dilation)
        for (int causal = 0; causal <= 1; ++causal)
          for (int64_t offset = 0; offset <= length; ++offset)
            for (int64_t queries = 0; offset + queries <= length; ++queries) {
              NaAxis axis;
              axis.length = length;
              axis.kernel = kernel;
              axis.dilation = dilation;
              axis.causal = causal;
              axis.query_offset = offset;
              axis.queries = queries;
              axis.tile_offset = 0;
              axis.tile = length;
              fn(axis);
            }
}

std::vector<int64_t> members(const NaSpan& span) {
  std::vector<int64_t> out;
  for (int64_t t = 0; t < span.count; ++t) out.push_back(span.first + t * span.step);
  return out;
}

TEST(NaCudaPlan, AxisWindowIsTheReferenceWindow) {
  for_each_axis(16, [](const NaAxis& axis) {
    if (axis.query_offset != 0 || axis.queries != axis.length) return;
    for (int64_t i = 0; i < axis.length; ++i) {
      const ops::NaWindow expected =
          ops::na_window(i, axis.length, axis.kernel, axis.dilation, axis.causal != 0);
      const NaSpan span = ops::kernels::na_axis_window(axis, i);
      ASSERT_EQ(span.first, expected.first) << axis.length << " " << axis.kernel << " " << i;
      ASSERT_EQ(span.count, expected.count);
      ASSERT_EQ(span.step, expected.step);
      ASSERT_EQ(span.end(), expected.end());
      for (int64_t j = 0; j < axis.length; ++j) {
        const std::vector<int64_t> keys = members(span);
        ASSERT_EQ(span.holds(j), std::find(keys.begin(), keys.end(), j) != keys.end());
      }
    }
  });
}

TEST(NaCudaPlan, InverseWindowIsExactlyTheLocalQueriesReadingTheKey) {
  int64_t checked = 0;
  for_each_axis(12, [&](const NaAxis& axis) {
    for (int64_t j = 0; j < axis.length; ++j) {
      std::vector<int64_t> expected;
      for (int64_t i = axis.query_offset; i < axis.query_offset + axis.queries; ++i)
        if (ops::kernels::na_axis_window(axis, i).holds(j)) expected.push_back(i);
      const NaSpan span = ops::kernels::na_axis_inverse_window(axis, j);
      ASSERT_EQ(members(span), expected)
          << "L " << axis.length << " k " << axis.kernel << " d " << axis.dilation << " causal "
          << axis.causal << " piece [" << axis.query_offset << ", "
          << axis.query_offset + axis.queries << ") key " << j;
      ++checked;
    }
  });
  EXPECT_GT(checked, 10000);
}

TEST(NaCudaPlan, KeyAndQueryRangesAreTheUnionsOfTheWindows) {
  for_each_axis(10, [](const NaAxis& axis) {
    const int64_t piece_end = axis.query_offset + axis.queries;
    // Runs of local queries (a fused query tile) and their key box.
    for (int64_t first = axis.query_offset; first < piece_end; ++first)
      for (int64_t last = first + 1; last <= piece_end; ++last) {
        int64_t lo = axis.length, hi = 0;
        for (int64_t i = first; i < last; ++i) {
          const NaSpan w = ops::kernels::na_axis_window(axis, i);
          lo = std::min(lo, w.first);
          hi = std::max(hi, w.end());
        }
        int64_t got_lo, got_hi;
        ops::kernels::na_axis_key_range(axis, first, last, got_lo, got_hi);
        ASSERT_EQ(got_lo, lo);
        ASSERT_EQ(got_hi, hi);
      }
    // Runs of keys and the local queries that read them.
    for (int64_t first = 0; first < axis.length; ++first)
      for (int64_t last = first + 1; last <= axis.length; ++last) {
        int64_t lo = piece_end, hi = axis.query_offset;
        for (int64_t j = first; j < last; ++j)
          for (int64_t i : members(ops::kernels::na_axis_inverse_window(axis, j))) {
            lo = std::min(lo, i);
            hi = std::max(hi, i + 1);
          }
        if (hi < lo) hi = lo;
        int64_t got_lo, got_hi;
        ops::kernels::na_axis_query_range(axis, first, last, got_lo, got_hi);
        ASSERT_EQ(got_lo, lo);
        ASSERT_EQ(got_hi, hi);
      }
  });
}

TEST(NaCudaPlan, BoxCapacityBoundsEveryTilesKeyBoxAndQueryBox) {
  int64_t checked = 0;
  for_each_axis(14, [&](const NaAxis& axis) {
    const int64_t piece_end = axis.query_offset + axis.queries;
    for (int64_t extent : {1, 2, 4, 8, 64}) {
      const int64_t capacity = ops::kernels::na_box_capacity(axis, extent);
      for (int64_t first = axis.query_offset; first < piece_end; ++first) {
        int64_t lo, hi;
        ops::kernels::na_axis_key_range(axis, first, std::min(first + extent, piece_end), lo, hi);
        ASSERT_LE(hi - lo, capacity)
            << "key box of queries [" << first << ", +" << extent << ") L " << axis.length << " k "
            << axis.kernel << " d " << axis.dilation << " causal " << axis.causal;
        ++checked;
      }
      for (int64_t first = 0; first < axis.length; ++first) {
        int64_t lo, hi;
        ops::kernels::na_axis_query_range(axis, first, std::min(first + extent, axis.length), lo,
                                          hi);
        ASSERT_LE(hi - lo, capacity)
            << "query box of keys [" << first << ", +" << extent << ") L " << axis.length << " k "
            << axis.kernel << " d " << axis.dilation << " causal " << axis.causal;
        ++checked;
      }
    }
  });
  EXPECT_GT(checked, 10000);
}

TEST(NaCudaPlan, DispatchSendsHalfTypesWithATiledHeadDimToTheFusedKernel) {
  using ops::kernels::choose_na_kernel;
  using ops::kernels::NaElement;
  using ops::kernels::NaKernel;
  for (NaElement element : {NaElement::f32, NaElement::f64, NaElement::f16, NaElement::bf16})
    for (int64_t dim : {1, 8, 16, 31, 32, 48, 64, 96, 128, 256}) {
      const bool half = element == NaElement::f16 || element == NaElement::bf16;
      const bool tiled = dim == 32 || dim == 64 || dim == 128;
      EXPECT_EQ(choose_na_kernel(element, dim, 8, true, true),
                half && tiled ? NaKernel::fused : NaKernel::plain);
      EXPECT_EQ(choose_na_kernel(element, dim, 8, false, true), NaKernel::plain)
          << "unaligned rows take the plain kernel";
      EXPECT_EQ(choose_na_kernel(element, dim, 8, true, false), NaKernel::plain)
          << "a device without bf16 tensor cores takes the plain kernel";
      EXPECT_EQ(choose_na_kernel(element, dim, ops::kernels::kFusedMaxBatchHeads + 1, true, true),
                NaKernel::plain)
          << "too many (batch, head) pairs for the fused grid";
    }
}

TEST(NaCudaPlan, TheTensorCoreFamilyIsWhatTesseraNaCudaKernelNames) {
  using ops::kernels::NaKernel;
  using ops::kernels::parse_na_kernel_family;
  NaKernel kernel = NaKernel::plain;
  EXPECT_TRUE(parse_na_kernel_family(nullptr, NaKernel::fused, kernel));
  EXPECT_EQ(kernel, NaKernel::fused);
  EXPECT_TRUE(parse_na_kernel_family("", NaKernel::mma, kernel));
  EXPECT_EQ(kernel, NaKernel::mma);
  EXPECT_TRUE(parse_na_kernel_family("mma", NaKernel::fused, kernel));
  EXPECT_EQ(kernel, NaKernel::mma);
  EXPECT_TRUE(parse_na_kernel_family("fused", NaKernel::mma, kernel));
  EXPECT_EQ(kernel, NaKernel::fused);
  for (const char* bad : {"plain", "MMA", "mm", "mmax", "fused ", "1"}) {
    kernel = NaKernel::plain;
    EXPECT_FALSE(parse_na_kernel_family(bad, NaKernel::fused, kernel)) << bad;
    EXPECT_EQ(kernel, NaKernel::plain) << bad << ": a refused value changes nothing";
  }
  EXPECT_STREQ(ops::kernels::na_kernel_name(NaKernel::plain), "plain");
  EXPECT_STREQ(ops::kernels::na_kernel_name(NaKernel::fused), "fused");
  EXPECT_STREQ(ops::kernels::na_kernel_name(NaKernel::mma), "mma");
}

// The mma kernels split box items in 32 bits: a call whose boxes could hold 2^31 items or more
// (windows spread by a large dilation over long axes) runs the fused kernels instead.
TEST(NaCudaPlan, MmaBoxesFitInThirtyTwoBitsUnlessTheWindowsSpanBillionsOfItems) {
  auto call_of = [](int spatial, int64_t length, int64_t kernel, int64_t dilation) {
    ops::kernels::NaCall call{};
    call.spatial = spatial;
    for (int a = 0; a < 3; ++a) {
      const bool user = a >= 3 - spatial;
      NaAxis& axis = call.axes[a];
      axis.length = user ? length : 1;
      axis.kernel = user ? kernel : 1;
      axis.dilation = user ? dilation : 1;
      axis.queries = axis.tile = axis.length;
    }
    return call;
  };
  using ops::kernels::na_mma_boxes_fit;
  EXPECT_TRUE(na_mma_boxes_fit(call_of(2, 256, 7, 1)));
  EXPECT_TRUE(na_mma_boxes_fit(call_of(3, 2048, 31, 1)));                    // 66^3 items
  EXPECT_TRUE(na_mma_boxes_fit(call_of(3, 4096, 31, 20)));                   // 1244^3 < 2^31
  EXPECT_FALSE(na_mma_boxes_fit(call_of(3, 4096, 31, 21)));                  // 1306^3 > 2^31
  EXPECT_FALSE(na_mma_boxes_fit(call_of(2, 100000, 31, 1000)));              // 62008^2
  EXPECT_TRUE(na_mma_boxes_fit(call_of(1, int64_t{1} << 29, 31, 1000000)));  // one axis: 62 M
}

// The mma kernels' box splits divide by multiplying (NaFastDiv): exact for every divisor and
// every dividend below 2^31, checked for all divisors to 4,096 (every dividend to 2d + 2, the
// multiples of d around q = 1,000 and the largest, random ones) and for divisors around every
// power of two up to 2^31 - 1.
TEST(NaCudaPlan, FastDivisionIsExactBelowTwoToThe31) {
  using ops::kernels::na_divide;
  using ops::kernels::na_fast_div;
  const uint32_t top = (uint32_t{1} << 31) - 1;
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return static_cast<uint32_t>((z ^ (z >> 31)) & top);
  };
  int64_t checked = 0, wrong = 0;
  uint32_t first_n = 0, first_d = 0;
  auto check = [&](uint32_t d) {
    const auto f = na_fast_div(d);
    auto one = [&](uint32_t n) {
      ++checked;
      if (na_divide(n, f) != n / d || f.divisor != d) {
        if (wrong++ == 0) first_n = n, first_d = d;
      }
    };
    for (uint32_t n = 0; n <= 2 * d + 2 && n <= 10'000; ++n) one(n);
    for (uint32_t q : {uint32_t{1000}, top / d - 1, top / d})
      for (int64_t off = -2; off <= 2; ++off) {
        const int64_t n = int64_t{q} * d + off;
        if (n >= 0 && n <= top) one(static_cast<uint32_t>(n));
      }
    for (int i = 0; i < 64; ++i) one(next());
    one(top);
  };
  for (uint32_t d = 1; d <= 4096; ++d) check(d);
  for (int s = 12; s <= 31; ++s)
    for (int64_t off = -3; off <= 3; ++off) {
      const int64_t d = (int64_t{1} << s) + off;
      if (d >= 1 && d <= top) check(static_cast<uint32_t>(d));
    }
  EXPECT_EQ(wrong, 0) << "first wrong: " << first_n << " / " << first_d << " (of " << checked
                      << " checked)";
  EXPECT_GT(checked, 17'000'000);
}

TEST(NaCudaPlan, TheMmaForwardsBlocksPerSmAreFourByDefaultOrAuto) {
  using ops::kernels::parse_na_mma_forward_blocks;
  int blocks = -1;
  for (const char* value : {static_cast<const char*>(nullptr), "", "4"}) {
    blocks = -1;
    EXPECT_TRUE(parse_na_mma_forward_blocks(value, blocks)) << (value ? value : "null");
    EXPECT_EQ(blocks, 4);
  }
  EXPECT_TRUE(parse_na_mma_forward_blocks("auto", blocks));
  EXPECT_EQ(blocks, 0);
  for (const char* bad : {"3", "5", "0", "four", "4 ", "AUTO"}) {
    blocks = -1;
    EXPECT_FALSE(parse_na_mma_forward_blocks(bad, blocks)) << bad;
    EXPECT_EQ(blocks, -1) << bad << ": a refused value changes nothing";
  }
}

TEST(NaCudaPlan, FusedTilesHoldSixtyFourQueriesOnTheUserAxes) {
  for (int spatial = 1; spatial <= 3; ++spatial) {
    int64_t tile[3];
    ops::kernels::na_fused_tile_shape(spatial, tile);
    EXPECT_EQ(tile[0] * tile[1] * tile[2], ops::kernels::kFusedQueries);
    for (int a = 0; a < 3 - spatial; ++a) EXPECT_EQ(tile[a], 1) << "padding axes stay 1 wide";
  }
}

TEST(NaCudaPlan, CallOfAProblemCarriesItsBiasPiecesAndTiles) {
  // na2d, queries [3, 7) x [0, 6) of a 12 x 6 field, kernel 3 x 5, dilation 2 x 1; the keys
  // they read, [1, 9) x [0, 6), are the tile.
  ops::NaGeometry geometry;
  geometry.extent = {12, 6};
  geometry.kernel = {3, 5};
  geometry.dilation = {2, 1};
  geometry.causal = {0, 0};
  geometry.scale = 0.25;
  const ops::NaPieces pieces{{3, 0}, {1, 0}};
  const Tensor q = Tensor::zeros({2, 4, 6, 3, 8}, DType::f32);
  const Tensor k = Tensor::zeros({2, 8, 6, 3, 8}, DType::f32);
  const Tensor rpb = Tensor::zeros(ops::na_rpb_shape(3, geometry), DType::f32);
  for (const Tensor* bias : {&rpb, static_cast<const Tensor*>(nullptr)}) {
    const auto problem = ops::na_detail::make_problem(q, k, k, bias, geometry, pieces);
    const ops::kernels::NaCall call = ops::na_detail::make_na_call(problem, geometry);
    EXPECT_EQ(call.has_rpb, bias != nullptr) << "the kernels add the bias and write d rpb only "
                                                "when the call says it has one";
    EXPECT_EQ(call.spatial, 2);
    EXPECT_EQ(call.batch, 2);
    EXPECT_EQ(call.heads, 3);
    EXPECT_EQ(call.dim, 8);
    EXPECT_EQ(call.scale, 0.25);
    EXPECT_EQ(call.rpb_count(), 5 * 9) << "one head's table";
    EXPECT_EQ(call.rpb_count() * call.heads, rpb.numel());
    const int64_t length[] = {1, 12, 6}, kernel[] = {1, 3, 5}, dilation[] = {1, 2, 1};
    const int64_t query_offset[] = {0, 3, 0}, queries[] = {1, 4, 6};
    const int64_t tile_offset[] = {0, 1, 0}, tile[] = {1, 8, 6};
    for (int a = 0; a < 3; ++a) {
      EXPECT_EQ(call.axes[a].length, length[a]) << a;
      EXPECT_EQ(call.axes[a].kernel, kernel[a]) << a;
      EXPECT_EQ(call.axes[a].dilation, dilation[a]) << a;
      EXPECT_EQ(call.axes[a].causal, 0) << a;
      EXPECT_EQ(call.axes[a].query_offset, query_offset[a]) << a;
      EXPECT_EQ(call.axes[a].queries, queries[a]) << a;
      EXPECT_EQ(call.axes[a].tile_offset, tile_offset[a]) << a;
      EXPECT_EQ(call.axes[a].tile, tile[a]) << a;
    }
  }
}

}  // namespace
}  // namespace tessera
