// Tests of apps/plot: the slice plan, size/index/axis parsing, the JSON readers, the scaling
// formulas and the mesh layout as plain functions; and each plot drawn to a PNG read back with
// libpng: the asked size, more than one colour, and no file (nor temporary) left on bad input.
// The drawing tests skip, saying why, in a build without PLplot.
#include "apps/plot/plot.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/config.hpp"
#include "core/layout.hpp"
#include "core/tensor.hpp"
#include "io/hdf5/h5_file.hpp"
#include "tests/plot/png_reader.hpp"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using test::read_png;

#define SKIP_WITHOUT_PLPLOT() \
  if (!plot::available()) GTEST_SKIP() << "built without PLplot: nothing is drawn"

/// A per-test scratch directory, removed at the end.
class Plot : public testing::Test {
 protected:
  void SetUp() override {
    const auto* test = testing::UnitTest::GetInstance()->current_test_info();
    directory_ = fs::temp_directory_path() / ("tessera_plot_" + std::to_string(getpid()) + "_" +
                                              test->test_suite_name() + "_" + test->name());
    fs::remove_all(directory_);
    fs::create_directories(directory_);
  }
  void TearDown() override {
    std::error_code error;
    fs::remove_all(directory_, error);
  }
  std::string path(const std::string& name) const { return (directory_ / name).string(); }
  /// The names of the files in the scratch directory.
  std::vector<std::string> files() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(directory_))
      names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  void write_text(const std::string& name, const std::string& text) const {
    std::ofstream(path(name)) << text;
  }

 private:
  fs::path directory_;
};

/// Runs `call`, expecting InvalidArgument whose message contains `needle`.
template <typename Call>
void expect_error(Call call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
  }
}

/// A [T, C, X, Y, Z] f32 dataset whose values vary along every dim.
void write_field(const std::string& file, const Shape& shape) {
  Tensor field = Tensor::empty(shape, DType::f32);
  float* data = field.data<float>();
  for (int64_t i = 0; i < field.numel(); ++i)
    data[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)) + 0.001 * i);
  io::write_dataset(file, "/snapshots", field);
}

// ---- parsing and plans ------------------------------------------------------------------------

TEST(PlotParse, SizeAcceptsWxHAndNamesTheOptionOtherwise) {
  const plot::ImageSize size = plot::parse_size("640x480");
  EXPECT_EQ(size.width, 640);
  EXPECT_EQ(size.height, 480);
  for (const char* bad : {"640", "640x", "x480", "0x480", "640x99", "9000x100", "axb", "64.5x100"})
    expect_error([&] { plot::parse_size(bad); }, "--size");
}

TEST(PlotParse, AxisIndexAndColormapNamesAreChecked) {
  EXPECT_EQ(plot::parse_axis("x"), 0);
  EXPECT_EQ(plot::parse_axis("2"), 2);
  expect_error([] { plot::parse_axis("w"); }, "--axis");
  EXPECT_EQ(plot::parse_index("-1,1"), (std::vector<int64_t>{-1, 1}));
  EXPECT_TRUE(plot::parse_index("").empty());
  expect_error([] { plot::parse_index("1,a"); }, "--index");
  for (const std::string& name : plot::colormap_names())
    EXPECT_GE(plot::colormap_stops(name).size(), 2u) << name;
  expect_error([] { plot::colormap_stops("jet"); }, "--cmap");
}

