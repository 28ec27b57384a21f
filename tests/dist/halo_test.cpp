// Halo plan and exchange: for random layouts (uneven and empty shards, halos up to 3x a shard
// wide, zero and periodic boundaries, 1-d..3-d tensors on every mesh factorization), every
// haloed local tensor equals the matching box of the global array (also when exchanged in place
// around an owned interior, and around an interior left to the kernel); the adjoint is the exact
// transpose of the exchange; wide halos are served by several ranks.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/halo/halo_exchange.hpp"
#include "core/trace.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;

/// The reference haloed tensor: global values at wrapped indices, zero past zero-boundary edges.
Tensor expected_haloed(const Tensor& global, const Box& needed,
                       const std::vector<BoundaryMode>& boundary) {
  Tensor result = Tensor::zeros(needed.shape(), DType::f64);
  const int ndim = global.ndim();
  std::vector<int64_t> index(ndim, 0);
  for (int64_t flat = 0; flat < result.numel(); ++flat) {
    int64_t rest = flat;
    for (int d = ndim - 1; d >= 0; --d) {
      index[d] = rest % needed.extent(d);
      rest /= needed.extent(d);
    }
    std::vector<int64_t> source(ndim);
    bool inside = true;
    for (int d = 0; d < ndim; ++d) {
      const int64_t extent = global.shape(d);
      int64_t i = needed.lo[d] + index[d];
      if (boundary[d] == BoundaryMode::periodic)
        i = ((i % extent) + extent) % extent;
      else
        inside = inside && i >= 0 && i < extent;
      source[d] = i;
    }
    if (inside) result.data<double>()[flat] = global.item_as_double(source);
  }
  return result;
}

struct HaloCase {
  ShardSpec spec;
  std::vector<int64_t> lo, hi;
  std::vector<BoundaryMode> boundary;
};

/// A random layout without Partial dims and random halo widths up to 3x the widest shard.
HaloCase random_halo_case(const std::vector<int>& mesh_shape, CaseRng& rng) {
  const int ndim = static_cast<int>(rng.uniform(1, 3));
  Shape global(ndim);
  for (int64_t& extent : global) extent = rng.uniform(1, 9);
  const auto placements =
      testing::random_placements(ndim, static_cast<int>(mesh_shape.size()), rng, std::nullopt);
  const auto extents = testing::random_layout_extents(global, mesh_shape, placements, rng);
  HaloCase halo_case{ShardSpec::make(global, mesh_shape, placements, extents), {}, {}, {}};
  for (int d = 0; d < ndim; ++d) {
    int64_t widest = 1;
    const int m = halo_case.spec.mesh_dim_sharding(d);
    if (m >= 0)
      for (int64_t extent : halo_case.spec.extents[m]) widest = std::max(widest, extent);
    halo_case.lo.push_back(rng.uniform(0, 3 * widest));
    halo_case.hi.push_back(rng.uniform(0, 3 * widest));
    halo_case.boundary.push_back(rng.chance(0.5) ? BoundaryMode::periodic : BoundaryMode::zero);
  }
  return halo_case;
}

TEST(HaloExchange, HaloedTensorEqualsTheGlobalBoxForRandomLayouts) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < testing::cases_per_mesh(comm->size(), 60); ++index) {
        CaseRng rng(testing::case_seed(31, comm->size(), static_cast<int>(mesh_index), index));
        const HaloCase c = random_halo_case(mesh.shape(), rng);
        const Tensor global =
            testing::integer_tensor(c.spec.global_shape, DType::f64, rng, -50, 50);
        const Tensor owned = global.view_box(c.spec.local_box(mesh.coord())).clone();
        const auto plan = cached_halo_plan(c.spec, c.lo, c.hi, c.boundary, mesh.rank());
        HaloExchange exchange = halo_begin(*plan, owned, mesh.comm());
        // The interior is valid before the halo lands (so compute can overlap the exchange).
        EXPECT_TRUE(
            bitwise_equal(exchange.haloed().view_box(plan->interior_box()).contiguous(), owned))
            << c.spec.str();
        const Tensor haloed = halo_end(exchange);
        const Tensor expected = expected_haloed(global, plan->needed_box(), c.boundary);
        EXPECT_TRUE(bitwise_equal(haloed, expected))
            << c.spec.str() << " lo " << fmt::format("{}", c.lo) << " hi "
            << fmt::format("{}", c.hi) << " rank " << mesh.rank();
      }
    }
  });
}

