// Estimate mode (core/estimate/): a program recorded on P simulated ranks without data sends
// exactly the messages and collectives a real P-rank local run sends (names, bytes, peers, in
// order per rank; timings aside), allocates no tensor data, opens no file (an input file for its
// metadata only), and counts the peak tensor bytes of each rank; P = 1024 records a Gray-Scott run.
// Simulated ranks hold one copy of a model's constants, not one each.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <regex>

#include "apps/sim/gray_scott.hpp"
#include "core/autograd.hpp"
#include "core/backend/backend.hpp"
#include "core/comm/launch.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/estimate/record.hpp"
#include "core/halo/halo_plan.hpp"
#include "core/host_allocator.hpp"
#include "core/parameter.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"
#include "io/onnx/onnx_graph.hpp"
#include "ops/nn/onnx_host.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"

namespace tessera {
namespace {

/// An event without what differs between runs: its time, duration and thread id, and the
/// backend its rank's label names (the real run's "local", the recording's "simulated").
std::string without_timing(const std::string& event) {
  static const std::regex timing(R"re("(ts|dur|tid)": [0-9.]+, )re");
  static const std::regex backend(R"re((backend=|"backend": ")[a-z]+)re");
  return std::regex_replace(std::regex_replace(event, timing, ""), backend, "$1");
}

std::vector<std::string> comparable(const std::vector<std::string>& events) {
  std::vector<std::string> result;
  for (const std::string& event : events) result.push_back(without_timing(event));
  return result;
}

/// Expects both recordings to hold the same events per rank, in order.
void expect_same_events(const estimate::Recording& real, const estimate::Recording& estimated) {
  ASSERT_EQ(real.ranks, estimated.ranks);
  for (int rank = 0; rank < real.ranks; ++rank) {
    const auto expected = comparable(real.events[rank]);
    const auto got = comparable(estimated.events[rank]);
    EXPECT_EQ(expected.size(), got.size()) << "rank " << rank;
    for (size_t i = 0; i < std::min(expected.size(), got.size()); ++i)
      ASSERT_EQ(expected[i], got[i]) << "rank " << rank << ", event " << i;
  }
}

size_t count_category(const estimate::Recording& recording, const std::string& category) {
  size_t count = 0;
  for (const auto& events : recording.events)
    for (const std::string& event : events)
      count += event.find("\"cat\": \"" + category + "\"") != std::string::npos;
  return count;
}

/// conv forward and backward of x [2, 3, 11, 9] on a 2x2 mesh sharding the spatial dims unevenly.
void conv_program(std::shared_ptr<Comm> world) {
  DeviceMesh mesh(world, {2, 2});
  const std::vector<Placement> replicated(2, Placement::replicate());
  Tape tape;
  ShardTensor x =
      ShardTensor::distribute(Tensor::zeros({2, 3, 11, 9}, DType::f64), mesh,
                              {Placement::shard(2), Placement::shard(3)}, {{7, 4}, {2, 7}});
  x.set_requires_grad();
  ShardTensor w =
      ShardTensor::distribute(Tensor::zeros({4, 3, 3, 3}, DType::f64), mesh, replicated);
  w.set_requires_grad();
  ops::ConvOptions options;
  options.padding = {1};
  const ShardTensor y = ops::conv(x, w, std::nullopt, options);
  tape.backward(ops::sum(y));
  ASSERT_TRUE(tape.grad(x).has_value());
  ASSERT_TRUE(tape.grad(w).has_value());
}

/// layer_norm forward and backward (w, b) of x [3, 5, 8] on a 2x2 mesh sharding a leading dim
/// and the normalized dim unevenly: the statistics travel in the forward only, the backward's sums
/// in the backward.
void layer_norm_program(std::shared_ptr<Comm> world) {
  DeviceMesh mesh(world, {2, 2});
  const std::vector<Placement> replicated(2, Placement::replicate());
  Tape tape;
  ShardTensor x =
      ShardTensor::distribute(Tensor::zeros({3, 5, 8}, DType::f64), mesh,
                              {Placement::shard(1), Placement::shard(2)}, {{3, 2}, {5, 3}});
  x.set_requires_grad();
  ShardTensor w = ShardTensor::distribute(Tensor::zeros({8}, DType::f64), mesh, replicated);
  w.set_requires_grad();
  const ShardTensor b = ShardTensor::distribute(Tensor::zeros({8}, DType::f64), mesh, replicated);
  tape.backward(ops::sum(ops::layer_norm(x, 1, w, b)));
  ASSERT_TRUE(tape.grad(x).has_value());
  ASSERT_TRUE(tape.grad(w).has_value());
}

/// max_pool forward and backward of x [2, 3, 11, 9] (f32) on a 2x2 mesh sharding the spatial
/// dims unevenly, windows crossing the shard borders (a halo); its second output is i64 indices.
void max_pool_program(std::shared_ptr<Comm> world) {
  DeviceMesh mesh(world, {2, 2});
  Tape tape;
  ShardTensor x =
      ShardTensor::distribute(Tensor::zeros({2, 3, 11, 9}, DType::f32), mesh,
                              {Placement::shard(2), Placement::shard(3)}, {{7, 4}, {2, 7}});
  x.set_requires_grad();
  const auto [y, indices] = ops::max_pool_with_indices(
      x, ops::PoolOptions{.kernel_size = {3}, .stride = {2}, .padding = {1}});
  ASSERT_EQ(indices.dtype(), DType::i64);
  tape.backward(ops::sum(y));
  ASSERT_TRUE(tape.grad(x).has_value());
}

/// group_norm forward and backward (w, b) of x [3, 6, 7] on a 2x2 mesh sharding the channel dim
/// (a group split across ranks) and the spatial dim unevenly: the statistics travel in the
/// forward only, the backward's sums in the backward.
void group_norm_program(std::shared_ptr<Comm> world) {
  DeviceMesh mesh(world, {2, 2});
  const std::vector<Placement> replicated(2, Placement::replicate());
  Tape tape;
  ShardTensor x =
      ShardTensor::distribute(Tensor::zeros({3, 6, 7}, DType::f64), mesh,
                              {Placement::shard(1), Placement::shard(2)}, {{4, 2}, {5, 2}});
  x.set_requires_grad();
  ShardTensor w = ShardTensor::distribute(Tensor::zeros({6}, DType::f64), mesh, replicated);
  w.set_requires_grad();
  const ShardTensor b = ShardTensor::distribute(Tensor::zeros({6}, DType::f64), mesh, replicated);
  tape.backward(ops::sum(ops::group_norm(x, 3, w, b)));
  ASSERT_TRUE(tape.grad(x).has_value());
  ASSERT_TRUE(tape.grad(w).has_value());
}

/// One training step of a 2-d conv (same padding, bias) with an mse loss and SGD, x [2, 4, H, W]
/// sharded over the spatial dims by a 2-d mesh (uneven when the mesh does not divide H and W).
void conv_training_program(std::shared_ptr<Comm> world, std::vector<int> mesh_shape, int64_t height,
                           int64_t width) {
  DeviceMesh mesh(world, mesh_shape);
  const std::vector<Placement> replicated(2, Placement::replicate());
  const std::vector<Placement> spatial{Placement::shard(2), Placement::shard(3)};
  Parameter w(ShardTensor::distribute(Tensor::zeros({8, 4, 3, 3}, DType::f32), mesh, replicated),
              "w");
  Parameter b(ShardTensor::distribute(Tensor::zeros({8}, DType::f32), mesh, replicated), "b");
  optim::Sgd sgd({w, b}, {.lr = 0.1, .momentum = 0.9});
  const ShardTensor x =
      ShardTensor::distribute(Tensor::zeros({2, 4, height, width}, DType::f32), mesh, spatial);
  const ShardTensor target =
      ShardTensor::distribute(Tensor::zeros({2, 8, height, width}, DType::f32), mesh, spatial);
  ops::ConvOptions same;
  same.padding_name = "same";
  {
    Tape tape;
    tape.backward(
        ops::mse_loss(ops::conv(x, w, std::optional<ShardTensor>(b.tensor()), same), target));
  }
  ASSERT_TRUE(w.grad().has_value());
  sgd.step();
}

/// Three steps of a 3-d Gray-Scott simulation on `mesh_shape`, sharding x and y unevenly.
void gray_scott_program(std::shared_ptr<Comm> world, std::vector<int> mesh_shape, Shape size) {
  DeviceMesh mesh(world, mesh_shape);
  sim::GrayScottConfig config;
  config.size = size;
  config.dtype = DType::f64;
  std::vector<Placement> placements;
  for (size_t m = 0; m < mesh_shape.size(); ++m)
    placements.push_back(Placement::shard(static_cast<int>(m)));
  sim::GrayScott simulation(mesh, placements, {}, config);
  for (int step = 0; step < 3; ++step) simulation.step();
}

// Every rank builds its halo plan's sends from its own transfers only (O(ranks) per plan):
// what rank r sends to q must be exactly what q's plan receives from r, box for box, in order.
TEST(Estimate, HaloPlanSendsMatchThePeersReceives) {
  struct Layout {
    std::vector<int> mesh;
    std::vector<Placement> placements;
    std::vector<std::vector<int64_t>> extents;
  };
  const std::vector<Layout> layouts{
      {{3, 2}, {Placement::shard(0), Placement::shard(1)}, {{5, 1, 4}, {2, 5}}},
      {{3, 2}, {Placement::shard(1), Placement::replicate()}, {{0, 3, 4}, {}}},
      {{2, 3}, {Placement::replicate(), Placement::shard(0)}, {{}, {6, 0, 4}}},
      {{6}, {Placement::shard(0)}, {{1, 1, 3, 0, 2, 3}}}};
  for (const Layout& layout : layouts) {
    for (BoundaryMode mode : {BoundaryMode::zero, BoundaryMode::periodic}) {
      const ShardSpec spec =
          ShardSpec::make({10, 7}, layout.mesh, layout.placements, layout.extents);
      const std::vector<Box> needed = grown_boxes(spec, {3, 1}, {2, 2});
      const int ranks = mesh_size(layout.mesh);
      std::vector<HaloPlan> plans;
      for (int rank = 0; rank < ranks; ++rank)
        plans.push_back(HaloPlan::build(spec, needed, {mode, mode}, rank));
      size_t messages = 0;
      for (const HaloPlan& plan : plans) messages += plan.sends().size();
      EXPECT_GT(messages, 0u) << spec.str();
      for (int from = 0; from < ranks; ++from) {
        for (int to = 0; to < ranks; ++to) {
          std::vector<std::string> sent, received;
          for (const HaloTransfer& t : plans[from].sends())
            if (t.peer == to) sent.push_back(t.owned_box.str() + t.haloed_box.str());
          for (const HaloTransfer& t : plans[to].recvs())
            if (t.peer == from) received.push_back(t.owned_box.str() + t.haloed_box.str());
          EXPECT_EQ(sent, received) << spec.str() << ": rank " << from << " to " << to;
        }
      }
    }
  }
}

TEST(Estimate, ConvForwardBackwardRecordsTheRealRunsMessages) {
  const estimate::Recording real = estimate::record_local(4, conv_program);
  const AllocatorStats before = host_allocator_stats();
  const int64_t opened = io::file_open_count();
  const estimate::Recording estimated = estimate::record(4, conv_program);
  const AllocatorStats after = host_allocator_stats();
  EXPECT_EQ(after.raw_allocations, before.raw_allocations) << "no tensor data was allocated";
  EXPECT_EQ(after.in_use, before.in_use);
  EXPECT_EQ(io::file_open_count(), opened) << "no file was opened";
  EXPECT_GT(count_category(real, "comm"), 0u);
  EXPECT_GT(count_category(real, "halo"), 0u);
  expect_same_events(real, estimated);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_GT(estimated.peak_bytes[rank], 0u);
    // The kernels' own temporaries are not counted in estimate mode: a lower bound.
    EXPECT_LE(estimated.peak_bytes[rank], real.peak_bytes[rank]) << "rank " << rank;
    std::printf("rank %d: peak tensor bytes estimated %zu, real %zu\n", rank,
                estimated.peak_bytes[rank], real.peak_bytes[rank]);
  }
}

