// `tessera infer --model M.onnx --in IN.h5 --out OUT.h5`: a network exported from PyTorch
// (nn::OnnxModel) run sharded on HDF5 data. Inputs come from the datasets named after the graph's
// inputs, outputs go to datasets named after its outputs. The first input is sharded by
// --shard-dims/--extents (default: its last mesh.ndim() dims, the spatial dims of a conv net);
// inputs of its shape take its layout, others are replicated. Every rank reads its own box of
// each input and writes its own box of each output (io::read_sharded, io::write_sharded), so no
// rank ever holds a whole tensor. Bad options, a bad model file and missing datasets give one
// line and exit code 2 on every rank.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "apps/tessera/run_op_common.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/tessera.hpp"
#include "core/trace.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"
#include "io/output_path.hpp"
#include "ops/nn/onnx_model.hpp"

namespace tessera::cli {

namespace {

struct InferOptions {
  std::string model, in, out;
  MeshOptions layout;
  std::string device = "cpu", dtype = "f32";
  bool json = false;
};

/// Rank 0 checks that the input file holds every graph input and reads their shapes; every rank
/// gets them.
std::vector<Shape> survey_inputs(Comm& world, const nn::OnnxModel& model, const std::string& file) {
  const std::vector<io::OnnxValue>& inputs = model.inputs();
  std::vector<Shape> shapes(inputs.size());
  std::optional<std::string> problem;
  if (world.rank() == 0) {
    try {
      check_arg(std::filesystem::exists(file), "infer", "input file {} does not exist", file);
      for (size_t i = 0; i < inputs.size(); ++i) {
        check_arg(io::has_dataset(file, inputs[i].name), "infer",
                  "{} has no dataset '{}' (the model's input '{}')", file, inputs[i].name,
                  inputs[i].name);
        shapes[i] = io::dataset_info(file, inputs[i].name).shape;
        check_arg(inputs[i].shape.empty() || shapes[i].size() == inputs[i].shape.size(), "infer",
                  "dataset '{}' of {} has shape {}, the model's input '{}' is {}-d", inputs[i].name,
                  file, shapes[i], inputs[i].name, inputs[i].shape.size());
      }
    } catch (const Error& error) {
      problem = untagged(error);
    }
  }
  agree_on_error(world, "infer", problem);
  std::vector<int64_t> ranks;
  for (const Shape& shape : shapes) ranks.push_back(static_cast<int64_t>(shape.size()));
  world.broadcast(ranks.data(), ranks.size(), DType::i64, 0);
  std::vector<int64_t> dims;
  for (size_t i = 0; i < shapes.size(); ++i) {
    shapes[i].resize(static_cast<size_t>(ranks[i]));
    dims.insert(dims.end(), shapes[i].begin(), shapes[i].end());
  }
  world.broadcast(dims.data(), dims.size(), DType::i64, 0);
  size_t next = 0;
  for (Shape& shape : shapes)
    for (int64_t& extent : shape) extent = dims[next++];
  return shapes;
}

void run_infer(std::shared_ptr<Comm> world, const InferOptions& options) {
  std::vector<int> mesh_shape;
  DType dtype = DType::f32;
  agreed_everywhere(*world, "infer", [&] {
    mesh_shape = parse_mesh(options.layout.mesh);
    check_arg(options.dtype == "f32" || options.dtype == "f64", "infer",
              "--dtype {} (expected f32 or f64)", options.dtype);
    dtype = dtype_from_name(options.dtype);
    check_arg(mesh_size(mesh_shape) == world->size(), "infer",
              "--mesh {} has {} ranks, the run has {} (--ranks or mpiexec -n)", options.layout.mesh,
              mesh_size(mesh_shape), world->size());
    io::check_output_is_not_input("infer", options.in, options.out);
    io::check_output_is_not_input("infer", options.model, options.out);
    if (world->rank() == 0) io::check_output_path("infer", options.out);
  });
  DeviceMesh mesh(world, mesh_shape);
  // Every rank reads and builds the model; a bad file is the same error everywhere (tagged onnx:
  // the message names the file or the node).
  std::optional<nn::OnnxModel> model;
  agreed_everywhere(*world, "onnx",
                    [&] { model.emplace(nn::OnnxModel::load(options.model, mesh, dtype)); });
  const std::vector<Shape> shapes = survey_inputs(*world, *model, options.in);

  const Shape& first = shapes[0];
  const int64_t ndim = static_cast<int64_t>(first.size());
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  const bool single =
      mesh.size() == 1 && options.layout.shard_dims.empty() && options.layout.extents.empty();
  const auto [placements, extents] =
      single ? RunOpLayout{replicated, {}}
             : run_op_layout(mesh, options.layout.shard_dims, options.layout.extents, ndim, ndim,
                             "infer");

  const double start = now_seconds();
  std::map<std::string, ShardTensor> inputs, outputs;
  std::optional<trace::Span> step_span(std::in_place, "step", "infer");
  // The ops agree on what only some ranks could see; errors of the graph itself (a shape that
  // does not fit a node) are met by every rank alike and printed once.
  agreed_everywhere(*world, "infer", [&] {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const bool like_first = shapes[i] == first;
      inputs.emplace(
          model->inputs()[i].name,
          io::read_sharded(options.in, model->inputs()[i].name, mesh,
                           like_first ? placements : replicated,
                           like_first ? extents : std::vector<std::vector<int64_t>>{}, dtype));
    }
    outputs = model->forward(inputs);
  });
  step_span.reset();
  double seconds = now_seconds() - start;
  // The slowest rank's time is the run's (every rank has the same options).
  if (options.json) world->all_reduce(&seconds, &seconds, 1, DType::f64, ReduceOp::max);