TEST(PlotSlicePlan, PicksThePlaneAtTheFractionAlongTheAxis) {
  const Shape shape{4, 2, 8, 6, 5};
  plot::SliceSpec spec;
  spec.index = {-1, 1};
  spec.axis = 2;
  spec.at = 0.5;
  plot::SlicePlan plan = plot::plan_slice(shape, spec);
  EXPECT_EQ(plan.box.lo, (Shape{3, 1, 0, 0, 2}));  // floor(0.5 * 5) = 2
  EXPECT_EQ(plan.box.hi, (Shape{4, 2, 8, 6, 3}));
  EXPECT_EQ(plan.index, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(plan.columns, 8);  // x along the image's x axis
  EXPECT_EQ(plan.rows, 6);
  spec.at = 1.0;  // the last plane, not one past it
  EXPECT_EQ(plot::plan_slice(shape, spec).position, 4);
  spec.axis = 0;
  spec.at = 0;
  plan = plot::plan_slice(shape, spec);
  EXPECT_EQ(plan.box.lo, (Shape{3, 1, 0, 0, 0}));
  EXPECT_EQ(plan.box.hi, (Shape{4, 2, 1, 6, 5}));
  EXPECT_EQ(plan.horizontal, 1);
  EXPECT_EQ(plan.vertical, 2);
  // [X, Y, Z] takes no index, [C, X, Y, Z] one.
  plot::SliceSpec bare;
  EXPECT_EQ(plot::plan_slice({8, 6, 5}, bare).box.volume(), 8 * 6);
  bare.index = {1};
  EXPECT_EQ(plot::plan_slice({2, 8, 6, 5}, bare).box.lo, (Shape{1, 0, 0, 2}));
}

TEST(PlotSlicePlan, RejectsBadIndexAtAndShapes) {
  plot::SliceSpec spec;
  spec.index = {4, 0};
  expect_error([&] { plot::plan_slice({4, 2, 3, 3, 3}, spec); }, "--index");
  spec.index = {-5, 0};
  expect_error([&] { plot::plan_slice({4, 2, 3, 3, 3}, spec); }, "--index");
  spec.index = {0};
  expect_error([&] { plot::plan_slice({4, 2, 3, 3, 3}, spec); }, "--index");
  spec.index = {0, 0};
  for (double at : {-0.1, 1.5, std::nan("")}) {
    spec.at = at;
    expect_error([&] { plot::plan_slice({4, 2, 3, 3, 3}, spec); }, "--at");
  }
  spec.at = 0.5;
  expect_error([&] { plot::plan_slice({3, 3}, spec); }, "expected [T, C, X, Y, Z]");
  expect_error([&] { plot::plan_slice({1, 4, 2, 3, 3, 3}, spec); }, "expected [T, C, X, Y, Z]");
}

// ---- JSON readers and scaling formulas -----------------------------------------------------

TEST_F(Plot, LossesReadStepAndLossAndNameTheBadEntry) {
  write_text("run_a.json", R"([{"step": 1, "loss": 2.5}, {"step": 2, "loss": 1.25, "lr": 0.1}])");
  const plot::LossCurve curve = plot::read_losses(path("run_a.json"));
  EXPECT_EQ(curve.label, "run_a");
  EXPECT_EQ(curve.step, (std::vector<double>{1, 2}));
  EXPECT_EQ(curve.loss, (std::vector<double>{2.5, 1.25}));
  write_text("broken.json", R"([{"step": 1, "loss": 2.5},)");
  expect_error([&] { plot::read_losses(path("broken.json")); }, "malformed JSON");
  write_text("no_loss.json", R"([{"step": 1, "loss": 2.5}, {"step": 2}])");
  expect_error([&] { plot::read_losses(path("no_loss.json")); }, "entry 1");
  expect_error([&] { plot::read_losses(path("missing.json")); }, "no such file");
}

TEST(PlotScaling, EfficiencyIsPerRankThroughputForStrongAndWeakScaling) {
  const plot::ScalingPoint base{1, 8.0, 1000};
  // Strong: the same work on 4 ranks in a quarter of the time is perfect, in half is 0.5.
  EXPECT_DOUBLE_EQ(plot::efficiency(base, {4, 2.0, 1000}), 1.0);
  EXPECT_DOUBLE_EQ(plot::efficiency(base, {4, 4.0, 1000}), 0.5);
  EXPECT_DOUBLE_EQ(plot::ideal_seconds(base, {4, 4.0, 1000}), 2.0);
  // Weak: 4x the work on 4 ranks in the same time is perfect.
  EXPECT_DOUBLE_EQ(plot::efficiency(base, {4, 8.0, 4000}), 1.0);
  EXPECT_DOUBLE_EQ(plot::efficiency(base, {4, 10.0, 4000}), 0.8);
  EXPECT_DOUBLE_EQ(plot::ideal_seconds(base, {4, 10.0, 4000}), 8.0);
}

TEST_F(Plot, ScalingReadsListsSimulateLinesAndBenchDocuments) {
  write_text("list.json",
             R"([{"ranks": 2, "step_seconds": 0.5}, {"ranks": 1, "step_seconds": 0.9},
                 {"ranks": 1, "step_seconds": 1.0}, {"ranks": 4, "step_seconds": 0.3}])");
  auto series = plot::read_scaling(path("list.json"));
  ASSERT_EQ(series.size(), 1u);
  ASSERT_EQ(series[0].points.size(), 3u);  // ordered by ranks; the faster of repeats kept
  EXPECT_EQ(series[0].points[0].ranks, 1);
  EXPECT_DOUBLE_EQ(series[0].points[0].seconds, 0.9);
  EXPECT_EQ(series[0].points[2].ranks, 4);

  // `tessera simulate --json` appended run after run: one object per line; work from "size".
  write_text("simulate.json",
             "{\"command\": \"simulate gray-scott\", \"size\": [64, 64, 64], \"ranks\": 1, "
             "\"dtype\": \"f32\", \"step_seconds\": 0.02}\n"
             "{\"command\": \"simulate gray-scott\", \"size\": [128, 64, 64], \"ranks\": 2, "
             "\"dtype\": \"f32\", \"step_seconds\": 0.025}\n");
  series = plot::read_scaling(path("simulate.json"));
  ASSERT_EQ(series.size(), 1u);
  ASSERT_EQ(series[0].points.size(), 2u);
  EXPECT_DOUBLE_EQ(series[0].points[1].work, 128.0 * 64 * 64);
  EXPECT_DOUBLE_EQ(plot::efficiency(series[0].points[0], series[0].points[1]), 0.8);

  // A bench document: rows grouped by their configuration, milliseconds converted.
  write_text("bench.json", R"({"benchmark": "conv", "device": "cpu", "rows": [
      {"shape": [1, 4, 32, 32, 32], "ranks": 1, "forward_backward_ms": 40.0, "forward_ms": 9},
      {"shape": [1, 4, 32, 32, 32], "ranks": 2, "forward_backward_ms": 25.0, "forward_ms": 6},
      {"shape": [1, 4, 64, 32, 32], "ranks": 1, "forward_backward_ms": 90.0, "forward_ms": 20}]})");
  series = plot::read_scaling(path("bench.json"));
  ASSERT_EQ(series.size(), 2u);
  EXPECT_EQ(series[0].label, "conv 1x4x32x32x32");
  EXPECT_DOUBLE_EQ(series[0].points[1].seconds, 0.025);
  series = plot::read_scaling(path("bench.json"), "forward_ms");
  EXPECT_DOUBLE_EQ(series[0].points[1].seconds, 0.006);
  expect_error([&] { plot::read_scaling(path("bench.json"), "forward"); }, "--time");

  write_text("empty.json", R"({"benchmark": "io", "rows": []})");
  expect_error([&] { plot::read_scaling(path("empty.json")); }, "no measurements");
  write_text("zero.json", R"([{"ranks": 1, "step_seconds": 0}])");
  expect_error([&] { plot::read_scaling(path("zero.json")); }, "measurement 0");
  write_text("bad.json", "{\"ranks\": 1,");
  expect_error([&] { plot::read_scaling(path("bad.json")); }, "malformed JSON");
}

