// The cost model of `tessera estimate` (core/cost): toy traces whose replay equals a cost
// computed by hand, the collective formulas, machine files and malformed input.
#include "core/cost/cost_model.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/errors.hpp"

namespace tessera::cost {
namespace {

using nlohmann::json;

/// A machine of `per_node` ranks per node: intra 1 us + n / 1 GB/s, inter 10 us + n / 100 MB/s,
/// ring collectives; conv at 10 GFLOP/s, everything else 1 GFLOP/s; copies at 10 GB/s.
json toy_machine(int per_node) {
  return {{"name", "toy"},
          {"ranks_per_node", per_node},
          {"backend", "nccl"},
          {"links",
           {{"nccl",
             {{"algorithm", "ring"},
              {"intra", {{"alpha", 1e-6}, {"beta", 1e9}}},
              {"inter", {{"alpha", 1e-5}, {"beta", 1e8}}}}}}},
          {"compute",
           {{"op_overhead", 0.0},
            {"memory_bandwidth", 1e10},
            {"families",
             {{"default", {{"flops", 1e9}, {"bytes", 1e10}}},
              {"conv", {{"flops", 1e10}, {"bytes", 1e10}}}}}}}};
}

/// A complete event of rank `pid` (times in microseconds).
json event(int pid, const std::string& cat, const std::string& name, double ts, double dur,
           json args = json::object()) {
  return {{"name", name}, {"cat", cat}, {"ph", "X"}, {"ts", ts},
          {"dur", dur},   {"pid", pid}, {"tid", 0},  {"args", std::move(args)}};
}

json rank_name(int pid) {
  return {{"name", "process_name"},
          {"ph", "M"},
          {"pid", pid},
          {"tid", 0},
          {"args", {{"name", "rank " + std::to_string(pid)}}}};
}

TEST(CostModel, RingAllReduceStartsWhenTheLastMemberArrives) {
  // 4 ranks on 2 nodes; rank r computes (r + 1) ms of conv, then all-reduces 1 MB.
  json events = json::array();
  for (int r = 0; r < 4; ++r) {
    events.push_back(rank_name(r));
    events.push_back(event(r, "step", "train step", 0, 100));
    events.push_back(event(r, "op", "conv", 1, 10, {{"flops", (r + 1) * 1e7}, {"bytes", 0}}));
    events.push_back(event(r, "comm", "all_reduce", 20, 10,
                           {{"bytes", 1000000}, {"group", "w"}, {"ranks", 4}, {"rank", r}}));
  }
  const Machine machine = machine_from_json(toy_machine(2));
  const Prediction prediction = replay({{"traceEvents", events}}, machine);
  // The group spans two nodes: ring over the inter link, 2(P-1) alpha + 2 (P-1)/P n / beta.
  const double ring = 2 * 3 * 1e-5 + 2 * 0.75 * 1e6 / 1e8;
  EXPECT_EQ(prediction.ranks, 4);
  EXPECT_EQ(prediction.steps, 1);
  EXPECT_NEAR(prediction.step_seconds, 4e-3 + ring, 1e-12);
  EXPECT_NEAR(prediction.per_rank[0].compute, 1e-3, 1e-12);
  EXPECT_NEAR(prediction.per_rank[0].comm, ring, 1e-12);
  EXPECT_NEAR(prediction.per_rank[0].exposed_comm, 3e-3 + ring, 1e-12);
  EXPECT_NEAR(prediction.per_rank[3].exposed_comm, ring, 1e-12);
  // On one node the same trace uses the intra link.
  const Prediction one_node = replay({{"traceEvents", events}}, machine_from_json(toy_machine(8)));
  EXPECT_NEAR(one_node.step_seconds, 4e-3 + 2 * 3 * 1e-6 + 2 * 0.75 * 1e6 / 1e9, 1e-12);
}

/// Two ranks exchanging 1 MB halos around an interior op of `interior_flops` (1 GFLOP/s).
json halo_trace(double interior_flops) {
  json events = json::array();
  for (int r = 0; r < 2; ++r) {
    const int peer = 1 - r;
    const std::string peers =
        ">" + std::to_string(peer) + ":1000000 <" + std::to_string(peer) + ":1000000";
    events.push_back(rank_name(r));
    events.push_back(event(r, "step", "gray-scott step", 0, 100));
    events.push_back(event(r, "halo", "halo_begin", 1, 10));
    events.push_back(event(r, "comm", "send_recv start", 2, 5,
                           {{"bytes_sent", 1000000},
                            {"bytes_received", 1000000},
                            {"peers", peers},
                            {"group", "w"},
                            {"ranks", 2},
                            {"rank", r},
                            {"id", 0}}));
    events.push_back(
        event(r, "op", "gray_scott interior", 20, 10, {{"flops", interior_flops}, {"bytes", 0}}));
    events.push_back(event(r, "halo", "halo_end", 40, 10));
    events.push_back(event(r, "comm", "send_recv wait", 41, 5, {{"id", 0}}));
    events.push_back(event(r, "op", "gray_scott boundary", 60, 10, {{"flops", 5e5}, {"bytes", 0}}));
  }
  return {{"traceEvents", events}};
}

TEST(CostModel, HaloExchangeOverlapsTheInteriorCompute) {
  const Machine machine = machine_from_json(toy_machine(2));
  // Packing reads and writes each byte once: 2 MB at the machine's 10 GB/s of copies.
  const double pack = 2e6 / 1e10, message = 1e-6 + 1e6 / 1e9, unpack = 2e6 / 1e10;
  const double boundary = 5e5 / 1e9;
  // Interior (2 ms) longer than the message (1.001 ms): the message is hidden.
  const Prediction hidden = replay(halo_trace(2e6), machine);
  EXPECT_NEAR(hidden.step_seconds, pack + 2e-3 + unpack + boundary, 1e-12);
  EXPECT_NEAR(hidden.exposed_comm_seconds, 0, 1e-12);
  EXPECT_NEAR(hidden.comm_seconds, message, 1e-12);
  // Interior (0.5 ms) shorter: the rest of the message is exposed.
  const Prediction exposed = replay(halo_trace(5e5), machine);
  EXPECT_NEAR(exposed.step_seconds, pack + message + unpack + boundary, 1e-12);
  EXPECT_NEAR(exposed.exposed_comm_seconds, message - 5e-4, 1e-12);
}

TEST(CostModel, AnInteriorFilledInsideItsOpIsCountedAsACopy) {
  // One rank: an op whose kernel filled its haloed input's interior (1 MB) before computing
  // 1 ms: the copy (2 MB of traffic at 10 GB/s) adds to the op's time.
  json events = json::array({rank_name(0)});
  events.push_back(event(0, "step", "step", 0, 100));
  events.push_back(event(0, "op", "na", 1, 50, {{"flops", 1e6}, {"bytes", 0}}));
  events.push_back(
      event(0, "halo", "halo_fill", 2, 5, {{"copied_bytes", 1000000}, {"copy_runs", 1}}));
  const Machine machine = machine_from_json(toy_machine(1));
  const Prediction prediction = replay({{"traceEvents", events}}, machine);
  EXPECT_NEAR(prediction.step_seconds, 1e-3 + cost::copy_seconds(machine, 1e6, 1, 1), 1e-12);
  EXPECT_GT(cost::copy_seconds(machine, 1e6, 1, 1), 0);
}

TEST(CostModel, PointToPointChainAddsComputeAndMessages) {
  // rank 0 computes 1 ms and sends 1000 bytes to rank 1, which then computes 2 ms and sends to
  // rank 2; one rank per node: every message takes the inter link.
  const auto start = [](int pid, double ts, const std::string& peers, int rank, int id) {
    return event(pid, "comm", "send_recv start", ts, 1,
                 {{"peers", peers}, {"group", "w"}, {"ranks", 3}, {"rank", rank}, {"id", id}});
  };
  const auto wait = [](int pid, double ts, int id) {
    return event(pid, "comm", "send_recv wait", ts, 1, {{"id", id}});
  };
  json events = json::array({rank_name(0), rank_name(1), rank_name(2)});
  events.push_back(event(0, "op", "conv", 0, 5, {{"flops", 1e7}, {"bytes", 0}}));
  events.push_back(start(0, 10, ">1:1000", 0, 0));
  events.push_back(wait(0, 12, 0));
  events.push_back(start(1, 0, "<0:1000", 1, 0));
  events.push_back(wait(1, 2, 0));
  events.push_back(event(1, "op", "conv", 10, 5, {{"flops", 2e7}, {"bytes", 0}}));
  events.push_back(start(1, 20, ">2:1000", 1, 1));
  events.push_back(wait(1, 22, 1));
  events.push_back(start(2, 0, "<1:1000", 2, 0));
  events.push_back(wait(2, 2, 0));
  const Prediction prediction =
      replay({{"traceEvents", events}}, machine_from_json(toy_machine(1)));
  const double message = 1e-5 + 1000 / 1e8;
  EXPECT_EQ(prediction.steps, 0);
  EXPECT_NEAR(prediction.step_seconds, 1e-3 + message + 2e-3 + message, 1e-12);
  EXPECT_NEAR(prediction.per_rank[2].exposed_comm, 1e-3 + message + 2e-3 + message, 1e-12);
}

TEST(CostModel, SubCommunicatorsMatchByGroupAndPlaceMembersByWorldRank) {
  // Ranks 0 and 2 form group "w.0c0" (on nodes 0 and 1 with 2 ranks per node): inter link.
  json events = json::array();
  for (int r = 0; r < 4; ++r) {
    events.push_back(rank_name(r));
    const std::string group = r % 2 == 0 ? "w.0c0" : "w.0c1";
    events.push_back(event(r, "comm", "split", 0, 1,
                           {{"bytes", 0},
                            {"group", "w"},
                            {"ranks", 4},
                            {"rank", r},
                            {"child", group},
                            {"child_rank", r / 2},
                            {"child_ranks", 2}}));
    events.push_back(event(r, "comm", "all_gather_v", 10, 1,
                           {{"bytes", 2000}, {"group", group}, {"ranks", 2}, {"rank", r / 2}}));
  }
  const Machine machine = machine_from_json(toy_machine(2));
  const Prediction prediction = replay({{"traceEvents", events}}, machine);
  const double split = collective_seconds(Algorithm::ring, machine.links.at("nccl").inter,
                                          Collective::split, std::vector<double>(4, 0.0));
  // Members 0 and 2 (or 1 and 3) sit on different nodes.
  EXPECT_NEAR(prediction.step_seconds, split + 1e-5 + 0.5 * 2000 / 1e8, 1e-12);
}

TEST(CostModel, CollectiveFormulas) {
  const Link link{1e-6, 1e9};
  const std::vector<double> four(4, 1e6);
  EXPECT_DOUBLE_EQ(collective_seconds(Algorithm::ring, link, Collective::all_reduce, four),
                   6e-6 + 1.5e6 / 1e9);
  EXPECT_DOUBLE_EQ(collective_seconds(Algorithm::ring, link, Collective::all_gather_v, four),
                   3e-6 + 0.75e6 / 1e9);
  // MPI: recursive doubling (2 steps of the whole buffer) vs Rabenseifner, the cheaper.
  EXPECT_DOUBLE_EQ(collective_seconds(Algorithm::mpi, link, Collective::all_reduce, four),
                   std::min(2 * (1e-6 + 1e6 / 1e9), 4e-6 + 1.5e6 / 1e9));
  // Shared memory: each rank reads its 3 peers' buffers.
  EXPECT_DOUBLE_EQ(collective_seconds(Algorithm::direct, link, Collective::all_reduce, four),
                   1e-6 + 3e6 / 1e9);
  // Gather to root 1: the other members' blocks cross the root's link.
  EXPECT_DOUBLE_EQ(collective_seconds(Algorithm::mpi, link, Collective::gather_v,
                                      std::vector<double>{1, 2, 3, 4}, 1),
                   2e-6 + 8 / 1e9);
  for (Algorithm algorithm : {Algorithm::direct, Algorithm::mpi, Algorithm::ring})
    EXPECT_EQ(collective_seconds(algorithm, link, Collective::all_reduce, std::vector{1e6}), 0);
}

/// NCCL links of the toy machine: 1 us + n / 1 GB/s within a node, 10 us + n / 100 MB/s across,
/// and (with_nvls) NVLS within a node at 25 us + n / 2 GB/s.
LinkSet nccl_links(bool with_nvls) {
  LinkSet links{.algorithm = Algorithm::nccl, .intra = {1e-6, 1e9}, .inter = {1e-5, 1e8}};
  if (with_nvls) links.nvls = Link{25e-6, 2e9};
  return links;
}

TEST(CostModel, NcclRingPaysTheNetworkLatencyOnlyOnHopsLeavingANode) {
  const LinkSet links = nccl_links(false);
  const std::vector<double> sixteen(16, 1e6);
  // 16 ranks on 2 nodes: of an all-reduce's 30 hops 2 leave a node; the bandwidth is the IB's.
  EXPECT_DOUBLE_EQ(
      nccl_algorithm_seconds(links, NcclAlgorithm::ring, Collective::all_reduce, sixteen, 2),
      28 * 1e-6 + 2 * 1e-5 + 2 * (15.0 / 16) * 1e6 / 1e8);
  // An all-gather's 15 hops: 1 leaves a node.
  EXPECT_DOUBLE_EQ(
      nccl_algorithm_seconds(links, NcclAlgorithm::ring, Collective::all_gather_v, sixteen, 2),
      14 * 1e-6 + 1e-5 + (15.0 / 16) * 1e6 / 1e8);
  // Within one node every hop is NVLink.
  EXPECT_DOUBLE_EQ(
      nccl_algorithm_seconds(links, NcclAlgorithm::ring, Collective::broadcast, sixteen, 1),
      15 * 1e-6 + 1e6 / 1e9);
  // A tree: a chain of 8 in each node, one tree level between the 2 nodes, up and down.
  EXPECT_DOUBLE_EQ(
      nccl_algorithm_seconds(links, NcclAlgorithm::tree, Collective::all_reduce, sixteen, 2),
      2 * (7 * 1e-6 + 1 * 1e-5) + 2 * 1e6 / 1e8);
}

TEST(CostModel, NcclOffersTreeAndNvlsOnlyWhereNcclHasThem) {
  const std::vector<double> eight(8, 1e3);
  const auto seconds = [&](const LinkSet& links, NcclAlgorithm algorithm, Collective collective,
                           int nodes) {
    return nccl_algorithm_seconds(links, algorithm, collective, eight, nodes);
  };
  const LinkSet plain = nccl_links(false), nvls = nccl_links(true);
  EXPECT_TRUE(std::isinf(seconds(plain, NcclAlgorithm::tree, Collective::all_reduce, 1)));
  EXPECT_TRUE(std::isinf(seconds(plain, NcclAlgorithm::tree, Collective::all_gather_v, 8)));
  EXPECT_TRUE(std::isinf(seconds(plain, NcclAlgorithm::nvls, Collective::all_reduce, 1)));
  EXPECT_TRUE(std::isinf(seconds(nvls, NcclAlgorithm::nvls, Collective::all_reduce, 2)));
  EXPECT_TRUE(std::isinf(seconds(nvls, NcclAlgorithm::nvls, Collective::reduce_scatter_v, 1)));
  EXPECT_DOUBLE_EQ(seconds(nvls, NcclAlgorithm::nvls, Collective::all_reduce, 1),
                   25e-6 + 1e3 / 2e9);
  // A single member costs nothing whatever the algorithm.
  EXPECT_EQ(nccl_collective(nvls, Collective::all_reduce, std::vector{1e6}, 1).seconds, 0);
}

TEST(CostModel, NcclTreeBeatsTheRingBelowTheCrossoverAcrossNodes) {
  // 16 nodes of one rank: ring 30 (10 us + ..) against tree 2 log2(16) (10 us) + 2n / beta.
  // tree - ring = -220 us + (2 - 30/16) n / 1e8 = 0 at n = 176,000 bytes.
  const LinkSet links = nccl_links(false);
  const auto choose = [&](double n) {
    return nccl_collective(links, Collective::all_reduce, std::vector<double>(16, n), 16);
  };
  const NcclChoice small = choose(170000), large = choose(180000);
  EXPECT_EQ(small.algorithm, NcclAlgorithm::tree);
  EXPECT_DOUBLE_EQ(small.seconds, 2 * 4 * 1e-5 + 2 * 170000 / 1e8);
  EXPECT_EQ(large.algorithm, NcclAlgorithm::ring);
  EXPECT_DOUBLE_EQ(large.seconds, 30 * 1e-5 + 2 * (15.0 / 16) * 180000 / 1e8);
  // NCCL has only rings for an all-gather, but NcclComm runs a small one over 16 or more ranks
  // as an all-reduce of the gathered buffer (nccl_plan::gather_by_all_reduce), priced as that
  // all-reduce: a tree here. A large one, or one over fewer ranks, stays a ring.
  const NcclChoice tiny =
      nccl_collective(links, Collective::all_gather_v, std::vector<double>(16, 8.0), 16);
  EXPECT_EQ(tiny.algorithm, NcclAlgorithm::tree);
  EXPECT_DOUBLE_EQ(tiny.seconds, 2 * 4 * 1e-5 + 2 * 8 / 1e8);
  EXPECT_EQ(
      nccl_collective(links, Collective::all_gather_v, std::vector<double>(16, 1e6), 16).algorithm,
      NcclAlgorithm::ring);
  EXPECT_EQ(
      nccl_collective(links, Collective::all_gather_v, std::vector<double>(8, 8.0), 8).algorithm,
      NcclAlgorithm::ring);
}

TEST(CostModel, NcclNvlsBeatsTheRingAboveTheCrossoverWithinANode) {
  // 8 ranks on one node: ring 14 us + 1.75 n / 1e9, NVLS 25 us + 0.5 n / 1e9: equal at 8,800 B.
  const LinkSet links = nccl_links(true);
  const auto choose = [&](double n) {
    return nccl_collective(links, Collective::all_reduce, std::vector<double>(8, n), 1);
  };
  const NcclChoice small = choose(8000), large = choose(9600);
  EXPECT_EQ(small.algorithm, NcclAlgorithm::ring);
  EXPECT_DOUBLE_EQ(small.seconds, 14e-6 + 1.75 * 8000 / 1e9);
  EXPECT_EQ(large.algorithm, NcclAlgorithm::nvls);
  EXPECT_DOUBLE_EQ(large.seconds, 25e-6 + 9600 / 2e9);
}

TEST(CostModel, ReplayOnAnNcclMachinePricesEachCallWithTheCheapestAlgorithm) {
  // 4 ranks, one per node, all-reduce 8 bytes: tree 2 log2(4) x 10 us + 16 B / 1e8 beats the
  // ring's 6 x 10 us; 4 ranks on one node: the ring (no NVLS in the file).
  for (int per_node : {1, 4}) {
    json events = json::array();
    for (int r = 0; r < 4; ++r) {
      events.push_back(rank_name(r));
      events.push_back(event(r, "comm", "all_reduce", 0, 1,
                             {{"bytes", 8}, {"group", "w"}, {"ranks", 4}, {"rank", r}}));
    }
    json file = toy_machine(per_node);
    file["links"]["nccl"]["algorithm"] = "nccl";
    const Prediction prediction = replay({{"traceEvents", events}}, machine_from_json(file));
    if (per_node == 1) {
      EXPECT_NEAR(prediction.step_seconds, 4e-5 + 16 / 1e8, 1e-15);
      EXPECT_EQ(prediction.algorithms.at("all_reduce tree"), 1);
    } else {
      EXPECT_NEAR(prediction.step_seconds, 6e-6 + 2 * 0.75 * 8 / 1e9, 1e-15);
      EXPECT_EQ(prediction.algorithms.at("all_reduce ring"), 1);
    }
    EXPECT_EQ(prediction_to_json(prediction)["algorithms"].size(), 1u);
  }
}

TEST(CostModel, RooflineTakesTheSlowerOfFlopsAndBytes) {
  const Machine machine = machine_from_json(toy_machine(1));
  EXPECT_DOUBLE_EQ(op_seconds(machine, "conv", 1e10, 1e9), 1.0);
  EXPECT_DOUBLE_EQ(op_seconds(machine, "conv", 1e9, 1e11), 10.0);
  EXPECT_DOUBLE_EQ(op_seconds(machine, "conv_backward", 1e10, 0), 1.0);  // the forward's rate
  EXPECT_DOUBLE_EQ(op_seconds(machine, "norm", 1e9, 0), 1.0);            // the default's
  EXPECT_DOUBLE_EQ(op_seconds(machine, "conv", 1e10, 0, 0.5), 2.0);      // half the node
}

TEST(CostModel, AnOpsOwnThroughputWinsOverItsFamilys) {
  nlohmann::json document = toy_machine(1);
  document["compute"]["families"]["gelu_backward"] = {{"flops", 1e12}, {"bytes", 1e8}};
  const Machine machine = machine_from_json(document);
  EXPECT_EQ(op_key("gelu backward"), "gelu_backward");
  EXPECT_EQ(op_key("gray_scott interior"), "gray_scott_interior");
  EXPECT_DOUBLE_EQ(event_seconds(machine, "gelu backward", 0, 1e8), 1.0);   // its own entry
  EXPECT_DOUBLE_EQ(event_seconds(machine, "gelu", 0, 1e10), 1.0);           // the default's
  EXPECT_DOUBLE_EQ(event_seconds(machine, "conv backward", 1e10, 0), 1.0);  // conv's
}

TEST(CostModel, OpFamilies) {
  EXPECT_EQ(op_family("conv"), "conv");
  EXPECT_EQ(op_family("conv_transpose backward"), "conv_backward");
  EXPECT_EQ(op_family("linear"), "matmul");
  EXPECT_EQ(op_family("na backward"), "na_backward");
  EXPECT_EQ(op_family("ring_attention"), "attention");
  EXPECT_EQ(op_family("group_norm"), "norm");
  EXPECT_EQ(op_family("max_pool"), "pool");
  EXPECT_EQ(op_family("gray_scott interior"), "stencil");
  EXPECT_EQ(op_family("gelu"), "pointwise");
}

TEST(CostModel, CalibrationSamplesLeaveOutTheFirstCallOfEachRecurringSignature) {
  // Rank 0: conv on one shape three times (the first slow: plans, first touch), conv on another
  // shape once, gelu twice; rank 1: the first shape once more (its own first call, left out).
  json events = json::array({rank_name(0), rank_name(1)});
  events.push_back(event(0, "op", "conv", 0, 900, {{"flops", 1e6}, {"bytes", 10}}));
  events.push_back(event(0, "op", "conv", 1000, 100, {{"flops", 1e6}, {"bytes", 10}}));
  events.push_back(event(0, "op", "conv", 2000, 100, {{"flops", 1e6}, {"bytes", 10}}));
  events.push_back(event(0, "op", "conv", 3000, 50, {{"flops", 2e6}, {"bytes", 20}}));
  events.push_back(event(0, "op", "gelu", 4000, 70, {{"flops", 5}, {"bytes", 40}}));
  events.push_back(event(0, "op", "gelu", 5000, 30, {{"flops", 5}, {"bytes", 40}}));
  events.push_back(event(1, "op", "conv", 0, 800, {{"flops", 1e6}, {"bytes", 10}}));
  events.push_back(event(1, "op", "conv", 1000, 120, {{"flops", 1e6}, {"bytes", 10}}));
  const auto samples = family_samples({{"traceEvents", events}});
  ASSERT_EQ(samples.count("conv"), 1u);
  const FamilySample& conv = samples.at("conv");
  EXPECT_EQ(conv.count, 4);  // 2 + the single call of the second shape on rank 0, 1 on rank 1
  EXPECT_DOUBLE_EQ(conv.flops, 5e6);
  EXPECT_NEAR(conv.seconds, (100 + 100 + 50 + 120) * 1e-6, 1e-15);
  const FamilySample& gelu = samples.at("pointwise");
  EXPECT_EQ(gelu.count, 1);
  EXPECT_NEAR(gelu.seconds, 30e-6, 1e-15);
  EXPECT_DOUBLE_EQ(gelu.bytes, 40);
}

TEST(CostModel, BandwidthCurveInterpolatesInLogsAndClampsAtItsEnds) {
  const BandwidthCurve curve{{1e6, 4e10}, {1e8, 4e9}};
  EXPECT_DOUBLE_EQ(bandwidth_at({}, 5e6, 7.0), 7.0);                   // no curve: the fallback
  EXPECT_DOUBLE_EQ(bandwidth_at(curve, 1e3, 1), 4e10);                 // below the first point
  EXPECT_DOUBLE_EQ(bandwidth_at(curve, 1e9, 1), 4e9);                  // beyond the last
  EXPECT_NEAR(bandwidth_at(curve, 1e7, 1), std::sqrt(4e10 * 4e9), 1);  // halfway in logs
  EXPECT_DOUBLE_EQ(bandwidth_at(curve, 1e6, 1), 4e10);
  // A message's working set is its send and receive buffers.
  const Link link{1e-6, 1, curve};
  EXPECT_DOUBLE_EQ(link.seconds(4e5), 1e-6 + 4e5 / 4e10);
  EXPECT_DOUBLE_EQ(link.seconds(5e7), 1e-6 + 5e7 / 4e9);
}

TEST(CostModel, ACollectiveTakesTheBandwidthOfItsWorkingSet) {
  // All-gathers over 2 members of a link 40 GB/s up to 3 MB touched, 4 GB/s from 300 MB.
  const Link link{1e-6, 1, {{3e6, 4e10}, {3e8, 4e9}}};
  EXPECT_DOUBLE_EQ(collective_working_set(Collective::all_gather_v, std::vector{1e6, 1e6}), 3e6);
  EXPECT_DOUBLE_EQ(collective_working_set(Collective::all_reduce, std::vector{1e6, 1e6, 1e6}), 6e6);
  EXPECT_DOUBLE_EQ(collective_working_set(Collective::all_to_all_v, std::vector{1e6, 3e6}), 8e6);
  EXPECT_DOUBLE_EQ(collective_working_set(Collective::broadcast, std::vector{2e6, 2e6}), 4e6);
  EXPECT_DOUBLE_EQ(collective_working_set(Collective::barrier, std::vector{1.0, 1.0}), 0);
  // The local backend's ranks each copy the whole gathered buffer, their own block too.
  EXPECT_DOUBLE_EQ(
      collective_seconds(Algorithm::direct, link, Collective::all_gather_v, std::vector{1e6, 1e6}),
      1e-6 + 1e6 / 4e10);
  EXPECT_DOUBLE_EQ(
      collective_seconds(Algorithm::direct, link, Collective::all_gather_v, std::vector{1e8, 1e8}),
      1e-6 + 1e8 / 4e9);
  // Contention (ranks beyond the node's cores) stretches the bandwidth term only.
  EXPECT_DOUBLE_EQ(collective_seconds(Algorithm::mpi, link, Collective::all_gather_v,
                                      std::vector{1e8, 1e8}, 0, 2.0),
                   1e-6 + 2 * 0.5e8 / 4e9);
}

/// toy_machine's nodes of `per_node` ranks sharing 2 cores, modeled on the local backend: direct
/// copies over an intra link of 1 us + n / 1 GB/s.
json cpu_node_machine(int per_node) {
  json document = toy_machine(per_node);
  document["shared_compute"] = true;
  document["cores_per_node"] = 2;
  document["backend"] = "local";
  document["links"]["local"] = {{"algorithm", "direct"},
                                {"intra", {{"alpha", 1e-6}, {"beta", 1e9}}}};
  return document;
}

TEST(CostModel, RanksBeyondTheCoresOfANodeCopyAFewAtATime) {
  // 2 or 4 ranks of one 2-core node all-gather 1 MB through shared memory (1 us + n / 1 GB/s,
  // each rank copying the whole 1 MB): with 4 ranks two copy at a time, so the bandwidth term
  // doubles; NCCL (GPUs) does not share.
  const auto gather = [](int ranks) {
    json events = json::array();
    for (int r = 0; r < ranks; ++r) {
      events.push_back(rank_name(r));
      events.push_back(event(r, "comm", "all_gather_v", 1, 10,
                             {{"bytes", 1e6}, {"group", "w"}, {"ranks", ranks}, {"rank", r}}));
    }
    return json{{"traceEvents", events}};
  };
  json document = cpu_node_machine(4);
  const Machine machine = machine_from_json(document);
  EXPECT_NEAR(replay(gather(2), machine).step_seconds, 1e-6 + 1e6 / 1e9, 1e-12);
  EXPECT_NEAR(replay(gather(4), machine).step_seconds, 1e-6 + 2 * 1e6 / 1e9, 1e-12);
  ReplayOptions nccl;
  nccl.backend = "nccl";  // ring over the intra link: 3 alpha + 0.75 n / beta, no contention
  EXPECT_NEAR(replay(gather(4), machine, nccl).step_seconds, 3e-6 + 0.75e6 / 1e9, 1e-12);
  document.erase("cores_per_node");  // cores unknown: no contention
  EXPECT_NEAR(replay(gather(4), machine_from_json(document)).step_seconds, 1e-6 + 1e6 / 1e9, 1e-12);
}

TEST(CostModel, StridedBlocksAndRecordedCopiesPayPerRun) {
  // 2 ranks of a 2-core node: an all_to_all_w of 1 MB whose blocks make 1000 runs on rank 0 and
  // 10 on rank 1 (the most, 1000, sets the collective's), then a redistribute that copied
  // 0.5 MB in 200 runs outside it. Links 1 us + n / 1 GB/s; copies 10 GB/s; 10 ns per run.
  json document = cpu_node_machine(2);
  document["compute"]["copy_run_seconds"] = 1e-8;
  json events = json::array();
  for (int r = 0; r < 2; ++r) {
    events.push_back(rank_name(r));
    events.push_back(event(r, "redistribute", "redistribute", 1, 50,
                           {{"from", "a"},
                            {"to", "b"},
                            {"copied_bytes", 5e5},
                            {"copy_runs", 200},
                            {"local_bytes", 9e9}}));
    events.push_back(event(
        r, "comm", "all_to_all_w", 2, 10,
        {{"bytes", 1e6}, {"group", "w"}, {"ranks", 2}, {"rank", r}, {"runs", r == 0 ? 1000 : 10}}));
  }
  const Prediction prediction = replay({{"traceEvents", events}}, machine_from_json(document));
  const double collective = 1e-6 + 1e6 / 1e9 + 1000 * 1e-8;
  const double copy = 2 * 5e5 / (0.5 * 1e10) + 200 * 1e-8;  // half the node each, one core each
  EXPECT_NEAR(prediction.step_seconds, collective + copy, 1e-12);
  EXPECT_NEAR(prediction.calls.at("all_to_all_w").mean(), collective, 1e-12);
}

TEST(CostModel, LocalCopiesTakeTheNodesBandwidthAtTheirWorkingSet) {
  json document = toy_machine(2);
  document["compute"]["memory_bandwidth_by_working_set"] = {{1e6, 1e11}, {1e8, 1e10}};
  const Machine machine = machine_from_json(document);
  // 0.25 MB copied by the only rank: 0.5 MB read and written, in the cache.
  EXPECT_DOUBLE_EQ(copy_seconds(machine, 2.5e5), 5e5 / 1e11);
  // The same by one of two ranks copying alike: half of the node at a 1 MB working set.
  EXPECT_DOUBLE_EQ(copy_seconds(machine, 2.5e5, 0.5), 5e5 / (0.5 * 1e11));
  // 100 MB: streamed from memory.
  EXPECT_DOUBLE_EQ(copy_seconds(machine, 1e8), 2e8 / 1e10);
  // Without the curve: memory_bandwidth (10 GB/s) at every size.
  EXPECT_DOUBLE_EQ(copy_seconds(machine_from_json(toy_machine(2)), 2.5e5), 5e5 / 1e10);
  EXPECT_EQ(copy_seconds(machine, 0), 0);
  // Runs: each costs copy_run_seconds on the rank's thread, stretched when the node's ranks
  // outnumber its cores (share * cores < 1).
  document["compute"]["copy_run_seconds"] = 1e-8;
  document["cores_per_node"] = 2;
  const Machine strided = machine_from_json(document);
  EXPECT_DOUBLE_EQ(copy_seconds(strided, 2.5e5, 1, 1000), 5e5 / 1e11 + 1e-5);
  EXPECT_DOUBLE_EQ(copy_seconds(strided, 2.5e5, 0.5, 1000), 5e5 / (0.5 * 1e11) + 1e-5);
  EXPECT_DOUBLE_EQ(copy_seconds(strided, 1.25e5, 0.25, 1000), 2.5e5 / (0.25 * 1e11) + 2e-5);
  EXPECT_DOUBLE_EQ(copy_seconds(strided, 0, 1, 1000), 1e-5);
  EXPECT_DOUBLE_EQ(machine_from_json(machine_to_json(strided)).copy_run_seconds, 1e-8);
}

TEST(CostModel, FitLinkCurveMeasuresBetaAtEachWorkingSet) {
  // alpha 5 us; 20 GB/s while the working set (3x the bytes) is small, 5 GB/s beyond 30 MB.
  const std::vector<double> bytes{1e3, 1e5, 1e6, 1e7, 1e8};
  std::vector<double> seconds, working_sets;
  for (double n : bytes) {
    working_sets.push_back(3 * n);
    seconds.push_back(5e-6 + n / (3 * n <= 3e7 ? 2e10 : 5e9));
  }
  const Link link = fit_link_curve(bytes, seconds, working_sets);
  EXPECT_GT(link.alpha, 0);
  // 1e3 B takes 5.05 us: alpha's share, no point; every other size gives its own beta back
  // (within what the one alpha fitted through both regimes leaves: 5% at 1e5 B, where alpha is
  // half the time) and its own time exactly.
  ASSERT_EQ(link.beta_by_working_set.size(), 4u);
  EXPECT_DOUBLE_EQ(link.beta_by_working_set[0].first, 3e5);
  for (size_t i = 0; i < 4; ++i) {
    const double expected = i < 3 ? 2e10 : 5e9;
    EXPECT_NEAR(link.beta_by_working_set[i].second / expected, 1, 0.05) << i;
    EXPECT_NEAR((link.alpha + bytes[i + 1] / link.beta_at(working_sets[i + 1])) / seconds[i + 1], 1,
                1e-9)
        << i;
  }
  EXPECT_THROW(fit_link_curve(bytes, seconds, std::vector<double>{1, 2}), InvalidArgument);
}

TEST(CostModel, FitLinkRecoversAlphaAndBeta) {
  const std::vector<double> bytes{1e3, 1e5, 1e6, 1e7};
  std::vector<double> seconds;
  for (double n : bytes) seconds.push_back(5e-6 + n / 2e9);
  const Link link = fit_link(bytes, seconds);
  EXPECT_NEAR(link.alpha, 5e-6, 1e-12);
  EXPECT_NEAR(link.beta, 2e9, 1e-3);
}

TEST(CostModel, ARankThatChoseItsThreadsGetsThoseCoresOfASharedNode) {
  // Two ranks on one 4-core node whose ranks share the cores; each runs a conv of 1e7 flops
  // (10 GFLOP/s for the node). Without rank_threads each gets half the node: 2 ms. A rank that
  // chose 1 thread gets a quarter (4 ms); one that chose 8 still gets no more than its half.
  json document = toy_machine(2);
  document["shared_compute"] = true;
  document["cores_per_node"] = 4;
  const Machine machine = machine_from_json(document);
  EXPECT_EQ(machine_from_json(machine_to_json(machine)).cores_per_node, 4);
  const auto trace = [](int threads0, int threads1) {
    json events = json::array({rank_name(0), rank_name(1)});
    for (auto [pid, threads] : {std::pair{0, threads0}, std::pair{1, threads1}})
      if (threads > 0)
        events.push_back({{"name", "rank_threads"},
                          {"ph", "M"},
                          {"pid", pid},
                          {"tid", 0},
                          {"args", {{"threads", threads}}}});
    events.push_back(event(0, "op", "conv", 0, 5, {{"flops", 1e7}, {"bytes", 0}}));
    events.push_back(event(1, "op", "conv", 0, 5, {{"flops", 1e7}, {"bytes", 0}}));
    return json{{"traceEvents", events}};
  };
  EXPECT_NEAR(replay(trace(0, 0), machine).step_seconds, 2e-3, 1e-12);
  EXPECT_NEAR(replay(trace(1, 0), machine).step_seconds, 4e-3, 1e-12);
  EXPECT_NEAR(replay(trace(8, 8), machine).step_seconds, 2e-3, 1e-12);
  // A machine file without cores_per_node keeps the even share; GPUs (not shared) ignore it.
  document.erase("cores_per_node");
  EXPECT_NEAR(replay(trace(1, 1), machine_from_json(document)).step_seconds, 2e-3, 1e-12);
  document["shared_compute"] = false;
  document["cores_per_node"] = 4;
  EXPECT_NEAR(replay(trace(1, 1), machine_from_json(document)).step_seconds, 1e-3, 1e-12);
  // A bad count is refused by name.
  json bad = trace(0, 0);
  bad["traceEvents"].push_back(
      {{"name", "rank_threads"}, {"ph", "M"}, {"pid", 0}, {"tid", 0}, {"args", {{"threads", 0}}}});
  EXPECT_THROW(replay(bad, machine), InvalidArgument);
  document["cores_per_node"] = 2.5;
  EXPECT_THROW(machine_from_json(document), InvalidArgument);
}

TEST(CostModel, OneBusyCoreRunsAtTheAloneRateAFullNodeAtTheLoadedOne) {
  // A 2-core node: conv at 1e10 flop/s for the node with both cores busy (5e9 a core), 2e10 as
  // the node's equivalent of one core running alone (1e10 for that core).
  json document = toy_machine(4);
  document["shared_compute"] = true;
  document["cores_per_node"] = 2;
  document["compute"]["families_alone"] = {{"conv", {{"flops", 2e10}, {"bytes", 1e10}}}};
  const Machine machine = machine_from_json(document);
  EXPECT_DOUBLE_EQ(machine_from_json(machine_to_json(machine)).families_alone.at("conv").flops,
                   2e10);
  // Half the node: 1 ms alone, 2 ms loaded, interpolated between.
  EXPECT_DOUBLE_EQ(event_seconds(machine, "conv", 1e7, 0, 0.5, 0), 1e-3);
  EXPECT_DOUBLE_EQ(event_seconds(machine, "conv", 1e7, 0, 0.5, 1), 2e-3);
  EXPECT_DOUBLE_EQ(event_seconds(machine, "conv", 1e7, 0, 0.5, 0.5), 1.5e-3);
  EXPECT_DOUBLE_EQ(event_seconds(machine, "conv backward", 1e7, 0, 0.5, 0), 1e-3);  // conv's
  // No alone entry for the op, its family or "default": the loaded rate at any load.
  EXPECT_DOUBLE_EQ(event_seconds(machine, "norm", 1e7, 0, 1, 0), 1e-2);
  // The replay's load: one rank of one thread keeps the other core idle (alone, half the node);
  // one rank of the default threads and two ranks of one thread fill both (loaded).
  const auto trace = [](int ranks, int threads) {
    json events = json::array();
    for (int r = 0; r < ranks; ++r) {
      events.push_back(rank_name(r));
      if (threads > 0)
        events.push_back({{"name", "rank_threads"},
                          {"ph", "M"},
                          {"pid", r},
                          {"tid", 0},
                          {"args", {{"threads", threads}}}});
      events.push_back(event(r, "op", "conv", 0, 5, {{"flops", 1e7}, {"bytes", 0}}));
    }
    return json{{"traceEvents", events}};
  };
  EXPECT_NEAR(replay(trace(1, 1), machine).step_seconds, 1e-3, 1e-12);
  EXPECT_NEAR(replay(trace(1, 0), machine).step_seconds, 1e-3, 1e-12);
  EXPECT_NEAR(replay(trace(2, 1), machine).step_seconds, 2e-3, 1e-12);
  EXPECT_NEAR(replay(trace(2, 0), machine).step_seconds, 2e-3, 1e-12);
  // A bad entry is refused by name.
  document["compute"]["families_alone"]["conv"]["flops"] = -1;
  EXPECT_THROW(machine_from_json(document), InvalidArgument);
  document["compute"]["families_alone"] = 3;
  EXPECT_THROW(machine_from_json(document), InvalidArgument);
}

TEST(CostModel, MachineFileRoundTrips) {
  const Machine machine = machine_from_json(toy_machine(8));
  const Machine again = machine_from_json(machine_to_json(machine));
  EXPECT_EQ(again.ranks_per_node, 8);
  EXPECT_EQ(again.backend, "nccl");
  EXPECT_DOUBLE_EQ(again.links.at("nccl").inter.beta, 1e8);
  EXPECT_DOUBLE_EQ(again.families.at("conv").flops, 1e10);
  // An old file (ring, no NVLS) stays a ring without NVLS; an nccl one keeps its NVLS link.
  EXPECT_EQ(again.links.at("nccl").algorithm, Algorithm::ring);
  EXPECT_FALSE(again.links.at("nccl").nvls);
  json nccl = toy_machine(8);
  nccl["links"]["nccl"]["algorithm"] = "nccl";
  nccl["links"]["nccl"]["nvls"] = {{"alpha", 2.5e-5}, {"beta", 3e11}};
  const Machine tuned = machine_from_json(machine_to_json(machine_from_json(nccl)));
  EXPECT_EQ(tuned.links.at("nccl").algorithm, Algorithm::nccl);
  ASSERT_TRUE(tuned.links.at("nccl").nvls);
  EXPECT_DOUBLE_EQ(tuned.links.at("nccl").nvls->alpha, 2.5e-5);
  EXPECT_DOUBLE_EQ(tuned.links.at("nccl").nvls->beta, 3e11);
  // Measured curves (calibrated machines) survive the round trip.
  json curved = toy_machine(2);
  curved["links"]["nccl"]["intra"]["beta_by_working_set"] = {{1e6, 2e10}, {1e8, 4e9}};
  curved["compute"]["memory_bandwidth_by_working_set"] = {{5e5, 1e11}};
  const Machine measured = machine_from_json(machine_to_json(machine_from_json(curved)));
  EXPECT_EQ(measured.links.at("nccl").intra.beta_by_working_set,
            (BandwidthCurve{{1e6, 2e10}, {1e8, 4e9}}));
  EXPECT_TRUE(measured.links.at("nccl").inter.beta_by_working_set.empty());
  EXPECT_EQ(measured.memory_bandwidth_by_working_set, (BandwidthCurve{{5e5, 1e11}}));
}

TEST(CostModel, BadMachineFilesAreRefusedByName) {
  json missing_links = toy_machine(1);
  missing_links.erase("links");
  EXPECT_THROW(machine_from_json(missing_links), InvalidArgument);
  json negative = toy_machine(1);
  negative["links"]["nccl"]["intra"]["beta"] = -1;
  try {
    machine_from_json(negative);
    FAIL() << "a negative beta was accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("links.nccl.intra.beta"), std::string::npos);
  }
  json no_default = toy_machine(1);
  no_default["compute"]["families"].erase("default");
  EXPECT_THROW(machine_from_json(no_default), InvalidArgument);
  EXPECT_THROW(machine_from_json(json::array()), InvalidArgument);
  json bad_nvls = toy_machine(1);
  bad_nvls["links"]["nccl"]["nvls"] = {{"alpha", 1e-6}};
  try {
    machine_from_json(bad_nvls);
    FAIL() << "an NVLS link without beta was accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("links.nccl.nvls"), std::string::npos);
  }
  for (const json& curve : {json{{1e6, 2e10}, {1e6, 4e9}}, json{{1e6}}, json{{1e6, -1.0}},
                            json("fast"), json{{"1e6", 2e10}}}) {
    json bad_curve = toy_machine(1);
    bad_curve["links"]["nccl"]["intra"]["beta_by_working_set"] = curve;
    try {
      machine_from_json(bad_curve);
      FAIL() << "the curve " << curve.dump() << " was accepted";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("links.nccl.intra.beta_by_working_set"),
                std::string::npos)
          << error.what();
    }
  }
  json bad_algorithm = toy_machine(1);
  bad_algorithm["links"]["nccl"]["algorithm"] = "butterfly";
  EXPECT_THROW(machine_from_json(bad_algorithm), InvalidArgument);
}

TEST(CostModel, MalformedOrIncompleteTracesAreRefused) {
  const Machine machine = machine_from_json(toy_machine(2));
  EXPECT_THROW(replay(json{{"events", json::array()}}, machine), InvalidArgument);
  EXPECT_THROW(replay(json{{"traceEvents", json::array({{{"ph", "X"}}})}}, machine),
               InvalidArgument);
  // Rank 1 never reaches the all-reduce rank 0 waits in.
  json events = json::array({rank_name(0), rank_name(1)});
  events.push_back(event(0, "comm", "all_reduce", 0, 1,
                         {{"bytes", 8}, {"group", "w"}, {"ranks", 2}, {"rank", 0}}));
  events.push_back(event(1, "op", "gelu", 0, 1, {{"flops", 1}, {"bytes", 8}}));
  try {
    replay({{"traceEvents", events}}, machine);
    FAIL() << "an incomplete trace replayed";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("stuck"), std::string::npos);
  }
}

TEST(CostModel, TheLastLaunchOfATraceIsReplayedUnlessOneIsNamed) {
  json events = json::array();
  for (double flops : {1e6, 3e6}) {  // two launches of one rank
    events.push_back(rank_name(0));
    events.push_back(event(0, "op", "gelu", 0, 1, {{"flops", flops}, {"bytes", 0}}));
  }
  const Machine machine = machine_from_json(toy_machine(1));
  EXPECT_NEAR(replay({{"traceEvents", events}}, machine).step_seconds, 3e-3, 1e-12);
  EXPECT_NEAR(replay({{"traceEvents", events}}, machine, {.launch = 0}).step_seconds, 1e-3, 1e-12);
  EXPECT_THROW(replay({{"traceEvents", events}}, machine, {.launch = 2}), InvalidArgument);
}

}  // namespace
}  // namespace tessera::cost