// layer_norm's backward takes the forward's mean and rstd outputs: in estimate mode (shape-only
// outputs) it makes the same messages as the real run, without tensor data.
TEST(Estimate, LayerNormForwardBackwardRecordsTheRealRunsMessages) {
  const estimate::Recording real = estimate::record_local(4, layer_norm_program);
  const AllocatorStats before = host_allocator_stats();
  const estimate::Recording estimated = estimate::record(4, layer_norm_program);
  const AllocatorStats after = host_allocator_stats();
  EXPECT_EQ(after.raw_allocations, before.raw_allocations) << "no tensor data was allocated";
  EXPECT_GT(count_category(real, "comm"), 0u);
  expect_same_events(real, estimated);
}

// group_norm's backward takes the forward's mean and rstd outputs likewise.
TEST(Estimate, GroupNormForwardBackwardRecordsTheRealRunsMessages) {
  const estimate::Recording real = estimate::record_local(4, group_norm_program);
  const AllocatorStats before = host_allocator_stats();
  const estimate::Recording estimated = estimate::record(4, group_norm_program);
  const AllocatorStats after = host_allocator_stats();
  EXPECT_EQ(after.raw_allocations, before.raw_allocations) << "no tensor data was allocated";
  EXPECT_GT(count_category(real, "comm"), 0u);
  expect_same_events(real, estimated);
}

