// The normalizations' slot math (ops/norm/norm_geometry.hpp): slot_planes lists exactly the
// planes whose slot_of is that slot, for every op's geometry on pieces with offsets and empty
// channel ranges; Chan's combination of the moments of any split of a sequence equals the
// two-pass moments of the whole, and an empty side leaves the other bit for bit.
#include "ops/norm/norm_geometry.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace tessera::ops::kernels {
namespace {

NormGeometry geometry(NormKind kind, int64_t batch, int64_t channels, int64_t first_channel,
                      int64_t total_channels, int64_t groups) {
  NormGeometry g;
  g.kind = kind;
  g.batch = batch;
  g.channels = channels;
  g.length = 3;
  g.channel_offset = first_channel;
  switch (kind) {
    case NormKind::batch:
      g.slots = total_channels;
      g.slot_offset = first_channel;
      break;
    case NormKind::group:
      g.slots = batch * groups;
      g.slot_stride = groups;
      g.slot_offset = first_channel;
      g.channels_per_slot = total_channels / groups;
      break;
    case NormKind::instance:
      g.slots = batch * channels;
      g.slot_stride = channels;
      break;
    case NormKind::layer:
      g.channels = 1;
      g.slots = batch;
      g.slot_stride = 1;
      break;
  }
  return g;
}

TEST(NormGeometry, SlotPlanesAreExactlyThePlanesOfEachSlot) {
  int checked = 0;
  for (NormKind kind : {NormKind::batch, NormKind::group, NormKind::instance, NormKind::layer})
    for (int64_t batch : {0, 1, 3})
      for (int64_t first = 0; first <= 6; ++first)
        for (int64_t channels = 0; first + channels <= 6; ++channels)
          for (int64_t groups : {1, 2, 3, 6}) {
            const NormGeometry g = geometry(kind, batch, channels, first, 6, groups);
            std::vector<int> seen(static_cast<size_t>(g.planes()), 0);
            for (int64_t slot = 0; slot < g.slots; ++slot) {
              const SlotPlanes planes = slot_planes(g, slot);
              for (int64_t n = planes.n_lo; n < planes.n_hi; ++n)
                for (int64_t c = planes.c_lo; c < planes.c_hi; ++c) {
                  const int64_t plane = n * g.channels + c;
                  ASSERT_LT(plane, g.planes());
                  EXPECT_EQ(g.slot_of(plane), slot);
                  ++seen[static_cast<size_t>(plane)];
                }
            }
            for (int count : seen) EXPECT_EQ(count, 1) << "every plane in exactly one slot";
            ++checked;
          }
  EXPECT_GT(checked, 300);
}

void two_pass(const std::vector<double>& values, size_t lo, size_t hi, double& count, double& mean,
              double& m2) {
  count = static_cast<double>(hi - lo);
  mean = 0;
  for (size_t i = lo; i < hi; ++i) mean += values[i];
  mean = hi > lo ? mean / count : 0.0;
  m2 = 0;
  for (size_t i = lo; i < hi; ++i) m2 += (values[i] - mean) * (values[i] - mean);
}

TEST(NormGeometry, ChanCombinationEqualsTheMomentsOfTheWhole) {
  std::mt19937_64 generator(5);
  std::normal_distribution<double> pick(1e4, 1.0);  // a large mean: E[x^2] - E[x]^2 would fail
  std::vector<double> values(1000);
  for (double& value : values) value = pick(generator);
  double count, mean, m2;
  two_pass(values, 0, values.size(), count, mean, m2);
  for (size_t parts : {2, 3, 7, 50}) {
    double c = 0, m = 0, s = 0;
    for (size_t p = 0; p < parts; ++p) {
      double pc, pm, ps;
      two_pass(values, p * values.size() / parts, (p + 1) * values.size() / parts, pc, pm, ps);
      combine_moments(c, m, s, pc, pm, ps);
    }
    EXPECT_EQ(c, count);
    EXPECT_NEAR(m, mean, 1e-12 * std::fabs(mean));
    EXPECT_NEAR(s, m2, 1e-9 * m2) << parts << " parts";
  }
  double c = 0, m = 0, s = 0;
  combine_moments(c, m, s, count, mean, m2);
  combine_moments(c, m, s, 0, 123.0, 456.0);
  EXPECT_EQ(c, count);
  EXPECT_EQ(m, mean);
  EXPECT_EQ(s, m2);
}

}  // namespace
}  // namespace tessera::ops::kernels
