// `tessera run-op na`: runs the sharded neighborhood attention on a user's data from an HDF5
// file and writes the gathered results (o, lse, and with --backward gq, gk, gv, grpb) to another.
// Rank 0 reads the inputs and scatters q, k, v; bad arguments give one line and exit code 2 on
// every rank (the same contract as `run-op conv`).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <filesystem>

#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "apps/tessera/run_op_common.hpp"
#include "core/tessera.hpp"
#include "io/hdf5/h5_file.hpp"
#include "ops/ops.hpp"

namespace tessera::cli {

namespace {

struct NaRunOptions {
  std::string in, out;
  std::string kernel_size, dilation = "1", causal = "0";
  std::optional<double> scale;
  MeshOptions layout;
  bool backward = false;
  std::string device = "cpu", dtype = "f64";
};

/// The inputs as read on rank 0 (in the compute dtype).
struct NaInputs {
  Tensor q, k, v, rpb, go;
  bool has_rpb = false;
};

NaInputs read_inputs(const NaRunOptions& options, DType dtype) {
  NaInputs inputs;
  check_arg(std::filesystem::exists(options.in), "run-op", "input file {} does not exist",
            options.in);
  for (const char* name : {"q", "k", "v"})
    check_arg(io::has_dataset(options.in, name), "run-op",
              "{} has no dataset '{}' (na needs q, k, v [B, X(, Y(, Z)), heads, D])", options.in,
              name);
  // Read in f64 and convert here, so every dtype (bf16 included) takes the same path.
  auto read = [&](const char* name) {
    return io::read_dataset(options.in, name, DType::f64).to_dtype(dtype);
  };
  inputs.q = read("q");
  inputs.k = read("k");
  inputs.v = read("v");
  check_arg(inputs.q.ndim() >= 4 && inputs.q.ndim() <= 6, "run-op",
            "q has shape {}; na needs [B, X(, Y(, Z)), heads, D] (4 to 6 dims)", inputs.q.shape());
  for (const auto& [name, tensor] : {std::pair{"k", &inputs.k}, std::pair{"v", &inputs.v}})
    check_arg(tensor->shape() == inputs.q.shape(), "run-op", "{} has shape {}, q has shape {}",
              name, tensor->shape(), inputs.q.shape());
  inputs.has_rpb = io::has_dataset(options.in, "rpb");
  if (inputs.has_rpb) inputs.rpb = read("rpb");
  if (options.backward) {
    check_arg(io::has_dataset(options.in, "go"), "run-op",
              "--backward needs a dataset 'go' (the gradient of o) in {}", options.in);
    inputs.go = read("go");
    check_arg(inputs.go.shape() == inputs.q.shape(), "run-op", "go has shape {} but o has shape {}",
              inputs.go.shape(), inputs.q.shape());
  }
  return inputs;
}

void run_na(std::shared_ptr<Comm> world, const NaRunOptions& options) {
  const std::vector<int> mesh_shape = parse_mesh(options.layout.mesh);
  DeviceMesh mesh(world, mesh_shape);
  // Every rank checks the same text against the same machine: an agreed verdict.
  try {
    select_device(options.device);
  } catch (const Error& error) {
    throw AgreedError("device", untagged(error));
  }
  const DType dtype = dtype_from_name(options.dtype);
  if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::f16 && dtype != DType::bf16)
    throw AgreedError("run-op",
                      fmt::format("--dtype {} (na runs in f32, f64, f16 or bf16)", options.dtype));
  const bool root = world->rank() == 0;
  check_run_op_files(*world, options.in, options.out);

  NaInputs inputs;
  read_on_root(*world, [&] { inputs = read_inputs(options, dtype); });
  // On a device the root's tensors move there, and scatter hands every rank its piece on its
  // own device.
  const Device device = current_rank_context().device();
  if (root && device.is_cuda())
    for (Tensor* tensor : {&inputs.q, &inputs.k, &inputs.v, &inputs.rpb, &inputs.go})
      if (tensor->numel() > 0) *tensor = tensor->to(device);
  int64_t header[2] = {inputs.q.ndim(), inputs.has_rpb};
  world->broadcast(header, 2, DType::i64, 0);
  const int64_t ndim = header[0];
  const bool has_rpb = header[1] != 0;
  const int64_t spatial = ndim - 3;

  // Layout of q, k, v: --shard-dims names the tensor dim each mesh dim shards (default: the
  // last spatial dims), --extents their extents (default: balanced).
  const auto [placements, extents] =
      run_op_layout(mesh, options.layout.shard_dims, options.layout.extents, ndim, ndim - 2);

