// `tessera train` and `tessera infer` with --device cuda on the ONNX fixtures (tests/fixtures/onnx,
// made by PyTorch; skipped, with the reason printed, when no GPU is visible). The programs run as
// a user runs them (the tessera binary, inputs in HDF5 files written here), in f64:
//  - train: the training fixture's four runs (SGD with momentum, Adam, AdamW with mse, Adam with
//    l1) give PyTorch's 10 losses within 1e-8 on one rank, and the first run does too on dp = 2
//    (DDP) and on a domain of 2 uneven pieces, ranks sharing the GPU;
//  - infer: every exported network (opsets 13 and 17) on its exported grid gives PyTorch's output
//    within 1e-10 on one rank and on a 2x2 mesh with uneven extents.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/gpu_runtime.hpp"
#include "io/hdf5/h5_file.hpp"
#include "tests/common/fixtures.hpp"

namespace tessera {
namespace {

using Json = nlohmann::json;

#define SKIP_WITHOUT_GPU()                                                                    \
  if (gpu::device_count() == 0)                                                               \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): train and infer on " \
                  "cuda need a GPU"

const std::string kFixtures = testing::fixture_dir("onnx");

/// A fresh scratch folder for one test, of this process alone (memcheck and racecheck run the
/// binary at the same time).
std::filesystem::path scratch(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("tessera_cli_gpu_" + name + "_" + std::to_string(static_cast<long>(::getpid())));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

/// Runs the tessera program with `args` (quoted for the shell); its output goes to `log`.
/// Returns the exit status.
int run_tessera(const std::vector<std::string>& args, const std::filesystem::path& log) {
  std::ostringstream command;
  command << "'" << TESSERA_CLI << "'";
  for (const std::string& arg : args) command << " '" << arg << "'";
  command << " >'" << log.string() << "' 2>&1";
  const int status = std::system(command.str().c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string text_of(const std::filesystem::path& file) {
  std::ifstream in(file);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// One fixture array as an f64 tensor ({"file", "shape"}).
Tensor fixture_array(const Json& entry) {
  return testing::read_fixture(kFixtures, entry["file"], entry["shape"].get<Shape>());
}

double max_abs_difference(const Tensor& a, const Tensor& b) {
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    worst = std::max(worst, std::fabs(a.data<double>()[i] - b.data<double>()[i]));
  return worst;
}

/// Uneven extents of `length` in 2: a third and the rest.
std::string uneven(int64_t length) {
  const int64_t first = std::max<int64_t>(length / 3, 1);
  return std::to_string(first) + "," + std::to_string(length - first);
}

TEST(CliGpu, TrainOnCudaGivesPyTorchsLossesInF64) {
  SKIP_WITHOUT_GPU();
  std::ifstream manifest(kFixtures + "training.json");
  ASSERT_TRUE(manifest) << kFixtures << "training.json";
  const Json fixture = Json::parse(manifest);
  const std::filesystem::path dir = scratch("train");
  const std::string data = (dir / "data.h5").string();
  io::write_dataset(data, "x", fixture_array(fixture["x"]));
  io::write_dataset(data, "y", fixture_array(fixture["y"]));
  const std::string model = kFixtures + fixture["model"].get<std::string>();

  struct Layout {
    std::string name;
    std::vector<std::string> args;
  };
  const int64_t height = fixture["x"]["shape"][2].get<int64_t>();
  const std::vector<Layout> layouts{
      {"1 rank", {"--ranks", "1"}},
      {"dp 2", {"--dp", "2"}},
      {"domain 2 uneven", {"--mesh", "2", "--shard-dims", "2", "--extents", uneven(height)}}};
  int compared = 0;
  for (const Json& run : fixture["runs"]) {
    const std::string name = run["name"];
    for (const Layout& layout : layouts) {
      // The other layouts with the first run only, as the cpu check does under a launcher.
      if (&run != &fixture["runs"][0] && layout.name != "1 rank") continue;
      const std::string losses = (dir / (name + ".losses.json")).string();
      std::vector<std::string> args{"train",
                                    "--model",
                                    model,
                                    "--data",
                                    data,
                                    "--input",
                                    "x",
                                    "--target",
                                    "y",
                                    "--dtype",
                                    "f64",
                                    "--device",
                                    "cuda",
                                    "--steps",
                                    std::to_string(fixture["steps"].get<int>()),
                                    "--batch",
                                    std::to_string(fixture["batch"].get<int>()),
                                    "--optimizer",
                                    run["optimizer"].get<std::string>(),
                                    "--loss",
                                    run["loss"].get<std::string>(),
                                    "--lr",
                                    fmt::format("{:.17g}", run["options"]["lr"].get<double>()),
                                    "--losses-out",
                                    losses};
      if (run["options"].contains("momentum"))
        args.insert(args.end(), {"--momentum",
                                 fmt::format("{:.17g}", run["options"]["momentum"].get<double>())});
      if (run["options"].contains("weight_decay"))
        args.insert(args.end(),
                    {"--weight-decay",
                     fmt::format("{:.17g}", run["options"]["weight_decay"].get<double>())});
      args.insert(args.end(), layout.args.begin(), layout.args.end());
      const std::filesystem::path log = dir / (name + ".log");
      ASSERT_EQ(run_tessera(args, log), 0) << name << " on " << layout.name << ":\n"
                                           << text_of(log);
      const Json got = Json::parse(text_of(losses));
      const Json& expected = run["losses"];
      ASSERT_EQ(got.size(), expected.size()) << name << " on " << layout.name;
      double worst = 0;
      for (size_t s = 0; s < expected.size(); ++s) {
        EXPECT_EQ(got[s]["step"], expected[s]["step"]);
        worst = std::max(
            worst, std::fabs(got[s]["loss"].get<double>() - expected[s]["loss"].get<double>()));
      }
      EXPECT_LT(worst, 1e-8) << name << " on " << layout.name
                             << ": the losses differ from PyTorch's";
      ++compared;
    }
  }
  EXPECT_EQ(compared, static_cast<int>(fixture["runs"].size()) + 2);
}

TEST(CliGpu, InferOnCudaGivesPyTorchsOutputInF64) {
  SKIP_WITHOUT_GPU();
  const Json manifest = testing::read_manifest(kFixtures);
  const std::filesystem::path dir = scratch("infer");
  int compared = 0;
  for (const Json& c : manifest["cases"]) {
    const Json& grid = c["grids"][0];
    const std::string name = c["name"];
    const std::string input = (dir / (name + ".in.h5")).string();
    io::write_dataset(input, "x", fixture_array(grid["inputs"][0]));
    const Tensor expected = fixture_array(grid["outputs"][0]);
    const Shape x_shape = grid["inputs"][0]["shape"].get<Shape>();
    const std::vector<int> dims = c["shard_dims"].get<std::vector<int>>();
    const std::vector<std::vector<std::string>> layouts{
        {"--mesh", "1", "--ranks", "1"},
        {"--mesh", "2x2", "--shard-dims", std::to_string(dims[0]) + "," + std::to_string(dims[1]),
         "--extents", uneven(x_shape[dims[0]]) + ";" + uneven(x_shape[dims[1]])}};
    for (size_t l = 0; l < layouts.size(); ++l) {
      const std::string output = (dir / (name + "." + std::to_string(l) + ".out.h5")).string();
      std::vector<std::string> args{
          "infer",    "--model", kFixtures + c["model"].get<std::string>(),
          "--in",     input,     "--out",
          output,     "--dtype", "f64",
          "--device", "cuda"};
      args.insert(args.end(), layouts[l].begin(), layouts[l].end());
      const std::filesystem::path log = dir / (name + ".log");
      ASSERT_EQ(run_tessera(args, log), 0) << name << " layout " << l << ":\n" << text_of(log);
      const Tensor y = io::read_dataset(output, "y").to_dtype(DType::f64);
      ASSERT_EQ(y.shape(), expected.shape()) << name << " layout " << l;
      EXPECT_LT(max_abs_difference(y, expected), 1e-10)
          << name << " layout " << l << ": y differs from PyTorch's";
      ++compared;
    }
  }
  EXPECT_EQ(compared, 2 * static_cast<int>(manifest["cases"].size()));
}

}  // namespace
}  // namespace tessera
