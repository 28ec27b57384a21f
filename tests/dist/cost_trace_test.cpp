// What the cost model reads from a trace (core/trace.cpp, OpDef::cost): op events carry the
// analytic flops and bytes of their local kernel (twice that for backward), comm events name
// their communicator (group, size, rank) and started batches and collectives pair with their
// waits by id, p2p batches list per-peer bytes; each rank's labels carry the backend; and the
// real trace of a sharded training step replays on a modeled machine.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/cost/cost_model.hpp"
#include "core/tessera.hpp"
#include "core/trace.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/layers.hpp"
#include "ops/op_costs.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/io_test_support.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

Tensor zeros(const Shape& shape) {
  return Tensor::zeros(shape, DType::f32);
}

TEST(OpCost, CostFunctionsGiveTheAnalyticFlops) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    const DeviceMesh mesh(comm, {1});
    OpAttrs attrs;
    const KernelContext context{mesh, attrs, {}, {}, {}, {}, {}};
    // conv: 2 * |y| * C/groups * prod(k).
    const OpCost conv = ops::conv_cost(context, {zeros({1, 3, 10, 10}), zeros({4, 3, 3, 3})},
                                       {zeros({1, 4, 8, 8})});
    EXPECT_DOUBLE_EQ(conv.flops, 2.0 * 256 * 27);
    EXPECT_DOUBLE_EQ(conv.bytes, 4.0 * (300 + 108 + 256));
    // conv_transpose: 2 * |x| * Cout/groups * prod(k), w [Cin, Cout/groups, k..].
    EXPECT_DOUBLE_EQ(ops::conv_transpose_cost(context, {zeros({1, 2, 5, 5}), zeros({2, 3, 3, 3})},
                                              {zeros({1, 3, 7, 7})})
                         .flops,
                     2.0 * 50 * 27);
    // linear: x [5, 7] w [3, 7] -> y [5, 3]; matmul: a [2, 4, 6] b [6, 5] -> y [2, 4, 5].
    EXPECT_DOUBLE_EQ(
        ops::matmul_cost(context, {zeros({5, 7}), zeros({3, 7})}, {zeros({5, 3})}).flops,
        2.0 * 15 * 7);
    EXPECT_DOUBLE_EQ(
        ops::matmul_cost(context, {zeros({2, 4, 6}), zeros({6, 5})}, {zeros({2, 4, 5})}).flops,
        2.0 * 40 * 6);
    // na 2-d, window 3x5: 4 * |q| * 15 (q.k and the weighted sum of v).
    OpAttrs na_attrs;
    na_attrs.set("kernel_size", std::vector<int64_t>{3, 5});
    const KernelContext na_context{mesh, na_attrs, {}, {}, {}, {}, {}};
    const Tensor q = zeros({1, 8, 8, 2, 4});
    EXPECT_DOUBLE_EQ(ops::na_cost(na_context, {q, q, q}, {q, zeros({1, 8, 8, 2})}).flops,
                     4.0 * 512 * 15);
    // Pool with one kernel size for both spatial dims: |y| * 2 * 2.
    OpAttrs pool_attrs;
    pool_attrs.set("kernel_size", std::vector<int64_t>{2});
    const KernelContext pool_context{mesh, pool_attrs, {}, {}, {}, {}, {}};
    EXPECT_DOUBLE_EQ(
        ops::pool_cost(pool_context, {zeros({1, 2, 8, 8})}, {zeros({1, 2, 4, 4})}).flops, 32.0 * 4);
    // An op without a cost function: the bytes in and out, a flop per output element.
    const OpDef plain{.name = "plain"};
    const OpCost fallback = op_cost(plain, context, {zeros({3, 4})}, {zeros({3, 4}), zeros({2})});
    EXPECT_DOUBLE_EQ(fallback.flops, 14);
    EXPECT_DOUBLE_EQ(fallback.bytes, 4.0 * 26);
  });
}

