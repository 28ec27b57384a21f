// The trace (core/trace.hpp): a traced run of a small training step (conv with its halo, a
// redistribute, backward, the data-parallel reducer, an optimizer step, sharded HDF5 output)
// writes valid JSON with one pid per rank, complete events of every category with sane times,
// and comm events carrying their bytes; and with tracing off a Span records nothing.
#include "core/trace.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/tessera.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/layers.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/io_test_support.hpp"
#include "tests/dist/shard_cases.hpp"

#if TESSERA_TEST_HAVE_HDF5
#include "io/hdf5/sharded_io.hpp"
#endif

namespace tessera {
namespace {

TEST(Trace, SpansRecordNothingOutsideATracedRank) {
  trace::Span span("op", "not traced");
  EXPECT_FALSE(span.recording());
}

TEST(Trace, ATracedTrainingStepWritesEveryCategoryWithOnePidPerRank) {
  for (int world : {2, 4}) {
    testing::run_world(world, [&](std::shared_ptr<Comm> comm) {
      const std::string dir = testing::make_test_dir(*comm, "trace", "step");
      const std::string file = dir + "/trace.json";
      if (comm->rank() == 0 || testing::mpi_backend())
        trace::start(file);  // one process or each one
      comm->barrier();
      trace::traced(comm, [&](std::shared_ptr<Comm> traced_comm) {
        DeviceMesh mesh(traced_comm, {2, world / 2}, {"dp", "x"});
        nn::Conv conv(mesh, nn::ConvConfig{.in_channels = 2, .out_channels = 2}, 3);
        optim::Sgd sgd(conv.parameters(), {.lr = 0.1});
        nn::GradReducer reducer(conv.parameters());
        testing::CaseRng rng(3);
        const Tensor x_full = testing::integer_tensor({2, 2, 9, 7}, DType::f32, rng, -3, 3);
        const ShardTensor x =
            ShardTensor::distribute(x_full, mesh, {Placement::shard(0), Placement::shard(2)});
        {
          trace::Span step("step", "step 0");
          Tape tape;
          const ShardTensor y = conv.forward(x);
          tape.backward(ops::sum(ops::mul(y, y)));
          reducer.finish();
          sgd.step();
          NoGrad plain;
          const ShardTensor moved = y.redistribute({Placement::replicate(), Placement::shard(3)});
#if TESSERA_TEST_HAVE_HDF5
          io::write_sharded(moved, dir + "/y.h5", "y");
#endif
        }
      });
      if (comm->rank() == 0) {
        std::ifstream in(file);
        ASSERT_TRUE(in) << "no trace file " << file;
        const nlohmann::json document = nlohmann::json::parse(in);  // throws if invalid
        std::set<int> pids;
        std::set<std::string> categories;
        int comm_with_bytes = 0;
        for (const nlohmann::json& event : document["traceEvents"]) {
          if (event["ph"] == "M") continue;
          EXPECT_EQ(event["ph"], "X");
          EXPECT_GE(event["dur"].get<double>(), 0.0);
          EXPECT_GT(event["ts"].get<double>(), 0.0);
          pids.insert(event["pid"].get<int>());
          categories.insert(event["cat"].get<std::string>());
          if (event["cat"] == "comm" && event["args"].contains("bytes")) ++comm_with_bytes;
        }
        std::set<int> expected_pids;
        for (int rank = 0; rank < world; ++rank) expected_pids.insert(rank);
        EXPECT_EQ(pids, expected_pids);
        std::set<std::string> expected{"op", "halo", "comm", "redistribute", "optimizer", "step"};
#if TESSERA_TEST_HAVE_HDF5
        expected.insert("io");
#endif
        for (const std::string& category : expected)
          EXPECT_TRUE(categories.contains(category)) << "no event of category " << category;
        EXPECT_GT(comm_with_bytes, 0);
      }
      comm->barrier();
      trace::stop();
      testing::remove_test_dir(*comm, dir);
    });
  }
}

/// Runs `body` traced on `comm` (collective) and returns the trace on rank 0 (null elsewhere).
nlohmann::json traced_run(const std::shared_ptr<Comm>& comm, const std::string& name,
                          const std::function<void(std::shared_ptr<Comm>)>& body) {
  const std::string dir = testing::make_test_dir(*comm, "trace", name);
  const std::string file = dir + "/trace.json";
  if (comm->rank() == 0 || testing::mpi_backend()) trace::start(file);
  comm->barrier();
  trace::traced(comm, body);
  nlohmann::json document;
  if (comm->rank() == 0) {
    std::ifstream in(file);
    EXPECT_TRUE(in) << "no trace file " << file;
    if (in) document = nlohmann::json::parse(in);
  }
  comm->barrier();
  trace::stop();
  testing::remove_test_dir(*comm, dir);
  return document;
}

TEST(Trace, ARedistributeRecordsTheBytesItCopiesOutsideItsCollectives) {
  // [8, 6] f32 on 2 ranks. S(0) -> S(1): each rank keeps its [4, 3] corner (48 bytes copied),
  // the rest travels in the all_to_all. S(0) -> R: an all_gather straight into the result (0).
  // S(1) -> R: gathered blocks unpacked into the [8, 6] result (192 bytes).
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    const nlohmann::json document =
        traced_run(comm, "copied", [&](std::shared_ptr<Comm> traced_comm) {
          DeviceMesh mesh(traced_comm, {2}, {"x"});
          testing::CaseRng rng(5);
          const Tensor full = testing::integer_tensor({8, 6}, DType::f32, rng, -3, 3);
          const ShardTensor rows = ShardTensor::distribute(full, mesh, {Placement::shard(0)});
          const ShardTensor columns = rows.redistribute({Placement::shard(1)});
          rows.redistribute({Placement::replicate()});
          columns.redistribute({Placement::replicate()});
        });
    if (comm->rank() == 0) {
      std::map<std::string, std::set<int64_t>> copied;  // by target layout, over both ranks
      for (const nlohmann::json& event : document["traceEvents"])
        if (event["ph"] == "X" && event["cat"] == "redistribute") {
          ASSERT_TRUE(event["args"].contains("copied_bytes")) << event.dump();
          copied[event["args"]["to"].get<std::string>()].insert(
              event["args"]["copied_bytes"].get<int64_t>());
        }
      ASSERT_EQ(copied.size(), 2u);  // to S(1) and to R
      int64_t to_columns = -1;
      std::set<int64_t> to_replicate;
      for (const auto& [to, values] : copied)
        if (to.find("S(1)") != std::string::npos) {
          ASSERT_EQ(values.size(), 1u);
          to_columns = *values.begin();
        } else {
          to_replicate = values;
        }
      EXPECT_EQ(to_columns, 48);
      EXPECT_EQ(to_replicate, (std::set<int64_t>{0, 192}));
    }
  });
}