// max_pool's indices are i64 in estimate mode too (the rule names their dtype), so the op's
// recorded bytes are the real run's.
TEST(Estimate, MaxPoolForwardBackwardRecordsTheRealRunsMessagesAndBytes) {
  const estimate::Recording real = estimate::record_local(4, max_pool_program);
  const estimate::Recording estimated = estimate::record(4, max_pool_program);
  EXPECT_GT(count_category(real, "halo"), 0u);
  expect_same_events(real, estimated);
}

TEST(Estimate, ConvTrainingStepRecordsTheRealRunsMessages) {
  const auto program = [](std::shared_ptr<Comm> world) {
    conv_training_program(std::move(world), {2, 2}, 13, 10);
  };
  const estimate::Recording real = estimate::record_local(4, program);
  const estimate::Recording estimated = estimate::record(4, program);
  EXPECT_GT(count_category(real, "optimizer"), 0u);
  expect_same_events(real, estimated);
}

TEST(Estimate, GrayScottRecordsTheRealRunsMessagesAndPeakBytes) {
  const auto program = [](std::shared_ptr<Comm> world) {
    gray_scott_program(std::move(world), {2, 2}, {9, 7, 6});
  };
  const estimate::Recording real = estimate::record_local(4, program);
  const estimate::Recording estimated = estimate::record(4, program);
  expect_same_events(real, estimated);
  // The simulation's tensors are its haloed fields: the same bytes with and without data.
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_EQ(estimated.peak_bytes[rank], real.peak_bytes[rank]) << "rank " << rank;
  EXPECT_NE(estimated.json().find("\"peak_bytes_per_rank\": ["), std::string::npos);
}