  // The outputs are the only datasets of --out: an old file is removed first, then every rank
  // writes its own boxes (each write_sharded replaces the file atomically, keeping the datasets
  // written before it).
  // Estimate mode writes nothing (the writes below are io events), so removes nothing either.
  if (world->rank() == 0 && !estimate::active()) std::filesystem::remove(options.out);
  world->barrier();
  std::vector<std::string> written;
  for (const io::OnnxValue& output : model->outputs()) {
    const ShardTensor& y = outputs.at(output.name);
    io::write_sharded(y, options.out, output.name);
    written.push_back(fmt::format("{} {}", output.name, y.global_shape()));
  }
  if (world->rank() != 0) return;
  if (options.json) {
    const nlohmann::json summary = {{"command", "infer"},     {"model", options.model},
                                    {"mesh", mesh_shape},     {"backend", world->backend()},
                                    {"ranks", world->size()}, {"outputs", written},
                                    {"out", options.out},     {"step_seconds", seconds}};
    fmt::print("{}\n", summary.dump());
    return;
  }
  fmt::print("infer: {} {} {} -> {} on mesh {} ({}), {} backend, {:.3f} ms; {} {}\n", options.model,
             model->inputs()[0].name, first, fmt::join(written, ", "), mesh_shape,
             inputs.begin()->second.spec().str(), world->backend(), seconds * 1e3,
             estimate::active() ? "would write" : "wrote", options.out);
}

}  // namespace

void register_infer(CLI::App& app) {
  auto options = std::make_shared<InferOptions>();
  auto* command = app.add_subcommand(
      "infer", "Run a network exported from PyTorch (ONNX, opset 13-17) sharded on HDF5 data");
  command->add_option("--model", options->model, "The ONNX model file (torch.onnx.export)")
      ->required();
  command
      ->add_option("--in", options->in, "Input file: one dataset per graph input, named after it")
      ->required();
  command
      ->add_option("--out", options->out,
                   "Output file: one dataset per graph output, named after it; not the --in file")
      ->required();
  add_mesh_options(*command, options->layout, "2,3");
  command->add_option("--dtype", options->dtype, "f32 or f64: the model's parameters and data")
      ->capture_default_str();
  command->add_option("--device", options->device, "cpu, cuda or cuda:N")->capture_default_str();
  command->add_flag("--json", options->json,
                    "Print one JSON object at the end (step_seconds: read and forward, slowest "
                    "rank)");
  add_trace_option(*command);
  command->callback([options] {
    select_device(options->device);
    launch(backend_from_env(), options->layout.local_ranks(),
           [&](std::shared_ptr<Comm> world) { run_infer(world, *options); });
  });
}

}  // namespace tessera::cli
