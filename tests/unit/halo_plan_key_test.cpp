// Unit tests of the halo-plan cache key: equal keys hash equally, every field changes the key,
// and the cache hands out one plan per key.
#include <gtest/gtest.h>

#include "core/halo/halo_plan.hpp"

namespace tessera {
namespace {

HaloPlanKey sample_key() {
  const ShardSpec spec =
      ShardSpec::make({10, 8}, {2, 1}, {Placement::shard(0), Placement::replicate()}, {{6, 4}, {}});
  return HaloPlanKey{
      spec, grown_boxes(spec, {1, 0}, {1, 0}), {BoundaryMode::zero, BoundaryMode::periodic}, 1};
}

TEST(HaloPlanKey, EqualKeysHashEqually) {
  EXPECT_EQ(sample_key(), sample_key());
  EXPECT_EQ(hash_of(sample_key()), hash_of(sample_key()));
}

TEST(HaloPlanKey, EveryFieldChangesTheKeyAndItsHash) {
  const HaloPlanKey base = sample_key();
  std::vector<HaloPlanKey> changed(5, base);
  changed[0].rank = 0;
  changed[1].boundary[1] = BoundaryMode::zero;
  changed[2].needed[0].hi[0] += 1;
  changed[3].spec =
      ShardSpec::make({10, 8}, {2, 1}, {Placement::shard(0), Placement::replicate()}, {{5, 5}, {}});
  changed[4].spec = ShardSpec::make({10, 8}, {2, 1}, {Placement::shard(1), Placement::replicate()});
  for (size_t i = 0; i < changed.size(); ++i) {
    EXPECT_FALSE(changed[i] == base) << "variant " << i;
    EXPECT_NE(hash_of(changed[i]), hash_of(base)) << "variant " << i;
  }
}

TEST(HaloPlanCache, OnePlanPerKeyWhicheverEntryPointAsks) {
  const HaloPlanKey key = sample_key();
  const auto first = cached_halo_plan(key);
  const auto second = cached_halo_plan(key.spec, {1, 0}, {1, 0}, key.boundary, key.rank);
  EXPECT_EQ(first.get(), second.get());
  EXPECT_EQ(first->needed_box(), key.needed[1]);
}

}  // namespace
}  // namespace tessera