// io::scatter in estimate mode: the root reads the dataset's metadata only and every slab travels
// as a null payload, so the messages are the real scatter's (several slabs per box: a staging
// budget of 512 bytes); a softmax over a sharded dim and its backward then run their kernels on
// the shape-only pieces, posting the statistics' all-gathers a real run sends.
TEST(Estimate, ScatterAndShardedSoftmaxRecordTheRealRunsMessagesWithoutData) {
  const std::string file = ::testing::TempDir() + "estimate_scatter_input.h5";
  Tensor values = Tensor::empty({11, 9, 3}, DType::f64);
  for (int64_t i = 0; i < values.numel(); ++i) values.data<double>()[i] = 0.01 * (i % 37);
  io::write_dataset(file, "x", values);
  const auto program = [&](std::shared_ptr<Comm> world) {
    DeviceMesh mesh(world, {2, 2});
    ShardTensor x = io::scatter(file, "x", mesh, {Placement::shard(0), Placement::shard(1)},
                                {{7, 4}, {2, 7}}, 0, 512);
    x.set_requires_grad();
    Tape tape;
    tape.backward(ops::sum(ops::softmax(x, 0)));  // dim 0 is sharded: statistics all-gathered
    ASSERT_TRUE(tape.grad(x).has_value());
  };
  const estimate::Recording real = estimate::record_local(4, program);
  const AllocatorStats before = host_allocator_stats();
  const estimate::Recording estimated = estimate::record(4, program);
  const AllocatorStats after = host_allocator_stats();
  EXPECT_EQ(after.raw_allocations, before.raw_allocations) << "no tensor data was allocated";
  EXPECT_EQ(after.in_use, before.in_use);
  size_t gathers = 0;
  for (const std::string& event : real.events[1])
    gathers += event.find("\"name\": \"all_gather_v\"") != std::string::npos;
  EXPECT_GE(gathers, 3u) << "softmax's max and sum forward, the sum backward";
  EXPECT_GT(count_category(real, "io"), 0u);
  expect_same_events(real, estimated);
  std::remove(file.c_str());
}