// ---- mesh layout ------------------------------------------------------------------------------

TEST(PlotMeshLayout, RanksAreRowMajorNestedAndDisjoint) {
  const std::vector<int> shape{2, 2, 2, 2};
  const plot::MeshLayout layout = plot::layout_mesh(shape);
  ASSERT_EQ(layout.ranks.size(), 16u);
  EXPECT_EQ(layout.groups.size(), 2u + 4u + 8u);  // frames of every dim but the innermost
  for (int rank = 0; rank < 16; ++rank) {
    const plot::MeshRankBox& box = layout.ranks[rank];
    EXPECT_EQ(box.rank, rank);
    EXPECT_EQ(box.coordinate, coord_of(rank, shape));
    EXPECT_GE(box.x0, 0);
    EXPECT_LE(box.x1, 1);
    EXPECT_GE(box.y0, 0);
    EXPECT_LE(box.y1, 1);
    EXPECT_LT(box.x0, box.x1);
    EXPECT_LT(box.y0, box.y1);
    for (int other = 0; other < rank; ++other) {
      const plot::MeshRankBox& b = layout.ranks[other];
      const bool apart = box.x1 <= b.x0 || b.x1 <= box.x0 || box.y1 <= b.y0 || b.y1 <= box.y0;
      EXPECT_TRUE(apart) << "ranks " << rank << " and " << other << " overlap";
    }
    // Inside the frame of each of its outer coordinates.
    for (const plot::MeshGroupBox& group : layout.groups) {
      const bool member = [&] {
        // The group's coordinates are those of the ranks drawn inside it: check by position.
        return group.x0 <= box.x0 && box.x1 <= group.x1 && group.y0 <= box.y0 && box.y1 <= group.y1;
      }();
      if (member) {
        EXPECT_EQ(box.coordinate[group.dim], group.index);
      }
    }
  }
  // Neighbours along the innermost dim sit side by side, along the one before it one above the
  // other.
  EXPECT_DOUBLE_EQ(layout.ranks[0].y0, layout.ranks[1].y0);
  EXPECT_LT(layout.ranks[0].x1, layout.ranks[1].x0);
  EXPECT_DOUBLE_EQ(layout.ranks[0].x0, layout.ranks[2].x0);
  EXPECT_LT(layout.ranks[0].y1, layout.ranks[2].y0);
}

