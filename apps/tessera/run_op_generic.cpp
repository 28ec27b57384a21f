// `tessera run-op OP` for every registered op with a signature and no run-op command of its own:
// inputs come from the datasets named after the op's inputs (optional ones may be absent),
// outputs go to datasets named after its outputs; with --backward the gradient of output y is
// read from gy and the gradient of input x written to gx. Attributes are --attr NAME=VALUE
// (lists comma-separated, booleans 0 or 1), parsed through the op's signature. The first input
// is sharded by --shard-dims/--extents; an input of its shape takes its layout, any other is
// replicated. Every rank reads its own box (io::scatter from rank 0, streamed); bad attributes,
// missing inputs and bad shapes give one line naming the op and exit code 2 on every rank.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "apps/tessera/run_op_common.hpp"
#include "core/tessera.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io.hpp"
#include "ops/op_helpers.hpp"
#include "ops/ops.hpp"

namespace tessera::cli {

namespace {

struct GenericRunOptions {
  std::string in, out;
  std::vector<std::string> attrs;
  MeshOptions layout;
  bool backward = false;
  std::string device = "cpu", dtype = "f64";
};

/// What rank 0 found in the input file: per input, whether it is there and its shape; per
/// output, whether its gradient is there (--backward).
struct InputSurvey {
  std::vector<bool> present;
  std::vector<Shape> shapes;
  std::vector<bool> output_grads;
};

/// Rank 0 looks at the input file; a problem becomes the same AgreedError (tagged with the op)
/// on every rank.
InputSurvey survey_inputs(Comm& world, const OpDef& op, const GenericRunOptions& options) {
  InputSurvey survey;
  survey.present.assign(op.inputs.size(), false);
  survey.shapes.assign(op.inputs.size(), Shape{});
  survey.output_grads.assign(op.outputs.size(), false);
  std::optional<std::string> problem;
  if (world.rank() == 0) {
    try {
      check_arg(std::filesystem::exists(options.in), op.name, "input file {} does not exist",
                options.in);
      for (size_t i = 0; i < op.inputs.size(); ++i) {
        const OpInput& input = op.inputs[i];
        survey.present[i] = io::has_dataset(options.in, input.name);
        check_arg(survey.present[i] || input.optional, op.name,
                  "input '{}': {} has no dataset '{}'", input.name, options.in, input.name);
        check_arg(!survey.present[i] || i == 0 || survey.present[i - 1], op.name,
                  "input '{}' is given but optional input '{}' before it is not (inputs are "
                  "positional)",
                  input.name, op.inputs[i - 1].name);
        if (survey.present[i]) survey.shapes[i] = io::dataset_info(options.in, input.name).shape;
      }
      if (options.backward) {
        for (size_t o = 0; o < op.outputs.size(); ++o)
          survey.output_grads[o] = io::has_dataset(options.in, "g" + op.outputs[o]);
        std::vector<std::string> grads;
        for (const std::string& output : op.outputs) grads.push_back("g" + output);
        check_arg(std::find(survey.output_grads.begin(), survey.output_grads.end(), true) !=
                      survey.output_grads.end(),
                  op.name, "--backward needs the gradient of an output: {} has no dataset {}",
                  options.in, fmt::join(grads, " or "));
      }
    } catch (const Error& error) {
      problem = untagged(error);
    }
  }
  agree_on_error(world, op.name, problem);
  // Rank 0's findings to every rank: flags, then the shapes.
  std::vector<int64_t> header;
  for (size_t i = 0; i < op.inputs.size(); ++i) {
    header.push_back(survey.present[i]);
    header.push_back(static_cast<int64_t>(survey.shapes[i].size()));
  }
  for (bool grad : survey.output_grads) header.push_back(grad);
  world.broadcast(header.data(), header.size(), DType::i64, 0);
  std::vector<int64_t> dims;
  for (size_t i = 0; i < op.inputs.size(); ++i) {
    survey.present[i] = header[2 * i] != 0;
    survey.shapes[i].resize(static_cast<size_t>(header[2 * i + 1]));
    dims.insert(dims.end(), survey.shapes[i].begin(), survey.shapes[i].end());
  }
  for (size_t o = 0; o < op.outputs.size(); ++o)
    survey.output_grads[o] = header[2 * op.inputs.size() + o] != 0;
  world.broadcast(dims.data(), dims.size(), DType::i64, 0);
  size_t next = 0;
  for (Shape& shape : survey.shapes)
    for (int64_t& extent : shape) extent = dims[next++];
  return survey;
}

/// Rethrows an Error as an AgreedError tagged `op` (for checks every rank makes alike).
template <typename Body>
auto agreed(const std::string& op, Body body) {
  try {
    return body();
  } catch (const AgreedError&) {
    throw;
  } catch (const Error& error) {
    throw AgreedError(op, untagged(error));
  }
}

void run_generic(std::shared_ptr<Comm> world, const std::string& name,
                 const GenericRunOptions& options) {
  const std::shared_ptr<const OpDef> definition = find_op(name);
  const OpDef& op = *definition;
  const std::vector<int> mesh_shape =
      agreed("run-op", [&] { return parse_mesh(options.layout.mesh); });
  DeviceMesh mesh(world, mesh_shape);
  const DType dtype = agreed("run-op", [&] { return dtype_from_name(options.dtype); });
  if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::f16 && dtype != DType::bf16)
    throw AgreedError("run-op",
                      fmt::format("--dtype {} (expected f32, f64, f16 or bf16)", options.dtype));
  if (Device::parse(options.device).is_cuda() && !op.cuda)
    throw AgreedError(name, fmt::format("--device {}: {} has no cuda kernel (devices: {}); use "
                                        "--device cpu",
                                        options.device, name, fmt::join(op.devices(), ", ")));
  if (options.backward && !op.backward)
    throw AgreedError(
        name, fmt::format("--backward: {} is not differentiable (it has no backward)", name));
  const OpAttrs attrs = agreed(name, [&] { return parse_attrs(name, op.attrs, options.attrs); });
  check_run_op_files(*world, options.in, options.out);
  const InputSurvey survey = survey_inputs(*world, op, options);