TEST(Estimate, TouchingDataOfAShapeOnlyTensorIsOneClearError) {
  try {
    estimate::record(2, [](std::shared_ptr<Comm>) {
      const Tensor t = Tensor::zeros({3, 4}, DType::f32);
      EXPECT_TRUE(t.is_shape_only());
      EXPECT_EQ(t.comm_data(), nullptr);
      (void)t.data<float>();
    });
    FAIL() << "expected an error";
  } catch (const NotAvailable& error) {
    EXPECT_NE(std::string(error.what()).find("[estimate]"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("touched tensor data"), std::string::npos)
        << error.what();
  }
}

TEST(Estimate, LaunchOfAnotherRankCountIsRefused) {
  estimate::RecordLaunches recording(8);
  EXPECT_THROW(launch(Backend::local, 4, [](std::shared_ptr<Comm>) {}), InvalidArgument);
}

// The simulated ranks share one parse of a model file (io::read_onnx in estimate mode) and so one
// read-only host copy of each initializer (shared_host_array, keyed by the parse's storage); a
// separate parse (a real run's rank) gets its own copy with the same values.
TEST(Estimate, SimulatedRanksShareOneCopyOfAModelsConstants) {
  const std::string file = std::string(TESSERA_FIXTURE_DIR) + "/onnx/traincnn.onnx";
  constexpr int kRanks = 4;
  std::vector<std::shared_ptr<const nn::onnx::HostArray>> arrays(kRanks);
  estimate::record(kRanks, [&](std::shared_ptr<Comm> comm) {
    const io::OnnxGraph graph = io::read_onnx(file);
    ASSERT_FALSE(graph.initializers.empty());
    arrays[comm->rank()] = nn::onnx::shared_host_array(graph.initializers.front().second);
  });
  for (int rank = 1; rank < kRanks; ++rank) EXPECT_EQ(arrays[rank].get(), arrays[0].get());
  const io::OnnxGraph own = io::read_onnx(file);
  const Tensor& initializer = own.initializers.front().second;
  const auto separate = nn::onnx::shared_host_array(initializer);
  EXPECT_NE(separate.get(), arrays[0].get());
  EXPECT_EQ(separate.get(), nn::onnx::shared_host_array(initializer).get());
  EXPECT_EQ(separate->shape, arrays[0]->shape);
  EXPECT_EQ(separate->values, arrays[0]->values);
  EXPECT_EQ(separate->values, nn::onnx::host_array(initializer).values);
}

TEST(Estimate, GrayScottOn1024RanksRecords) {
  const auto begin = std::chrono::steady_clock::now();
  const estimate::Recording estimated = estimate::record(1024, [](std::shared_ptr<Comm> world) {
    gray_scott_program(std::move(world), {16, 8, 8}, {64, 64, 64});
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  std::printf("P = 1024, Gray-Scott 64^3, 3 steps: recorded in %.2f s\n", seconds);
  ASSERT_EQ(estimated.ranks, 1024);
  for (int rank = 0; rank < 1024; ++rank) ASSERT_GT(estimated.events[rank].size(), 1u);
}

TEST(Estimate, ConvTrainingStepOn1024RanksRecords) {
  const auto begin = std::chrono::steady_clock::now();
  const estimate::Recording estimated = estimate::record(1024, [](std::shared_ptr<Comm> world) {
    conv_training_program(std::move(world), {32, 32}, 512, 512);
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  std::printf("P = 1024, conv training step on [2, 4, 512, 512]: recorded in %.2f s\n", seconds);
  ASSERT_EQ(estimated.ranks, 1024);
  for (int rank = 0; rank < 1024; ++rank) ASSERT_GT(estimated.events[rank].size(), 1u);
}

}  // namespace
}  // namespace tessera