TEST(PlotMeshLayout, ShapesOfOneToFourDimsParseAndOthersAreRefused) {
  EXPECT_EQ(plot::parse_mesh_shape("4"), (std::vector<int>{4}));
  EXPECT_EQ(plot::parse_mesh_shape("2x3x1"), (std::vector<int>{2, 3, 1}));
  EXPECT_EQ(plot::layout_mesh({3}).ranks.size(), 3u);
  EXPECT_EQ(plot::layout_mesh({2, 3, 1}).ranks.size(), 6u);
  for (const char* bad : {"", "2x", "2x0", "2x2x2x2x2", "a", "16x32"})
    expect_error([&] { plot::parse_mesh_shape(bad); }, "--shape");
}

// ---- drawing --------------------------------------------------------------------------------

TEST_F(Plot, SliceHasTheAskedSizeAndManyColours) {
  SKIP_WITHOUT_PLPLOT();
  if (!TESSERA_HAVE_HDF5) GTEST_SKIP() << "built without HDF5";
  write_field(path("run.h5"), {3, 2, 16, 12, 10});
  plot::SliceSpec spec;
  spec.index = {-1, 1};
  plot::SliceStyle style;
  style.size = {640, 480};
  plot::plot_slice(path("run.h5"), "/snapshots", spec, style, path("slice.png"));
  const test::PngImage image = read_png(path("slice.png"));
  EXPECT_EQ(image.width, 640);
  EXPECT_EQ(image.height, 480);
  // A colormap over 16 x 12 varying cells and a colorbar: far more than a handful of colours.
  EXPECT_GT(image.distinct_colours(), 50u);
  EXPECT_EQ(files(), (std::vector<std::string>{"run.h5", "slice.png"}));  // no temporary left
}