TEST(HaloExchange, InPlaceFillsTheHaloAroundTheOwnedInterior) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < testing::cases_per_mesh(comm->size(), 60); ++index) {
        CaseRng rng(testing::case_seed(34, comm->size(), static_cast<int>(mesh_index), index));
        const HaloCase c = random_halo_case(mesh.shape(), rng);
        const Tensor global =
            testing::integer_tensor(c.spec.global_shape, DType::f64, rng, -50, 50);
        const auto plan = cached_halo_plan(c.spec, c.lo, c.hi, c.boundary, mesh.rank());
        // The haloed tensor holds the owned piece in its interior and stale values around it.
        Tensor haloed = Tensor::empty(plan->haloed_shape(), DType::f64);
        haloed.fill(-999);
        haloed.view_box(plan->interior_box())
            .copy_from(global.view_box(c.spec.local_box(mesh.coord())));
        HaloExchange exchange = halo_begin_in_place(*plan, haloed, mesh.comm());
        const Tensor result = halo_end(exchange);
        EXPECT_EQ(result.raw_data(), haloed.raw_data()) << "not in place";
        EXPECT_TRUE(bitwise_equal(haloed, expected_haloed(global, plan->needed_box(), c.boundary)))
            << c.spec.str() << " lo " << fmt::format("{}", c.lo) << " hi "
            << fmt::format("{}", c.hi) << " rank " << mesh.rank();
      }
    }
  });
}

/// The bytes the halo_begin events of `events` (trace::capture's) copied, summed.
int64_t begin_copied_bytes(const std::vector<std::string>& events) {
  int64_t bytes = 0;
  for (const std::string& text : events) {
    const nlohmann::json event = nlohmann::json::parse(text);
    if (event.value("name", "") == "halo_begin" && event.contains("args"))
      bytes += event["args"].value("copied_bytes", int64_t{0});
  }
  return bytes;
}

TEST(HaloExchange, AroundFillsTheHaloAndLeavesTheOwnedInteriorToTheKernel) {
  testing::run_every_world([](std::shared_ptr<Comm> world) {
    const auto meshes = testing::mesh_factorizations(world->size());
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      for (int index = 0; index < testing::cases_per_mesh(world->size(), 40); ++index) {
        CaseRng rng(testing::case_seed(35, world->size(), static_cast<int>(mesh_index), index));
        const HaloCase c = random_halo_case(meshes[mesh_index], rng);
        const Tensor global =
            testing::integer_tensor(c.spec.global_shape, DType::f64, rng, -50, 50);
        Tensor haloed[2];
        bool unfilled = false;
        int64_t copied[2] = {0, 0};
        for (int around = 0; around < 2; ++around)
          copied[around] = begin_copied_bytes(
              trace::capture(world->rank(), world, [&](std::shared_ptr<Comm> comm) {
                DeviceMesh mesh(comm, meshes[mesh_index]);
                const Tensor owned = global.view_box(c.spec.local_box(mesh.coord())).clone();
                const auto plan = cached_halo_plan(c.spec, c.lo, c.hi, c.boundary, mesh.rank());
                HaloExchange exchange = around ? halo_begin_around(*plan, owned, mesh.comm())
                                               : halo_begin(*plan, owned, mesh.comm());
                haloed[around] = halo_end(exchange);
                if (!around) {
                  EXPECT_FALSE(exchange.interior_unfilled()) << "halo_begin fills the interior";
                  return;
                }
                unfilled = exchange.interior_unfilled();
                if (unfilled)  // the kernel's part: the owned piece into the interior
                  haloed[1].view_box(plan->interior_box()).copy_from(owned);
              }));
        // Halo cells as halo_begin's (the interior, filled above, as well), and the exchange
        // copied exactly the owned piece less.
        EXPECT_TRUE(bitwise_equal(haloed[1], haloed[0]))
            << c.spec.str() << " lo " << fmt::format("{}", c.lo) << " hi "
            << fmt::format("{}", c.hi) << " rank " << world->rank();
        const int64_t owned_bytes =
            c.spec.local_box_of_rank(world->rank()).volume() * int64_t{sizeof(double)};
        EXPECT_EQ(copied[0] - copied[1], unfilled ? owned_bytes : 0) << c.spec.str();
      }
    }
  });
}