TEST(Trace, AnElementwiseOpAndItsBackwardAddNoCollective) {
  // sum(x) and sum(erf(x)) forward and backward on 2 ranks issue the same collectives: erf's
  // rule keeps x's layout and its backward takes the gradient to it without an agreement
  // all-reduce (ShardTensor::redistribute_to: the layout is derived from agreed ones).
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    const nlohmann::json document =
        traced_run(comm, "no_agreement", [&](std::shared_ptr<Comm> traced_comm) {
          DeviceMesh mesh(traced_comm, {2}, {"x"});
          testing::CaseRng rng(9);
          const Tensor full = testing::integer_tensor({6, 4}, DType::f64, rng, -3, 3);
          for (const char* name : {"plain", "erf"}) {
            trace::Span region("step", name);
            ShardTensor x = ShardTensor::distribute(full, mesh, {Placement::shard(0)});
            x.set_requires_grad(true);
            Tape tape;
            tape.backward(ops::sum(std::string(name) == "erf" ? ops::erf(x) : x));
          }
        });
    if (comm->rank() == 0) {
      std::map<std::string, std::pair<double, double>> regions;  // name -> [begin, end] on pid 0
      std::vector<nlohmann::json> collectives;
      for (const nlohmann::json& event : document["traceEvents"]) {
        if (event["ph"] != "X" || event["pid"] != 0) continue;
        const double begin = event["ts"].get<double>(), end = begin + event["dur"].get<double>();
        if (event["cat"] == "step") regions[event["name"].get<std::string>()] = {begin, end};
        if (event["cat"] == "comm") collectives.push_back(event);
      }
      ASSERT_EQ(regions.size(), 2u);
      std::map<std::string, std::vector<std::string>> in_region;
      for (const nlohmann::json& event : collectives) {
        const double begin = event["ts"].get<double>();
        for (const auto& [name, range] : regions)
          if (begin >= range.first && begin <= range.second)
            in_region[name].push_back(event["name"].get<std::string>());
      }
      EXPECT_EQ(in_region["erf"], in_region["plain"]);
    }
  });
}

TEST(Redistribute, ToALayoutOfAnotherShapeOrMeshIsRefused) {
  testing::run_world(2, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2}, {"x"});
    const ShardTensor x =
        ShardTensor::distribute(Tensor::zeros({4, 6}, DType::f32), mesh, {Placement::shard(0)});
    const ShardSpec other_shape = ShardSpec::make({4, 7}, {2}, {Placement::shard(0)}, {}, "test");
    const ShardSpec other_mesh = ShardSpec::make({4, 6}, {1}, {Placement::replicate()}, {}, "test");
    EXPECT_THROW(x.redistribute_to(other_shape), InvalidArgument);
    EXPECT_THROW(x.redistribute_to(other_mesh), InvalidArgument);
    const ShardTensor y =
        x.redistribute_to(ShardSpec::make({4, 6}, {2}, {Placement::shard(1)}, {}, "test"));
    EXPECT_EQ(y.placements()[0], Placement::shard(1));
    EXPECT_TRUE(bitwise_equal(y.full_tensor(), x.full_tensor()));
  });
}

}  // namespace
}  // namespace tessera