TEST_F(Plot, SliceBadInputLeavesNoFile) {
  SKIP_WITHOUT_PLPLOT();
  if (!TESSERA_HAVE_HDF5) GTEST_SKIP() << "built without HDF5";
  write_field(path("run.h5"), {2, 2, 6, 5, 4});
  plot::SliceSpec spec;
  spec.index = {2, 0};
  const std::string out = path("slice.png");
  expect_error([&] { plot::plot_slice(path("run.h5"), "/snapshots", spec, {}, out); }, "--index");
  spec.index = {0, 0};
  expect_error([&] { plot::plot_slice(path("run.h5"), "/missing", spec, {}, out); }, "/missing");
  expect_error([&] { plot::plot_slice(path("none.h5"), "/snapshots", spec, {}, out); }, "none.h5");
  plot::SliceStyle style;
  style.vmin = 2;
  style.vmax = 1;
  expect_error([&] { plot::plot_slice(path("run.h5"), "/snapshots", spec, style, out); }, "--vmin");
  expect_error(
      [&] { plot::plot_slice(path("run.h5"), "/snapshots", spec, {}, path("no/such/dir.png")); },
      "--out");
  EXPECT_EQ(files(), (std::vector<std::string>{"run.h5"}));
}

TEST_F(Plot, LossesOverlayHasTheAskedSize) {
  SKIP_WITHOUT_PLPLOT();
  plot::LossCurve a{"a", {}, {}}, b{"b", {}, {}};
  for (int step = 1; step <= 50; ++step) {
    a.step.push_back(step);
    a.loss.push_back(std::exp(-0.1 * step));
    b.step.push_back(step);
    b.loss.push_back(2 * std::exp(-0.05 * step));
  }
  plot::plot_losses({a, b}, {700, 400}, path("loss.png"));
  const test::PngImage image = read_png(path("loss.png"));
  EXPECT_EQ(image.width, 700);
  EXPECT_EQ(image.height, 400);
  EXPECT_GT(image.distinct_colours(), 3u);  // background, text, two curve colours at least
  // train --plot DIR: DIR/loss.png, the directory created.
  const std::string written = plot::write_loss_plot(path("plots"), a);
  EXPECT_EQ(written, path("plots/loss.png"));
  EXPECT_GT(read_png(written).distinct_colours(), 2u);
}

TEST_F(Plot, ScalingPanelsHaveTheAskedSize) {
  SKIP_WITHOUT_PLPLOT();
  plot::ScalingSeries strong{"strong", {{1, 1.0, 1}, {2, 0.55, 1}, {4, 0.3, 1}, {8, 0.2, 1}}};
  plot::ScalingSeries weak{"weak", {{1, 1.0, 1}, {2, 1.1, 2}, {4, 1.2, 4}}};
  plot::plot_scaling({strong, weak}, {1000, 420}, path("scaling.png"));
  const test::PngImage image = read_png(path("scaling.png"));
  EXPECT_EQ(image.width, 1000);
  EXPECT_EQ(image.height, 420);
  EXPECT_GT(image.distinct_colours(), 3u);
}

TEST_F(Plot, MeshPictureHasTheAskedSize) {
  SKIP_WITHOUT_PLPLOT();
  plot::plot_mesh({2, 2, 2, 2}, {"pp", "dp", "tp", "domain"}, {900, 650}, path("mesh.png"));
  const test::PngImage image = read_png(path("mesh.png"));
  EXPECT_EQ(image.width, 900);
  EXPECT_EQ(image.height, 650);
  EXPECT_GT(image.distinct_colours(), 5u);  // a tint and an edge colour per dim, text
  expect_error([&] { plot::plot_mesh({2, 2}, {"a"}, {}, path("bad.png")); }, "--names");
  EXPECT_FALSE(fs::exists(path("bad.png")));
}

TEST(PlotUnavailable, RefusedWithOneErrorWithoutPlplot) {
  if (plot::available()) GTEST_SKIP() << "built with PLplot";
  try {
    plot::check_available();
    ADD_FAILURE() << "no error";
  } catch (const NotAvailable& error) {
    EXPECT_NE(std::string(error.what()).find("built without plotting (PLplot)"), std::string::npos);
  }
}

}  // namespace
}  // namespace tessera
