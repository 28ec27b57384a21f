// `tessera run-op conv`: runs the sharded convolution on a user's data from an HDF5 file and
// writes the gathered results (y, and with --backward gx, gw, gb) to another. Rank 0 reads the
// inputs and scatters x; bad arguments give one line and exit code 2 on every rank.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <sstream>

#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "apps/tessera/run_op_common.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/tessera.hpp"
#include "io/hdf5/h5_file.hpp"
#include "ops/ops.hpp"

namespace tessera::cli {

namespace {

struct ConvRunOptions {
  std::string in, out;
  std::string stride = "1", padding = "0", dilation = "1", padding_mode = "zeros";
  int64_t groups = 1;
  MeshOptions layout;
  bool backward = false;
  std::string device = "cpu", dtype = "f64";
  std::string shapes;  // estimate mode: the inputs' shapes instead of reading --in
};

/// The inputs as read on rank 0.
struct ConvInputs {
  Tensor x, w, b, gy;
  bool has_bias = false;
};

/// Estimate mode (docs/scaling.md) with --shapes opens no file: the inputs are shape-only tensors
/// of the shapes it gives, "x=2,3,64,64;w=8,3,3,3[;b=8][;gy=2,8,64,64]".
ConvInputs shape_only_inputs(const ConvRunOptions& options, DType dtype) {
  ConvInputs inputs;
  std::stringstream entries(options.shapes);
  std::string entry;
  while (std::getline(entries, entry, ';')) {
    const size_t equals = entry.find('=');
    check_arg(equals != std::string::npos, "run-op", "--shapes entry '{}' (expected NAME=D0,D1,..)",
              entry);
    const std::string name = entry.substr(0, equals);
    Shape shape;
    for (int64_t extent : parse_list(entry.substr(equals + 1))) shape.push_back(extent);
    Tensor* target = name == "x"    ? &inputs.x
                     : name == "w"  ? &inputs.w
                     : name == "b"  ? &inputs.b
                     : name == "gy" ? &inputs.gy
                                    : nullptr;
    check_arg(target != nullptr, "run-op", "--shapes names '{}' (expected x, w, b or gy)", name);
    *target = Tensor::empty(shape, dtype);
    inputs.has_bias = inputs.has_bias || name == "b";
  }
  check_arg(inputs.x.ndim() >= 3 && inputs.x.ndim() <= 5 && inputs.w.ndim() == inputs.x.ndim(),
            "run-op",
            "--shapes gives x {} and w {}; conv needs x [N, C, spatial..] and w [Cout, "
            "C/groups, k..] of the same rank",
            inputs.x.shape(), inputs.w.shape());
  check_arg(!options.backward || inputs.gy.ndim() == inputs.x.ndim(), "run-op",
            "--backward needs gy's shape in --shapes");
  return inputs;
}

ConvInputs read_inputs(const ConvRunOptions& options, DType dtype) {
  // Estimate mode reads --in's metadata only (read_dataset returns shape-only tensors); --shapes
  // stands in for a file that does not exist.
  if (estimate::active() && !options.shapes.empty()) return shape_only_inputs(options, dtype);
  ConvInputs inputs;
  check_arg(std::filesystem::exists(options.in), "run-op", "input file {} does not exist",
            options.in);
  for (const char* name : {"x", "w"})
    check_arg(io::has_dataset(options.in, name), "run-op",
              "{} has no dataset '{}' (conv needs x [N, C, spatial..] and w [Cout, C/groups, k..])",
              options.in, name);
  inputs.x = io::read_dataset(options.in, "x", dtype);
  check_arg(inputs.x.ndim() >= 3 && inputs.x.ndim() <= 5, "run-op",
            "x has shape {}; conv needs x [N, C, spatial..] with 1 to 3 spatial dims",
            inputs.x.shape());
  inputs.w = io::read_dataset(options.in, "w", dtype);
  inputs.has_bias = io::has_dataset(options.in, "b");
  if (inputs.has_bias) inputs.b = io::read_dataset(options.in, "b", dtype);
  if (options.backward) {
    check_arg(io::has_dataset(options.in, "gy"), "run-op",
              "--backward needs a dataset 'gy' (the gradient of y) in {}", options.in);
    inputs.gy = io::read_dataset(options.in, "gy", dtype);
  }
  return inputs;
}

ops::ConvOptions conv_options(const ConvRunOptions& options) {
  ops::ConvOptions conv;
  conv.stride = parse_list(options.stride);
  conv.dilation = parse_list(options.dilation);
  if (options.padding == "same" || options.padding == "valid")
    conv.padding_name = options.padding;
  else
    conv.padding = parse_list(options.padding);
  conv.groups = options.groups;
  conv.padding_mode = options.padding_mode;
  return conv;
}

void run_conv(std::shared_ptr<Comm> world, const ConvRunOptions& options) {
  const std::vector<int> mesh_shape = parse_mesh(options.layout.mesh);
  DeviceMesh mesh(world, mesh_shape);
  const DType dtype = dtype_from_name(options.dtype);
  if (dtype != DType::f32 && dtype != DType::f64)
    throw AgreedError("run-op", fmt::format("--dtype {} (conv runs in f32 or f64)", options.dtype));
  const bool root = world->rank() == 0;
  check_run_op_files(*world, options.in, options.out);

  ConvInputs inputs;
  read_on_root(*world, [&] { inputs = read_inputs(options, dtype); });
  int64_t header[3] = {inputs.x.ndim(), inputs.has_bias, 0};
  world->broadcast(header, 3, DType::i64, 0);
  const int64_t ndim = header[0];
  const bool has_bias = header[1] != 0;

  // Layout of x: --shard-dims names the tensor dim each mesh dim shards (default: the last
  // spatial dims), --extents their extents (default: balanced).
  const auto [placements, extents] =
      run_op_layout(mesh, options.layout.shard_dims, options.layout.extents, ndim, ndim);

  const double start = now_seconds();
  Tape tape;
  ShardTensor x = ShardTensor::scatter(inputs.x, mesh, placements, extents);
  ShardTensor w = replicate_from_root(inputs.w, mesh);
  std::optional<ShardTensor> b;
  if (has_bias) b = replicate_from_root(inputs.b, mesh);
  if (options.backward) {
    x.set_requires_grad();
    w.set_requires_grad();
    if (b) b->set_requires_grad();
  }
  const ShardTensor y = ops::conv(x, w, b, conv_options(options));
  const Tensor y_full = y.gather(0);
  Tensor gx, gw, gb;
  if (options.backward) {
    std::optional<std::string> mismatch;
    if (root && inputs.gy.shape() != y.global_shape())
      mismatch =
          fmt::format("gy has shape {} but y has shape {}", inputs.gy.shape(), y.global_shape());
    agree_on_error(*world, "run-op", mismatch);
    const ShardTensor gy = ShardTensor::scatter(inputs.gy, mesh, y.placements(), y.spec().extents);
    tape.backward(ops::sum(ops::mul(y, gy)));
    gx = tape.grad(x)->gather(0);
    gw = tape.grad(w)->gather(0);
    if (b) gb = tape.grad(*b)->gather(0);
  }
  const double seconds = now_seconds() - start;
  if (!root) return;
  std::vector<std::pair<std::string, Tensor>> outputs{{"y", y_full}};
  if (options.backward) {
    outputs.emplace_back("gx", gx);
    outputs.emplace_back("gw", gw);
    if (b) outputs.emplace_back("gb", gb);
  }
  write_outputs(options.out, outputs);
  fmt::print("conv{}d: x {} -> y {} on mesh {} ({}), {}\n", ndim - 2, x.global_shape(),
             y.global_shape(), mesh_shape, x.spec().str(),
             run_summary_tail(*world, seconds, options.out));
}

}  // namespace

void register_run_op(CLI::App& app) {
  auto* run_op = app.add_subcommand("run-op", "Run a sharded op on data from an HDF5 file");
  run_op->require_subcommand(1);
  auto options = std::make_shared<ConvRunOptions>();
  auto* conv = run_op->add_subcommand(
      "conv", "Sharded conv1d/2d/3d (by the rank of x), forward and backward");
  conv->add_option("--in", options->in, "Input file with x, w, optional b, and gy for --backward")
      ->required();
  conv->add_option("--out", options->out,
                   "Output file: y (and gx, gw, gb); not the --in file, which it would replace")
      ->required();
  conv->add_option("--stride", options->stride, "Stride per spatial dim, e.g. 2,2")
      ->capture_default_str();
  conv->add_option("--padding", options->padding, "Padding per dim (a,b), same or valid")
      ->capture_default_str();
  conv->add_option("--dilation", options->dilation, "Dilation per spatial dim")
      ->capture_default_str();
  conv->add_option("--groups", options->groups, "Groups (at least 1)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  conv->add_option("--padding-mode", options->padding_mode, "zeros or circular")
      ->capture_default_str();
  add_mesh_options(*conv, options->layout, "2");
  conv->add_flag("--backward", options->backward, "Also compute gx, gw (and gb) from gy");
  conv->add_option("--device", options->device,
                   "cpu, cuda (local ranks round-robin over the GPUs) or cuda:N")
      ->capture_default_str();
  conv->add_option("--dtype", options->dtype, "f32 or f64")->capture_default_str();
  add_trace_option(*conv);
  conv->add_option("--shapes", options->shapes,
                   "In estimate mode only: the inputs' shapes instead of --in's, e.g. "
                   "\"x=2,3,64,64;w=8,3,3,3;b=8\" (docs/scaling.md)");
  conv->callback([options] {
    select_device(options->device);
    launch(backend_from_env(), options->layout.local_ranks(),
           [&](std::shared_ptr<Comm> world) { run_conv(world, *options); });
  });
  register_run_op_na(*run_op);       // run_op_na.cpp
  register_run_op_generic(*run_op);  // run_op_generic.cpp: every other op
}

}  // namespace tessera::cli
