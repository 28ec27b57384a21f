// Unit tests of Box: extents, volume, moves, formatting and intersection.
#include "core/box.hpp"

#include <gtest/gtest.h>

#include "core/errors.hpp"
#include "tests/common/layout_cases.hpp"

namespace tessera {
namespace {

TEST(Box, ShapeVolumeAndEmptinessFollowTheExtents) {
  const Box box{{1, 0, 2}, {4, 5, 2}};
  EXPECT_EQ(box.ndim(), 3u);
  EXPECT_EQ(box.shape(), (Shape{3, 5, 0}));
  EXPECT_EQ(box.volume(), 0);
  EXPECT_TRUE(box.empty());
  EXPECT_EQ(Box::of_shape({2, 3}), (Box{{0, 0}, {2, 3}}));
  EXPECT_EQ(Box::of_shape({2, 3}).volume(), 6);
  EXPECT_EQ(Box::of_shape({}).volume(), 1);  // a 0-d box holds one index
  EXPECT_EQ((Box{{5}, {3}}).extent(0), 0);   // inverted ranges count as empty
}

TEST(Box, RelativeToAndShiftedAreInverses) {
  const Box box{{3, 4}, {6, 9}};
  const Box local = box.relative_to({3, 2});
  EXPECT_EQ(local, (Box{{0, 2}, {3, 7}}));
  EXPECT_EQ(local.shifted({3, 2}), box);
}

TEST(Box, StrListsTheRanges) {
  EXPECT_EQ((Box{{0, 1}, {2, 3}}).str(), "[0:2, 1:3]");
  EXPECT_EQ(Box::of_shape({}).str(), "[]");
}

TEST(BoxIntersect, OverlappingBoxesGiveTheCommonPart) {
  const Box a{{0, 2}, {4, 6}};
  const Box b{{2, 0}, {8, 3}};
  EXPECT_EQ(intersect(a, b), (Box{{2, 2}, {4, 3}}));
}

TEST(BoxIntersect, DisjointBoxesGiveAnEmptyBoxWithNonNegativeExtents) {
  const Box a{{0, 0}, {2, 2}};
  const Box b{{5, 1}, {7, 2}};
  const Box common = intersect(a, b);
  EXPECT_TRUE(common.empty());
  for (size_t d = 0; d < common.ndim(); ++d) EXPECT_GE(common.hi[d], common.lo[d]);
  // Touching boxes share no index.
  EXPECT_TRUE(intersect(Box{{0}, {3}}, Box{{3}, {5}}).empty());
}

TEST(BoxIntersect, RejectsBoxesOfDifferentRank) {
  EXPECT_THROW(intersect(Box{{0}, {1}}, Box{{0, 0}, {1, 1}}), InvalidArgument);
}

TEST(BoxIntersect, IsCommutativeAndHoldsExactlyTheIndicesInBoth) {
  testing::CaseRng rng(99);
  for (int trial = 0; trial < 300; ++trial) {
    Box a{{0, 0}, {0, 0}}, b{{0, 0}, {0, 0}};
    for (int d = 0; d < 2; ++d) {
      a.lo[d] = rng.uniform(0, 6);
      a.hi[d] = a.lo[d] + rng.uniform(0, 4);
      b.lo[d] = rng.uniform(0, 6);
      b.hi[d] = b.lo[d] + rng.uniform(0, 4);
    }
    const Box ab = intersect(a, b);
    EXPECT_EQ(ab.volume(), intersect(b, a).volume());
    int64_t both = 0;
    for (int64_t i = 0; i < 10; ++i)
      for (int64_t j = 0; j < 10; ++j) {
        const bool in_a = a.lo[0] <= i && i < a.hi[0] && a.lo[1] <= j && j < a.hi[1];
        const bool in_b = b.lo[0] <= i && i < b.hi[0] && b.lo[1] <= j && j < b.hi[1];
        const bool in_ab = ab.lo[0] <= i && i < ab.hi[0] && ab.lo[1] <= j && j < ab.hi[1];
        EXPECT_EQ(in_ab, in_a && in_b);
        both += in_a && in_b;
      }
    EXPECT_EQ(ab.volume(), both);
  }
}

}  // namespace
}  // namespace tessera