TEST(OpCost, TracedEventsCarryWhatTheCostModelNeeds) {
  for (int world : {2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "cost_trace", "args");
      const std::string file = dir + "/trace.json";
      if (comm->rank() == 0 || testing::mpi_backend()) trace::start(file);
      comm->barrier();
      trace::traced(comm, [&](std::shared_ptr<Comm> traced_comm) {
        DeviceMesh mesh(traced_comm, {world / 2, 2}, {"dp", "x"});
        nn::Conv conv(mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 3}, 3);
        nn::GradReducer reducer(conv.parameters());
        testing::CaseRng rng(5);
        const Tensor x_full = testing::integer_tensor({2, 2, 12, 6}, DType::f32, rng, -3, 3);
        const ShardTensor x =
            ShardTensor::distribute(x_full, mesh, {Placement::shard(0), Placement::shard(2)});
        trace::Span step("step", "step 0");
        Tape tape;
        const ShardTensor y = conv.forward(x);
        tape.backward(ops::sum(ops::mul(y, y)));
        reducer.finish();
      });
      if (comm->rank() == 0) {
        std::ifstream in(file);
        ASSERT_TRUE(in) << "no trace file " << file;
        const nlohmann::json document = nlohmann::json::parse(in);
        std::map<int, std::string> backends;
        std::map<int, std::set<int64_t>> started, waited;
        std::map<int, double> conv_flops, conv_backward_flops;
        int batches = 0;
        for (const nlohmann::json& event : document["traceEvents"]) {
          const int pid = event["pid"].get<int>();
          if (event["ph"] == "M") {
            if (event["name"] == "process_labels")
              backends[pid] = event["args"]["backend"].get<std::string>();
            continue;
          }
          const nlohmann::json& args = event["args"];
          const std::string name = event["name"].get<std::string>();
          if (event["cat"] == "op" && name == "conv") {
            // Local y [2 / dp, 3, 12 / 2, 6] (same padding), w [3, 2, 3, 3].
            const double y_local = (2.0 / (world / 2)) * 3 * 6 * 6;
            EXPECT_DOUBLE_EQ(args["flops"].get<double>(), 2 * y_local * 2 * 9);
            EXPECT_GT(args["bytes"].get<double>(), 0);
            conv_flops[pid] = args["flops"].get<double>();
          }
          if (event["cat"] == "op" && name == "conv backward")
            conv_backward_flops[pid] = args["flops"].get<double>();
          if (event["cat"] != "comm" || name == "gradient reducer finish") continue;
          if (name.ends_with(" wait")) {
            ASSERT_TRUE(args.contains("id")) << name;
            waited[pid].insert(args["id"].get<int64_t>());
            continue;
          }
          ASSERT_TRUE(args.contains("group") && args.contains("ranks") && args.contains("rank"))
              << name << " has no communicator args: " << args.dump();
          EXPECT_LT(args["rank"].get<int>(), args["ranks"].get<int>());
          if (name.ends_with(" start")) {
            ASSERT_TRUE(args.contains("id")) << name;
            started[pid].insert(args["id"].get<int64_t>());
          }
          if (name == "send_recv start") {
            ++batches;
            // ">PEER:BYTES" per message, summing to bytes_sent.
            std::istringstream peers(args["peers"].get<std::string>());
            std::string token;
            double sent = 0;
            while (peers >> token) {
              const size_t colon = token.find(':');
              ASSERT_NE(colon, std::string::npos) << token;
              if (token[0] == '>') sent += std::stod(token.substr(colon + 1));
            }
            EXPECT_DOUBLE_EQ(sent, args["bytes_sent"].get<double>());
          }
          if (name == "split" && args.contains("child")) {
            EXPECT_TRUE(
                args["child"].get<std::string>().starts_with(args["group"].get<std::string>()));
            EXPECT_LT(args["child_rank"].get<int>(), args["child_ranks"].get<int>());
          }
        }
        EXPECT_EQ(static_cast<int>(backends.size()), world);
        EXPECT_GT(batches, 0);
        for (const auto& [pid, ids] : started) EXPECT_EQ(ids, waited[pid]) << "rank " << pid;
        for (const auto& [pid, flops] : conv_flops)
          EXPECT_DOUBLE_EQ(conv_backward_flops[pid], 2 * flops) << "rank " << pid;
        // The real trace replays: every collective and message finds its peers.
        const nlohmann::json machine = {
            {"ranks_per_node", 2},
            {"links", {{"local", {{"intra", {{"alpha", 1e-6}, {"beta", 1e9}}}}}}},
            {"compute",
             {{"op_overhead", 1e-6},
              {"memory_bandwidth", 1e10},
              {"families", {{"default", {{"flops", 1e9}, {"bytes", 1e10}}}}}}}};
        const cost::Prediction prediction =
            cost::replay(document, cost::machine_from_json(machine));
        EXPECT_EQ(prediction.ranks, world);
        EXPECT_EQ(prediction.steps, 1);
        EXPECT_GT(prediction.step_seconds, 0);
        EXPECT_GT(prediction.comm_seconds, 0);
      }
      comm->barrier();
      trace::stop();
      testing::remove_test_dir(*comm, dir);
    });
  }
}

}  // namespace
}  // namespace tessera
