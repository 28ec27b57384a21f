// Unit tests of the 1-d split math of layout.hpp: default_split, offsets_of and owner_of.
#include <gtest/gtest.h>

#include <vector>

#include "core/errors.hpp"
#include "core/layout.hpp"
#include "tests/common/layout_cases.hpp"

namespace tessera {
namespace {

using Extents = std::vector<int64_t>;

TEST(DefaultSplit, FirstRemainderPartsGetOneMore) {
  EXPECT_EQ(default_split(10, 4), (Extents{3, 3, 2, 2}));
  EXPECT_EQ(default_split(11, 4), (Extents{3, 3, 3, 2}));
  EXPECT_EQ(default_split(12, 4), (Extents{3, 3, 3, 3}));
  EXPECT_EQ(default_split(7, 1), (Extents{7}));
  for (int64_t n = 0; n <= 40; ++n) {
    for (int parts = 1; parts <= 9; ++parts) {
      const Extents extents = default_split(n, parts);
      ASSERT_EQ(static_cast<int>(extents.size()), parts);
      int64_t total = 0;
      for (int p = 0; p < parts; ++p) {
        EXPECT_EQ(extents[p], n / parts + (p < n % parts ? 1 : 0)) << "n=" << n << " p=" << parts;
        total += extents[p];
      }
      EXPECT_EQ(total, n);
    }
  }
}

TEST(DefaultSplit, FewerElementsThanPartsGivesTrailingZeros) {
  EXPECT_EQ(default_split(3, 5), (Extents{1, 1, 1, 0, 0}));
  EXPECT_EQ(default_split(1, 4), (Extents{1, 0, 0, 0}));
  EXPECT_EQ(default_split(0, 3), (Extents{0, 0, 0}));
}

TEST(DefaultSplit, RejectsNonPositivePartsAndNegativeCounts) {
  EXPECT_THROW(default_split(4, 0), InvalidArgument);
  EXPECT_THROW(default_split(4, -2), InvalidArgument);
  EXPECT_THROW(default_split(-1, 2), InvalidArgument);
}

TEST(OffsetsOf, ArePrefixSumsStartingAtZero) {
  EXPECT_EQ(offsets_of({3, 0, 2}), (Extents{0, 3, 3, 5}));
  EXPECT_EQ(offsets_of({0, 0}), (Extents{0, 0, 0}));
  EXPECT_EQ(offsets_of({}), (Extents{0}));
  EXPECT_EQ(offsets_of({4}), (Extents{0, 4}));
}

TEST(OwnerOf, SkipsEmptyParts) {
  const Extents extents{0, 3, 0, 0, 2, 0};
  EXPECT_EQ(owner_of(0, extents), 1);
  EXPECT_EQ(owner_of(2, extents), 1);
  EXPECT_EQ(owner_of(3, extents), 4);
  EXPECT_EQ(owner_of(4, extents), 4);
  EXPECT_EQ(owner_of(0, Extents{0, 0, 1}), 2);
  EXPECT_EQ(owner_of(0, Extents{1, 0, 0}), 0);
}

TEST(OwnerOf, RejectsIndicesOutsideTheExtent) {
  EXPECT_THROW(owner_of(-1, Extents{2, 2}), InvalidArgument);
  EXPECT_THROW(owner_of(4, Extents{2, 2}), InvalidArgument);
  EXPECT_THROW(owner_of(0, Extents{0, 0}), InvalidArgument);
}

TEST(OwnerOf, IsTheUniquePartWhoseRangeContainsTheIndex) {
  testing::CaseRng rng(20240611);
  for (int trial = 0; trial < 500; ++trial) {
    const int parts = static_cast<int>(rng.uniform(1, 12));
    const int64_t total = rng.uniform(0, 30);
    const Extents extents = testing::random_extents(total, parts, rng);
    const Extents offsets = offsets_of(extents);
    ASSERT_EQ(offsets.back(), total);
    for (int64_t index = 0; index < total; ++index) {
      int containing = 0;
      int expected = -1;
      for (int p = 0; p < parts; ++p) {
        if (offsets[p] <= index && index < offsets[p] + extents[p]) {
          ++containing;
          expected = p;
        }
      }
      ASSERT_EQ(containing, 1);
      EXPECT_EQ(owner_of(index, extents), expected)
          << "index " << index << " extents " << ::testing::PrintToString(extents);
    }
  }
}

}  // namespace
}  // namespace tessera