  // Every rank parses the same strings, so a bad one is an agreed error.
  ops::NaOptions na;
  try {
    na.kernel_size = parse_list(options.kernel_size);
    na.dilation = parse_list(options.dilation);
    na.causal = parse_list(options.causal);
  } catch (const AgreedError&) {
    throw;
  } catch (const Error& error) {
    throw AgreedError(error.op(), untagged(error));
  }
  na.scale = options.scale;

  const double start = now_seconds();
  Tape tape;
  ShardTensor q = ShardTensor::scatter(inputs.q, mesh, placements, extents);
  ShardTensor k = ShardTensor::scatter(inputs.k, mesh, placements, extents);
  ShardTensor v = ShardTensor::scatter(inputs.v, mesh, placements, extents);
  if (has_rpb) na.rpb = replicate_from_root(inputs.rpb, mesh);
  if (options.backward) {
    for (ShardTensor* input : {&q, &k, &v}) input->set_requires_grad();
    if (na.rpb) na.rpb->set_requires_grad();
  }
  const ops::NaResult result = ops::neighborhood_attention(q, k, v, na);
  auto gathered = [](const ShardTensor& t) { return t.gather(0).to(Device::cpu()); };
  const Tensor o_full = gathered(result.output);
  const Tensor lse_full = gathered(result.lse);
  Tensor gq, gk, gv, grpb;
  if (options.backward) {
    const ShardTensor go = ShardTensor::scatter(inputs.go, mesh, result.output.placements(),
                                                result.output.spec().extents);
    tape.backward(ops::sum(ops::mul(result.output, go)));
    gq = gathered(*tape.grad(q));
    gk = gathered(*tape.grad(k));
    gv = gathered(*tape.grad(v));
    if (na.rpb) grpb = gathered(*tape.grad(*na.rpb));
  }
  const double seconds = now_seconds() - start;
  if (!root) return;
  std::vector<std::pair<std::string, Tensor>> outputs{{"o", o_full}, {"lse", lse_full}};
  if (options.backward) {
    outputs.emplace_back("gq", gq);
    outputs.emplace_back("gk", gk);
    outputs.emplace_back("gv", gv);
    if (na.rpb) outputs.emplace_back("grpb", grpb);
  }
  write_outputs(options.out, outputs);
  fmt::print("na{}d: q {} kernel {} dilation {} causal {} on mesh {} ({}), {}\n", spatial,
             q.global_shape(), na.kernel_size, na.dilation, na.causal, mesh_shape, q.spec().str(),
             run_summary_tail(*world, seconds, options.out));
}

}  // namespace

void register_run_op_na(CLI::App& run_op) {
  // CLI11 reads "nan" and "inf" as doubles; a logit scale must be finite.
  const CLI::Validator finite_number(
      [](std::string& text) -> std::string {
        try {
          size_t used = 0;
          const double value = std::stod(text, &used);
          if (used == text.size() && std::isfinite(value)) return "";
        } catch (const std::exception&) {
        }
        return "expected a finite number, got " + text;
      },
      "FINITE");
  auto options = std::make_shared<NaRunOptions>();
  auto* na = run_op.add_subcommand(
      "na", "Sharded neighborhood attention 1d/2d/3d (by the rank of q), forward and backward");
  na->add_option("--in", options->in,
                 "Input file with q, k, v, optional rpb, and go for --backward")
      ->required();
  na->add_option("--out", options->out,
                 "Output file: o, lse (and gq, gk, gv, grpb); not the --in file, which it would "
                 "replace")
      ->required();
  na->add_option("--kernel-size", options->kernel_size, "Kernel size per spatial axis, e.g. 7,7")
      ->required();
  na->add_option("--dilation", options->dilation, "Dilation per spatial axis")
      ->capture_default_str();
  na->add_option("--causal", options->causal, "Causal flag (0 or 1) per spatial axis")
      ->capture_default_str();
  na->add_option("--scale", options->scale, "Logit scale, a finite number (default D^-0.5)")
      ->check(finite_number);
  add_mesh_options(*na, options->layout, "1,2");
  na->add_flag("--backward", options->backward, "Also compute gq, gk, gv (and grpb) from go");
  na->add_option("--device", options->device, "cpu, cuda or cuda:N")->capture_default_str();
  na->add_option("--dtype", options->dtype, "f32, f64, f16 or bf16")->capture_default_str();
  add_trace_option(*na);
  na->callback([options] {
    // A usable --device becomes every rank's device before the launch; a bad one is reported
    // inside it (run_na), as an agreed error printed once under mpiexec.
    try {
      select_device(options->device);
    } catch (const Error&) {
    }
    launch(backend_from_env(), options->layout.local_ranks(),
           [&](std::shared_ptr<Comm> world) { run_na(world, *options); });
  });
}

}  // namespace tessera::cli