  // Layouts: the first input by --shard-dims/--extents, inputs of its shape alike, others
  // replicated.
  const Shape& first = survey.shapes[0];
  const int64_t ndim = static_cast<int64_t>(first.size());
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  // One rank with no layout asked for: everything replicated (a scalar input included).
  const bool single = mesh_size(mesh_shape) == 1 && options.layout.shard_dims.empty() &&
                      options.layout.extents.empty();
  const auto [placements, extents] =
      single ? RunOpLayout{replicated, {}}
             : run_op_layout(mesh, options.layout.shard_dims, options.layout.extents, ndim, ndim);

  const double start = now_seconds();
  Tape tape;
  std::vector<ShardTensor> inputs;
  for (size_t i = 0; i < op.inputs.size() && survey.present[i]; ++i) {
    const bool like_first = survey.shapes[i] == first;
    inputs.push_back(io::scatter(
        options.in, op.inputs[i].name, mesh, like_first ? placements : replicated,
        like_first ? extents : std::vector<std::vector<int64_t>>{}, 0, 256 << 20, dtype));
    if (options.backward) inputs.back().set_requires_grad();
  }
  const std::vector<ShardTensor> outputs = apply_op(name, inputs, attrs);
  agreed(name, [&] {
    // An op may return fewer outputs than its signature names (split: as many as parts).
    check_arg(outputs.size() <= op.outputs.size(), name,
              "returned {} outputs, its signature names {}", outputs.size(), op.outputs.size());
  });
  std::vector<std::pair<std::string, Tensor>> written;
  for (size_t o = 0; o < outputs.size(); ++o)
    written.emplace_back(op.outputs[o], outputs[o].gather(0));