TEST(HaloExchange, AdjointIsTheTransposeOfTheExchange) {
  // <halo(x), g> summed over ranks equals <x, halo_adjoint(g)> summed over ranks, exactly
  // (small integers in f64).
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const auto meshes = testing::mesh_factorizations(comm->size());
    for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
      DeviceMesh mesh(comm, meshes[mesh_index]);
      for (int index = 0; index < testing::cases_per_mesh(comm->size(), 30); ++index) {
        CaseRng rng(testing::case_seed(32, comm->size(), static_cast<int>(mesh_index), index));
        const HaloCase c = random_halo_case(mesh.shape(), rng);
        // Replicated mesh dims would count a replica's contribution several times: use the
        // layout's sharded dims only by giving every rank its own values.
        CaseRng local_rng(testing::case_seed(33, comm->size(), mesh.rank(), index));
        const Tensor owned =
            testing::integer_tensor(c.spec.local_shape(mesh.coord()), DType::f64, local_rng, -9, 9);
        const auto plan = cached_halo_plan(c.spec, c.lo, c.hi, c.boundary, mesh.rank());
        HaloExchange exchange = halo_begin(*plan, owned, mesh.comm());
        const Tensor haloed = halo_end(exchange);
        const Tensor grad =
            testing::integer_tensor(plan->haloed_shape(), DType::f64, local_rng, -9, 9);
        const Tensor owned_grad = halo_adjoint(*plan, grad, mesh.comm());
        double sums[2] = {0, 0};
        for (int64_t i = 0; i < haloed.numel(); ++i)
          sums[0] += haloed.data<double>()[i] * grad.data<double>()[i];
        for (int64_t i = 0; i < owned.numel(); ++i)
          sums[1] += owned.data<double>()[i] * owned_grad.data<double>()[i];
        comm->all_reduce(sums, sums, 2, DType::f64, ReduceOp::sum);
        EXPECT_EQ(sums[0], sums[1]) << c.spec.str();
      }
    }
  });
}

TEST(HaloPlan, AHaloWiderThanTheNeighbourIsServedBySeveralRanks) {
  // Extents 1, 0, 1, 3 on a 1-d mesh of 4: rank 3 owns [2, 5) and needs [-1, 2) on its left:
  // index 1 from rank 2, index 0 from rank 0 (skipping the empty rank 1), index -1 is zero.
  const ShardSpec spec = ShardSpec::make({5}, {4}, {Placement::shard(0)}, {{1, 0, 1, 3}});
  const HaloPlan plan = HaloPlan::build(spec, grown_boxes(spec, {3}, {0}), {BoundaryMode::zero}, 3);
  std::vector<int> peers;
  for (const HaloTransfer& transfer : plan.recvs()) peers.push_back(transfer.peer);
  EXPECT_EQ(peers, (std::vector<int>{0, 2}));
  ASSERT_EQ(plan.zero_boxes().size(), 1u);
  EXPECT_EQ(plan.zero_boxes()[0], (Box{{0}, {1}}));
  // The empty rank 1 sends nothing and needs only zero cells around its empty box.
  const HaloPlan empty =
      HaloPlan::build(spec, grown_boxes(spec, {1}, {1}), {BoundaryMode::zero}, 1);
  EXPECT_TRUE(empty.sends().empty());
}

TEST(HaloPlan, PeriodicWrapOntoASingleRankIsALocalCopy) {
  const ShardSpec spec = ShardSpec::make({4, 3}, {1}, {Placement::shard(0)});
  const HaloPlan plan = HaloPlan::build(spec, grown_boxes(spec, {2, 1}, {2, 1}),
                                        {BoundaryMode::periodic, BoundaryMode::periodic}, 0);
  EXPECT_TRUE(plan.recvs().empty());
  EXPECT_TRUE(plan.sends().empty());
  EXPECT_EQ(plan.self_copies().size(), 9u);  // 3 images along each of the 2 dims
  EXPECT_EQ(plan.haloed_shape(), (Shape{8, 5}));
}

}  // namespace
}  // namespace tessera