  if (options.backward) {
    // loss = sum over outputs y with a gradient gy of sum(y * gy): d loss / d y = gy.
    std::optional<ShardTensor> loss;
    for (size_t o = 0; o < outputs.size(); ++o) {
      if (!survey.output_grads[o]) continue;
      const ShardTensor& y = outputs[o];
      const ShardSpec layout = ops::without_partial(y.spec());
      const std::string grad_name = "g" + op.outputs[o];
      // Integer outputs (max_pool's indices) take no gradient (the same on every rank).
      agreed(name, [&] {
        check_arg(is_floating(y.dtype()), name,
                  "the input file has a dataset '{}', but output '{}' is {} and takes no gradient",
                  grad_name, op.outputs[o], dtype_name(y.dtype()));
      });
      // The gradient's shape must be the output's (checked on rank 0, agreed everywhere).
      std::optional<std::string> mismatch;
      if (world->rank() == 0) {
        try {
          const Shape shape = io::dataset_info(options.in, grad_name).shape;
          if (shape != y.global_shape())
            mismatch = fmt::format("{} has shape {} but output '{}' has shape {}", grad_name, shape,
                                   op.outputs[o], y.global_shape());
        } catch (const Error& error) {
          mismatch = untagged(error);
        }
      }
      agree_on_error(*world, name, mismatch);
      const ShardTensor gy = io::scatter(options.in, grad_name, mesh, layout.placements,
                                         layout.extents, 0, 256 << 20, y.dtype());
      const ShardTensor term = ops::sum(ops::mul(y, gy));
      loss = loss ? ops::add(*loss, term) : term;
    }
    tape.backward(*loss);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const std::optional<ShardTensor> grad = tape.grad(inputs[i]);
      written.emplace_back(
          "g" + op.inputs[i].name,
          grad ? grad->gather(0) : Tensor::zeros(inputs[i].global_shape(), inputs[i].dtype()));
    }
  }
  const double seconds = now_seconds() - start;
  if (world->rank() != 0) return;
  write_outputs(options.out, written);
  std::vector<std::string> shapes;
  for (size_t o = 0; o < outputs.size(); ++o)
    shapes.push_back(fmt::format("{} {}", op.outputs[o], outputs[o].global_shape()));
  fmt::print("{}: {} {} -> {} on mesh {} ({}), {}\n", name, op.inputs[0].name, first,
             fmt::join(shapes, ", "), mesh_shape, inputs[0].spec().str(),
             run_summary_tail(*world, seconds, options.out));
}

}  // namespace

void register_run_op_generic(CLI::App& run_op) {
  std::set<std::string> own;  // ops with a command of their own (conv, na) keep it
  for (const CLI::App* command : run_op.get_subcommands({})) own.insert(command->get_name());
  for (const std::string& name : registered_ops()) {
    const std::shared_ptr<const OpDef> op = find_op(name);
    // An op without a signature has no dataset names to read and write by.
    if (!op->has_signature() || own.count(name) > 0) continue;
    std::vector<std::string> inputs, grads;
    for (const OpInput& input : op->inputs)
      inputs.push_back(input.optional ? input.name + " (optional)" : input.name);
    for (const std::string& output : op->outputs) grads.push_back("g" + output);
    auto options = std::make_shared<GenericRunOptions>();
    auto* command = run_op.add_subcommand(name, op->summary);
    command
        ->add_option("--in", options->in,
                     fmt::format("Input file with datasets {} (and {} for --backward)",
                                 fmt::join(inputs, ", "), fmt::join(grads, ", ")))
        ->required();
    command
        ->add_option("--out", options->out,
                     fmt::format("Output file: {} (and the input gradients); not the --in file",
                                 fmt::join(op->outputs, ", ")))
        ->required();
    std::vector<std::string> attrs;
    for (const OpAttr& attr : op->attrs)
      attrs.push_back(fmt::format("{} ({}{})", attr.name, attr_type_name(attr.type),
                                  attr.required ? ", required"
                                  : attr.default_value
                                      ? ", default " + attr_value_text(*attr.default_value)
                                      : ""));
    command->add_option(
        "--attr", options->attrs,
        fmt::format("NAME=VALUE, repeatable; lists comma-separated, booleans 0/1. "
                    "Attributes: {}",
                    attrs.empty() ? "none" : fmt::format("{}", fmt::join(attrs, ", "))));
    add_mesh_options(*command, options->layout, "2,3");
    command->add_flag("--backward", options->backward,
                      "Also compute the input gradients (gx for input x) from the output gradients "
                      "(gy for output y)");
    command->add_option("--dtype", options->dtype, "f32, f64, f16 or bf16")->capture_default_str();
    add_trace_option(*command);
    command->add_option("--device", options->device, "cpu, cuda or cuda:N")->capture_default_str();
    command->callback([options, name] {
      select_device(options->device);
      launch(backend_from_env(), options->layout.local_ranks(),
             [&](std::shared_ptr<Comm> world) { run_generic(world, name, *options); });
    });
  }
}

}  // namespace tessera::cli
