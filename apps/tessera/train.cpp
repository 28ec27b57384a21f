// `tessera train --model M.onnx --data D.h5 --input x --target y`: trains a network exported from
// PyTorch (nn::OnnxModel) on HDF5 samples, sharded over a dp x domain mesh (docs/models.md,
// "Training an exported network").
//
// The mesh is ("dp", domain0, ..): --dp splits the batch (default split: the first B % dp ranks
// get one more sample), --mesh/--shard-dims/--extents split the spatial dims. The loss is the
// mean over every element of the GLOBAL batch, computed exactly over the shards, so every layout
// trains the same function as one rank. Gradients: the bucketed reducer (nn::GradReducer) sums
// them over dp and the domain dims in one collective per bucket, or, with --parallel
// fsdp|hybrid, each gradient goes straight into the rank's shard of the parameter (reduce-scatter
// over the shard dim, all-reduce over the rest) and the optimizer updates shards only.
//
// Data: step t's global batch is samples (t*B + i) mod S, i < B, in file order (--shuffle 0; each
// rank reads only its own rows and spatial box), or io::BatchReader's seeded order (--shuffle 1);
// with --crop every sample is a random crop (CropBatches).
// Either way the data position is a function of t, so a checkpoint's step count is enough to
// continue the data exactly.
//
// Model parallelism (docs/parallelism.md, "Model parallelism for exported networks"): the mesh
// is ("pp", "dp", "tp", domain0, ..), pp and tp present when > 1. --pp cuts the graph into stages
// (nn::onnx_cut_points: one activation crossing; balanced by parameter count, or --stage-cuts),
// each an OnnxModel of its subgraph on its stage's mesh, run by nn::Pipeline under --schedule
// with --micro-batches. --tp shards the weights of the patterns nn::onnx_tensor_parallel_plan
// finds (MatMul/Gemm .. MatMul/Gemm column- then row-parallel, Conv .. Conv filter- then channel-
// parallel, attention's q/k/v projections .. output projection in whole heads); every other
// parameter is replicated over tp.
//
// Bad options and inputs give one `tessera: error: [train] ...` line and exit 2 on every rank,
// before anything is written.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <tuple>

#include "apps/plot/plot.hpp"
#include "apps/tessera/cli_parse.hpp"
#include "apps/tessera/commands.hpp"
#include "apps/tessera/progress_bar.hpp"
#include "apps/tessera/run_op_common.hpp"
#include "core/backend/backend.hpp"
#include "core/estimate/record.hpp"
#include "core/host_allocator.hpp"
#include "core/tessera.hpp"
#include "core/trace.hpp"
#include "io/hdf5/batch_reader.hpp"
#include "io/hdf5/checkpoint.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/output_path.hpp"
#include "ops/cast/cast_op.hpp"
#include "ops/nn/data_parallel.hpp"
#include "ops/nn/onnx_model.hpp"
#include "ops/nn/onnx_nodes.hpp"
#include "ops/nn/onnx_partition.hpp"
#include "ops/nn/pipeline.hpp"
#include "ops/ops.hpp"
#include "ops/optim/optimizer.hpp"

namespace tessera::cli {

namespace {

constexpr const char* kOp = "train";

struct TrainOptions {
  std::string model, data, input, target;
  int64_t steps = 0, batch = 0;
  std::string loss = "mse", optimizer = "sgd";
  double lr = 0, momentum = 0, weight_decay = 0;
  bool weight_decay_given = false;  ///< else the optimizer's default (adamw: 1e-2)
  int dp = 1, dp_shard = 0;
  std::string parallel = "ddp";
  MeshOptions layout;
  int shuffle = 0;
  uint64_t seed = 0;
  std::string dtype = "f32", device = "cpu";
  std::string checkpoint;
  int64_t every = 0;
  bool resume = false, json = false;
  std::string losses_out, save_model;
  std::string plot;  ///< directory of loss.png, redrawn as the run goes ("" = none)
  std::string crop;  ///< spatial extents of the random crop each sample is cut to ("" = none)
  int pp = 1, tp = 1, micro_batches = 1;
  std::string schedule = "1f1b";
  int chunks = 0;          ///< model chunks per pp rank (0: 2 for interleaved, else 1)
  std::string stage_cuts;  ///< crossing tensors to cut at, comma separated ("" = balanced)
  bool schedule_given = false;

  bool sharded_parameters() const { return parallel == "fsdp" || parallel == "hybrid"; }
  int chunks_per_rank() const { return chunks > 0 ? chunks : schedule == "interleaved" ? 2 : 1; }
  int stages() const { return pp * chunks_per_rank(); }
};

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 ? values[middle] : 0.5 * (values[middle - 1] + values[middle]);
}

/// The batch rows of each data-parallel rank (the default split: the first B % dp get one more).
std::vector<int64_t> dp_shares(int64_t batch, int dp) {
  std::vector<int64_t> shares;
  for (int r = 0; r < dp; ++r) shares.push_back(batch / dp + (r < batch % dp ? 1 : 0));
  return shares;
}

/// The checks of --pp/--tp and their companions that need only the options.
void check_model_parallel_options(const TrainOptions& options) {
  check_arg(options.pp >= 1 && options.tp >= 1, kOp, "--pp {} --tp {} (expected sizes >= 1)",
            options.pp, options.tp);
  check_arg(options.schedule == "gpipe" || options.schedule == "1f1b" ||
                options.schedule == "interleaved",
            kOp, "--schedule {} (expected gpipe, 1f1b or interleaved)", options.schedule);
  if (options.pp == 1) {
    check_arg(options.micro_batches == 1 && options.chunks == 0 && options.stage_cuts.empty() &&
                  !options.schedule_given,
              kOp,
              "--micro-batches, --schedule, --chunks and --stage-cuts are options of a pipeline: "
              "give --pp > 1");
  }
  if (options.pp == 1) return;
  if (options.schedule == "interleaved")
    check_arg(options.chunks == 0 || options.chunks >= 2, kOp,
              "--schedule interleaved needs --chunks >= 2 model chunks per pp rank, got {}",
              options.chunks);
  else
    check_arg(options.chunks <= 1, kOp,
              "--chunks {} is an option of --schedule interleaved, not {}", options.chunks,
              options.schedule);
  for (const int64_t share : dp_shares(options.batch, options.dp))
    check_arg(share % options.micro_batches == 0, kOp,
              "--micro-batches {} does not divide the batch of every data-parallel rank (--batch "
              "{} over --dp {}: {} rows)",
              options.micro_batches, options.batch, options.dp,
              fmt::join(dp_shares(options.batch, options.dp), ", "));
  if (const std::optional<std::string> problem =
          nn::schedule_problem(nn::parse_schedule(options.schedule), options.pp, options.stages(),
                               options.micro_batches))
    check_arg(false, kOp, "--schedule {} --pp {} --micro-batches {}: {}", options.schedule,
              options.pp, options.micro_batches, *problem);
}

/// The checks that need nothing but the options (every rank makes them alike).
void check_options(const TrainOptions& options, const std::vector<int>& domain, int world_size) {
  check_arg(options.loss == "mse" || options.loss == "l1", kOp, "--loss {} (expected mse or l1)",
            options.loss);
  check_arg(
      options.optimizer == "sgd" || options.optimizer == "adam" || options.optimizer == "adamw",
      kOp, "--optimizer {} (expected sgd, adam or adamw)", options.optimizer);
  check_arg(options.parallel == "ddp" || options.parallel == "fsdp" || options.parallel == "hybrid",
            kOp, "--parallel {} (expected ddp, fsdp or hybrid)", options.parallel);
  check_arg(options.dtype == "f32" || options.dtype == "f64" || options.dtype == "bf16", kOp,
            "--dtype {} (expected f32, f64 or bf16)", options.dtype);
  check_arg(std::isfinite(options.lr) && options.lr > 0, kOp,
            "--lr {} (expected a finite rate > 0)", options.lr);
  check_arg(std::isfinite(options.momentum) && options.momentum >= 0, kOp,
            "--momentum {} (expected a finite value >= 0)", options.momentum);
  check_arg(options.momentum == 0 || options.optimizer == "sgd", kOp,
            "--momentum is an option of --optimizer sgd, not {}", options.optimizer);
  check_arg(std::isfinite(options.weight_decay) && options.weight_decay >= 0, kOp,
            "--weight-decay {} (expected a finite value >= 0)", options.weight_decay);
  check_arg(!options.sharded_parameters() || options.dp > 1, kOp,
            "--parallel {} shards the parameters over the data-parallel dim: give --dp > 1 (got "
            "--dp {})",
            options.parallel, options.dp);
  if (options.parallel == "hybrid") {
    check_arg(
        options.dp_shard > 1 && options.dp_shard < options.dp && options.dp % options.dp_shard == 0,
        kOp,
        "--parallel hybrid needs --dp-shard S with 1 < S < --dp {} dividing it (the "
        "parameters are sharded over S ranks and replicated over dp / S), got --dp-shard "
        "{}",
        options.dp, options.dp_shard);
  } else {
    check_arg(options.dp_shard == 0, kOp, "--dp-shard is an option of --parallel hybrid, not {}",
              options.parallel);
  }
  check_arg(options.batch >= options.dp, kOp,
            "--batch {} is smaller than --dp {}: every data-parallel rank needs a sample",
            options.batch, options.dp);
  check_arg(options.every == 0 || !options.checkpoint.empty(), kOp,
            "--every {} needs --checkpoint DIR", options.every);
  check_arg(!options.resume || !options.checkpoint.empty(), kOp,
            "--resume continues from --checkpoint DIR: give it");
  check_model_parallel_options(options);
  const int64_t ranks = int64_t{options.pp} * options.dp * options.tp * mesh_size(domain);
  check_arg(ranks == world_size, kOp,
            "--pp {} x --dp {} x --tp {} x --mesh {} has {} ranks, the run has {} (--ranks or "
            "mpiexec -n)",
            options.pp, options.dp, options.tp, options.layout.mesh, ranks, world_size);
  for (const std::string* file : {&options.losses_out, &options.save_model}) {
    if (file->empty()) continue;
    io::check_output_is_not_input(kOp, options.data, *file);
    io::check_output_is_not_input(kOp, options.model, *file);
  }
}

/// What rank 0 learns about the data file, shared with every rank.
struct DataShapes {
  Shape input, target;
};

/// Collective: rank 0 checks the data file against the model (both datasets present, floating,
/// the same number of samples, the input's rank and channels those of the model's input) and
/// every rank gets the shapes.
DataShapes survey_data(Comm& world, const io::OnnxValue& graph_input, const TrainOptions& options) {
  DataShapes shapes;
  std::optional<std::string> problem;
  if (world.rank() == 0) {
    try {
      check_arg(std::filesystem::exists(options.data), kOp, "--data {} does not exist",
                options.data);
      for (const auto& [option, name] :
           {std::pair{"--input", options.input}, std::pair{"--target", options.target}}) {
        check_arg(io::has_dataset(options.data, name), kOp, "{} '{}': {} has no such dataset",
                  option, name, options.data);
        const io::DatasetInfo info = io::dataset_info(options.data, name);
        check_arg(info.dtype && is_floating(*info.dtype), kOp,
                  "{} '{}' of {} holds {}, not floating values", option, name, options.data,
                  info.file_type);
        check_arg(info.shape.size() >= 2 && info.shape[0] >= 1, kOp,
                  "{} '{}' of {} has shape {}: expected [samples, channels, spatial..]", option,
                  name, options.data, info.shape);
      }
      shapes.input = io::dataset_info(options.data, options.input).shape;
      shapes.target = io::dataset_info(options.data, options.target).shape;
      check_arg(shapes.target[0] == shapes.input[0], kOp,
                "--target '{}' has {} samples, --input '{}' has {}", options.target,
                shapes.target[0], options.input, shapes.input[0]);
      check_arg(graph_input.shape.empty() || graph_input.shape.size() == shapes.input.size(), kOp,
                "--input '{}' has shape {} ({}-d), the model's input '{}' is {}-d", options.input,
                shapes.input, shapes.input.size(), graph_input.name, graph_input.shape.size());
      // A static channel count in the exported graph must match the data's.
      check_arg(graph_input.shape.size() < 2 || graph_input.shape[1] <= 0 ||
                    graph_input.shape[1] == shapes.input[1],
                kOp, "--input '{}' has {} channels (shape {}), the model's input '{}' takes {}",
                options.input, shapes.input[1], shapes.input, graph_input.name,
                graph_input.shape[1]);
    } catch (const Error& error) {
      problem = untagged(error);
    }
  }
  agree_on_error(world, kOp, problem);
  for (Shape* shape : {&shapes.input, &shapes.target}) {
    int64_t rank = static_cast<int64_t>(shape->size());
    world.broadcast(&rank, 1, DType::i64, 0);
    shape->resize(static_cast<size_t>(rank));
    world.broadcast(shape->data(), shape->size(), DType::i64, 0);
  }
  return shapes;
}

/// The batch layout on the ("dp", domain..) mesh: dp shards the batch (dim 0) with the default
/// split; each domain mesh dim shards the --shard-dims dim (default: the last spatial dims) with
/// --extents (default balanced); a domain dim of size 1 replicates unless extents are given.
struct BatchLayout {
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;  ///< per mesh dim; the dp entry empty
  std::vector<int> shard_dims;                ///< per non-dp mesh dim: the data dim, or -1
};

BatchLayout domain_batch_layout(const TrainOptions& options, const std::vector<int>& domain,
                                int64_t ndim);

BatchLayout batch_layout(const TrainOptions& options, const std::vector<int>& domain,
                         int64_t ndim) {
  BatchLayout layout = domain_batch_layout(options, domain, ndim);
  if (options.tp == 1) return layout;
  // The tp dim (after dp) replicates the data: the tensor-parallel products split the weights.
  layout.placements.insert(layout.placements.begin() + 1, Placement::replicate());
  if (!layout.extents.empty())
    layout.extents.insert(layout.extents.begin() + 1, std::vector<int64_t>{});
  layout.shard_dims.insert(layout.shard_dims.begin(), -1);
  return layout;
}

BatchLayout domain_batch_layout(const TrainOptions& options, const std::vector<int>& domain,
                                int64_t ndim) {
  const int domain_dims = static_cast<int>(domain.size());
  std::vector<int64_t> dims;
  if (options.layout.shard_dims.empty()) {
    for (int m = 0; m < domain_dims; ++m) dims.push_back(ndim - domain_dims + m);
  } else {
    dims = parse_list(options.layout.shard_dims);
  }
  check_arg(static_cast<int>(dims.size()) == domain_dims, kOp,
            "--shard-dims {} names {} dims for the {}-d --mesh {}", options.layout.shard_dims,
            dims.size(), domain_dims, options.layout.mesh);
  std::vector<std::vector<int64_t>> domain_extents;
  if (!options.layout.extents.empty()) {
    domain_extents = parse_extents(options.layout.extents);
    check_arg(static_cast<int>(domain_extents.size()) == domain_dims, kOp,
              "--extents {} has {} groups for the {}-d --mesh {}", options.layout.extents,
              domain_extents.size(), domain_dims, options.layout.mesh);
  }
  BatchLayout layout;
  layout.placements.push_back(options.dp > 1 ? Placement::shard(0) : Placement::replicate());
  layout.extents.emplace_back();
  for (int m = 0; m < domain_dims; ++m) {
    const int64_t dim = dims[m];
    check_arg(dim >= 2 && dim < ndim, kOp,
              "--shard-dims {}: dim {} is not a spatial dim of the {}-d data [samples, channels, "
              "spatial..] (expected 2 to {})",
              options.layout.shard_dims.empty() ? fmt::format("{}", fmt::join(dims, ","))
                                                : options.layout.shard_dims,
              dim, ndim, ndim - 1);
    const bool sharded = domain[m] > 1 || !domain_extents.empty();
    layout.placements.push_back(sharded ? Placement::shard(static_cast<int>(dim))
                                        : Placement::replicate());
    layout.extents.push_back(domain_extents.empty() ? std::vector<int64_t>{} : domain_extents[m]);
    layout.shard_dims.push_back(sharded ? static_cast<int>(dim) : -1);
  }
  if (domain_extents.empty()) layout.extents.clear();
  return layout;
}

/// The global batches of --input and --target, each rank holding its own piece.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  /// Collective: step t's (input, target) batches.
  virtual std::pair<ShardTensor, ShardTensor> batch(int64_t step) = 0;
};

/// Collective: the (input, target) batches of `specs` (input first), each rank's piece filled by
/// fill(dataset, box, local) for its non-empty box; a read error on any rank is one agreed error.
std::pair<ShardTensor, ShardTensor> read_batch(
    const TrainOptions& options, const DeviceMesh& mesh, const std::vector<ShardSpec>& specs,
    DType as, const std::function<void(const std::string&, const Box&, Tensor&)>& fill) {
  std::vector<ShardTensor> pieces;
  std::optional<std::string> problem;
  for (size_t k = 0; k < specs.size(); ++k) {
    const Box box = specs[k].local_box(mesh.coord());
    Tensor local = Tensor::empty(box.shape(), as, current_rank_context().device());
    try {
      if (!box.empty()) fill(k == 0 ? options.input : options.target, box, local);
    } catch (const Error& error) {
      if (!problem) problem = untagged(error);
    }
    pieces.emplace_back(local, mesh, specs[k]);
  }
  agree_on_error(mesh.comm(), kOp, problem);
  return {pieces[0], pieces[1]};
}

/// --shuffle 0: step t holds samples (t*B + i) mod S. Each rank reads only its rows (its dp share
/// of the batch) and its spatial box, as at most a few hyperslabs: the rows of one step are one
/// run of consecutive samples, broken where they wrap around the end of the file.
class FileOrderBatches final : public BatchSource {
 public:
  FileOrderBatches(const TrainOptions& options, const DeviceMesh& mesh, const BatchLayout& layout,
                   const DataShapes& shapes, DType as)
      : options_(options), mesh_(mesh), samples_(shapes.input[0]), as_(as) {
    for (const Shape* shape : {&shapes.input, &shapes.target}) {
      Shape batch_shape = *shape;
      batch_shape[0] = options.batch;
      specs_.push_back(
          ShardSpec::make(batch_shape, mesh.shape(), layout.placements, layout.extents, kOp));
    }
  }

  std::pair<ShardTensor, ShardTensor> batch(int64_t step) override {
    const int64_t first = (step % samples_) * (options_.batch % samples_) % samples_;
    return read_batch(options_, mesh_, specs_, as_,
                      [&](const std::string& dataset, const Box& box, Tensor& local) {
                        for (int64_t row = box.lo[0]; row < box.hi[0];) {
                          const int64_t sample = (first + row) % samples_;
                          const int64_t run = std::min(box.hi[0] - row, samples_ - sample);
                          Box in_file = box;
                          in_file.lo[0] = sample;
                          in_file.hi[0] = sample + run;
                          local.slice(0, row - box.lo[0], row - box.lo[0] + run)
                              .copy_from(io::read_hyperslab(options_.data, dataset, in_file, as_,
                                                            local.device()));
                          row += run;
                        }
                      });
  }

 private:
  const TrainOptions& options_;
  DeviceMesh mesh_;
  int64_t samples_;
  DType as_;
  std::vector<ShardSpec> specs_;
};

/// --shuffle 1: io::BatchReader's seeded order (full batches: an epoch's incomplete tail is
/// skipped), one reader per dataset with the same options, so both visit the same samples.
class ShuffledBatches final : public BatchSource {
 public:
  ShuffledBatches(const TrainOptions& options, const DeviceMesh& mesh, const BatchLayout& layout,
                  DType as) {
    io::BatchReaderOptions reader{.batch_size = options.batch,
                                  .seed = options.seed,
                                  .shuffle = true,
                                  .drop_last = true,
                                  .dp_dim = "dp",
                                  .shard_dims = layout.shard_dims,
                                  .extents = layout.extents,
                                  .as = as};
    input_.emplace(options.data, options.input, mesh, reader);
    target_.emplace(options.data, options.target, mesh, reader);
    check_arg(input_->steps_per_epoch() > 0, kOp,
              "--batch {} is larger than the {} samples of --input '{}' (--shuffle 1 takes full "
              "batches of one epoch)",
              options.batch, input_->samples(), options.input);
  }

  std::pair<ShardTensor, ShardTensor> batch(int64_t step) override {
    const int64_t per_epoch = input_->steps_per_epoch();
    const io::BatchPosition position{step / per_epoch, step % per_epoch};
    for (std::optional<io::BatchReader>* reader : {&input_, &target_})
      if ((*reader)->position() != position) (*reader)->seek(position);
    ShardTensor x = input_->next();
    return {x, target_->next()};
  }

 private:
  std::optional<io::BatchReader> input_, target_;
};

/// splitmix64: the mixing function of the crop positions and the crop order's shuffle.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// --crop: every sample of a batch is a crop of the given spatial extents, at a position drawn
/// from (seed, step, index in the batch), the same box of the input and of the target. Samples
/// come in file order, (t*B + i) mod S (--shuffle 0), or in a seeded permutation per epoch of S
/// samples (--shuffle 1: Fisher-Yates driven by splitmix64 of the seed and the epoch). Each rank
/// reads only its rows and its box of each crop: one hyperslab per sample.
class CropBatches final : public BatchSource {
 public:
  CropBatches(const TrainOptions& options, const DeviceMesh& mesh, const BatchLayout& layout,
              const DataShapes& shapes, DType as)
      : options_(options), mesh_(mesh), samples_(shapes.input[0]), as_(as) {
    crop_ = parse_list(options.crop);
    const size_t spatial = shapes.input.size() - 2;
    check_arg(crop_.size() == spatial, kOp,
              "--crop {} gives {} extents for the {} spatial dims of --input '{}' (shape {})",
              options.crop, crop_.size(), spatial, options.input, shapes.input);
    check_arg(std::equal(shapes.input.begin() + 2, shapes.input.end(), shapes.target.begin() + 2),
              kOp,
              "--crop cuts the same box of input and target: their spatial shapes differ ({} and "
              "{})",
              shapes.input, shapes.target);
    for (size_t d = 0; d < spatial; ++d) {
      data_extent_.push_back(shapes.input[d + 2]);
      check_arg(crop_[d] >= 1 && crop_[d] <= data_extent_[d], kOp,
                "--crop {}: extent {} of spatial dim {} is not within 1..{} (the data's)",
                options.crop, crop_[d], d, data_extent_[d]);
    }
    for (const Shape* shape : {&shapes.input, &shapes.target}) {
      Shape batch_shape = *shape;
      batch_shape[0] = options.batch;
      std::copy(crop_.begin(), crop_.end(), batch_shape.begin() + 2);
      specs_.push_back(
          ShardSpec::make(batch_shape, mesh.shape(), layout.placements, layout.extents, kOp));
    }
  }

  std::pair<ShardTensor, ShardTensor> batch(int64_t step) override {
    return read_batch(options_, mesh_, specs_, as_,
                      [&](const std::string& dataset, const Box& box, Tensor& local) {
                        for (int64_t row = box.lo[0]; row < box.hi[0]; ++row) {
                          const int64_t index =
                              step * options_.batch + row;  // in the run's stream of samples
                          Box in_file = box;
                          in_file.lo[0] = sample_of(index);
                          in_file.hi[0] = in_file.lo[0] + 1;
                          for (size_t d = 0; d < crop_.size(); ++d) {
                            const int64_t origin = origin_of(index, d);
                            in_file.lo[d + 2] += origin;
                            in_file.hi[d + 2] += origin;
                          }
                          local.slice(0, row - box.lo[0], row - box.lo[0] + 1)
                              .copy_from(io::read_hyperslab(options_.data, dataset, in_file, as_,
                                                            local.device()));
                        }
                      });
  }

 private:
  /// The dataset row of the run's `index`-th sample.
  int64_t sample_of(int64_t index) {
    const int64_t epoch = index / samples_, position = index % samples_;
    if (options_.shuffle == 0) return position;
    if (epoch != order_epoch_) {
      order_.resize(static_cast<size_t>(samples_));
      for (int64_t i = 0; i < samples_; ++i) order_[static_cast<size_t>(i)] = i;
      uint64_t state = mix64(options_.seed ^ mix64(static_cast<uint64_t>(epoch)));
      for (int64_t i = samples_ - 1; i > 0; --i) {
        state = mix64(state);
        std::swap(order_[static_cast<size_t>(i)],
                  order_[static_cast<size_t>(state % static_cast<uint64_t>(i + 1))]);
      }
      order_epoch_ = epoch;
    }
    return order_[static_cast<size_t>(position)];
  }

  /// Where the crop of the run's `index`-th sample starts along spatial dim `d`.
  int64_t origin_of(int64_t index, size_t d) const {
    const uint64_t positions = static_cast<uint64_t>(data_extent_[d] - crop_[d] + 1);
    const uint64_t draw = mix64(mix64(options_.seed + 0x5851F42D4C957F2Dull) ^
                                mix64(static_cast<uint64_t>(index) * 8 + d));
    return static_cast<int64_t>(draw % positions);
  }

  const TrainOptions& options_;
  DeviceMesh mesh_;
  int64_t samples_;
  DType as_;
  std::vector<int64_t> crop_, data_extent_;
  std::vector<ShardSpec> specs_;
  std::vector<int64_t> order_;
  int64_t order_epoch_ = -1;
};

/// The trained values: the model's own parameters (DDP), or, with --parallel fsdp|hybrid or a
/// bf16 model, separate master parameters that the optimizer updates (sharded over the shard dim,
/// and f32 for a bf16 model). Before each step the masters are gathered into the model's
/// parameters; in backward each model parameter's gradient, still a Partial sum over the mesh
/// dims that shard the activations, goes straight into its master's layout (a reduce-scatter
/// over the shard dim and an all-reduce over the others, in one redistribute whose reduction
/// order does not depend on the rank, so replicas stay bit-identical).
///
/// `mesh` is the model's: the whole ("dp", "tp"?, domain..) mesh, or with --pp one stage's mesh
/// (one Masters per stage a rank holds; pp itself shards nothing). A tensor-parallel weight keeps
/// its tp placement, and the shard dim splits the first tensor dim tp does not split (one mesh dim
/// per tensor dim: a [out, in] weight split on out over tp is split on in over dp); a 1-d weight
/// that tp already splits stays replicated over dp.
///
/// Hybrid sharding views the mesh as ("dp_replicate", "dp_shard", ..) (DeviceMesh::split: the same
/// ranks in the same order): dp rank i is (i / S, i % S), so the batch stays split over all of dp
/// while the masters are sharded over S ranks only.
class Masters {
 public:
  Masters(nn::OnnxModel& model, const DeviceMesh& mesh, const TrainOptions& options,
          DType master_dtype) {
    const bool hybrid = options.parallel == "hybrid";
    mesh_ = hybrid ? mesh.split(0, {options.dp / options.dp_shard, options.dp_shard},
                                {"dp_replicate", "dp_shard"})
                   : mesh;
    const int shard_dim = hybrid ? 1 : 0;
    NoGrad no_grad;
    for (const auto& [name, parameter] : model.named_parameters()) {
      // A copy: the masters never share storage with the model.
      const ShardTensor on_mesh = on_master_mesh(parameter.tensor(), master_dtype, true);
      std::vector<Placement> placements = on_mesh.placements();
      const Shape& shape = on_mesh.global_shape();
      if (options.sharded_parameters()) {
        for (int dim = 0; dim < static_cast<int>(shape.size()); ++dim) {
          if (on_mesh.spec().mesh_dim_sharding(dim) >= 0) continue;
          placements[shard_dim] = Placement::shard(dim);
          break;
        }
      }
      model_.push_back(parameter);
      masters_.emplace_back(on_mesh.redistribute(placements), name);
    }
    for (size_t k = 0; k < model_.size(); ++k)
      sinks_.push_back(set_grad_sink(model_[k].tensor().id(), [this, k](const ShardTensor& grad) {
        masters_[k].accumulate_grad(on_master_mesh(grad, masters_[k].tensor().dtype()));
      }));
  }
  Masters(const Masters&) = delete;
  Masters& operator=(const Masters&) = delete;

  const std::vector<Parameter>& parameters() const { return masters_; }

  /// Collective: every model parameter takes its master's current values, in its own layout
  /// (replicated, or its tensor-parallel shard).
  void gather_into_model() {
    NoGrad no_grad;
    for (size_t k = 0; k < model_.size(); ++k) {
      const ShardTensor target = on_master_mesh(model_[k].tensor(), masters_[k].tensor().dtype());
      const Tensor local =
          masters_[k].tensor().redistribute(target.placements(), target.spec().extents).to_local();
      model_[k].assign_local(local.to_dtype(model_[k].tensor().dtype()));
    }
  }

 private:
  /// A tensor on the model's mesh (a gradient or a parameter) as the same tensor on the masters'
  /// mesh, in `dtype`: with hybrid sharding the dp placement holds for both dims it was split
  /// into.
  ShardTensor on_master_mesh(const ShardTensor& value, DType dtype, bool copy = false) const {
    Tensor local = value.to_local().to_dtype(dtype);
    if (copy) local = local.clone();
    std::vector<Placement> placements = value.placements();
    std::vector<std::vector<int64_t>> extents = value.spec().extents;
    if (mesh_->ndim() != value.mesh().ndim()) {
      placements.insert(placements.begin(), placements.front());
      if (!extents.empty()) extents.insert(extents.begin(), std::vector<int64_t>{});
    }
    return ShardTensor(
        std::move(local), *mesh_,
        ShardSpec::make(value.global_shape(), mesh_->shape(), placements, extents, kOp));
  }

  std::optional<DeviceMesh> mesh_;
  std::vector<Parameter> model_, masters_;
  std::vector<GradHookHandle> sinks_;
};

std::unique_ptr<optim::Optimizer> make_optimizer(const TrainOptions& options,
                                                 std::vector<Parameter> parameters) {
  if (options.optimizer == "sgd")
    return std::make_unique<optim::Sgd>(
        std::move(parameters),
        optim::SgdOptions{
            .lr = options.lr, .momentum = options.momentum, .weight_decay = options.weight_decay});
  const optim::AdamOptions adam{.lr = options.lr,
                                .weight_decay = options.weight_decay_given
                                                    ? std::optional<double>(options.weight_decay)
                                                    : std::nullopt};
  if (options.optimizer == "adam")
    return std::make_unique<optim::Adam>(std::move(parameters), adam);
  return std::make_unique<optim::AdamW>(std::move(parameters), adam);
}

/// The counters a checkpoint holds besides the step: a resumed run must read the same batches.
std::map<std::string, int64_t> run_counters(const TrainOptions& options, int64_t step) {
  std::map<std::string, int64_t> counters{{"step", step},
                                          {"batch", options.batch},
                                          {"shuffle", options.shuffle},
                                          {"seed", static_cast<int64_t>(options.seed)}};
  const std::vector<int64_t> crop =
      options.crop.empty() ? std::vector<int64_t>{} : parse_list(options.crop);
  counters["crop_dims"] = static_cast<int64_t>(crop.size());
  for (size_t d = 0; d < crop.size(); ++d) counters[fmt::format("crop_{}", d)] = crop[d];
  return counters;
}

/// The checkpoint of `step`: one file, or with a pipeline one per pp rank (`pp_rank` of `pp`),
/// each holding the parameters and optimizer state of that rank's stages.
std::string checkpoint_file(const std::string& dir, int64_t step, int pp = 1, int pp_rank = 0) {
  return pp > 1 ? fmt::format("{}/step_{:08}.pp{}.h5", dir, step, pp_rank)
                : fmt::format("{}/step_{:08}.h5", dir, step);
}

/// Collective: the step of the newest checkpoint in `dir` whose files are all there (with --pp P:
/// step_N.pp0.h5 .. step_N.pp{P-1}.h5). Rank 0 looks; an AgreedError when there is none.
int64_t newest_checkpoint(Comm& world, const std::string& dir, int pp) {
  int64_t newest = -1;
  std::optional<std::string> problem;
  if (world.rank() == 0) {
    const std::regex pattern(pp > 1 ? "step_([0-9]{8})\\.pp0\\.h5" : "step_([0-9]{8})\\.h5");
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
      std::smatch match;
      const std::string name = entry.path().filename().string();
      if (!std::regex_match(name, match, pattern)) continue;
      const int64_t step = std::stoll(match[1].str());
      bool complete = true;
      for (int r = 1; r < pp; ++r)
        complete = complete && std::filesystem::exists(checkpoint_file(dir, step, pp, r));
      if (complete) newest = std::max<int64_t>(newest, step);
    }
    if (newest < 0)
      problem = pp > 1 ? fmt::format(
                             "--resume: no complete checkpoint of --pp {} (step_NNNNNNNN.pp0.h5 .. "
                             ".pp{}.h5) in --checkpoint {}",
                             pp, pp - 1, dir)
                       : fmt::format(
                             "--resume: no checkpoint (step_NNNNNNNN.h5) in --checkpoint {}", dir);
  }
  agree_on_error(world, kOp, problem);
  world.broadcast(&newest, 1, DType::i64, 0);
  return newest;
}

/// Collective over `mesh` (the model's, or with --pp this rank's stage mesh; its first rank
/// writes): the parameters, the optimizer state (none: a stage without parameters) and the
/// run's counters.
void save_checkpoint(const std::string& file, const DeviceMesh& mesh,
                     const std::vector<Parameter>& parameters, const optim::Optimizer* optimizer,
                     const std::map<std::string, int64_t>& run) {
  std::vector<std::pair<std::string, ShardTensor>> tensors;
  for (const Parameter& parameter : parameters)
    tensors.emplace_back("model/" + parameter.name(), parameter.tensor());
  if (optimizer)
    for (const auto& [key, value] : optimizer->state_dict())
      tensors.emplace_back("optim/" + key, value);
  // The counters on the parameters' mesh (the masters' may be a split of `mesh`): one
  // communicator for the whole file.
  const DeviceMesh& on = parameters.empty() ? mesh : parameters.front().tensor().mesh();
  const std::vector<Placement> replicated(on.ndim(), Placement::replicate());
  for (const auto& [name, value] : run)
    tensors.emplace_back(
        "run/" + name,
        ShardTensor::distribute(Tensor::from_values<int64_t>({}, std::vector<int64_t>{value}), on,
                                replicated));
  io::save_checkpoint(file, tensors);
}

/// Collective over `mesh` (as save_checkpoint): restores the parameters and optimizer state of
/// `file` (any layout it was saved in) and returns its step. Every check comes before any value
/// is written: a missing or unknown parameter, a shape mismatch, or counters of another data
/// order are one error on every rank.
int64_t load_checkpoint(const std::string& file, const DeviceMesh& mesh,
                        const std::vector<Parameter>& parameters, optim::Optimizer* optimizer,
                        const TrainOptions& options) {
  const DeviceMesh& on = parameters.empty() ? mesh : parameters.front().tensor().mesh();
  std::map<std::string, ShardTensor> model, state;
  std::map<std::string, int64_t> run;
  for (const auto& [name, tensor] : io::load_checkpoint(file, on)) {
    if (name.rfind("model/", 0) == 0) {
      model.emplace(name.substr(6), tensor);
    } else if (name.rfind("optim/", 0) == 0) {
      state.emplace(name.substr(6), tensor);
    } else {
      check_arg(name.rfind("run/", 0) == 0 && tensor.global_shape().empty(), kOp,
                "'{}' in {} is not part of a training checkpoint", name, file);
      run[name.substr(4)] =
          static_cast<int64_t>(tensor.full_tensor().to(Device::cpu()).item_as_double({}));
    }
  }
  for (const auto& [name, value] : run_counters(options, 0)) {
    if (name == "step") continue;
    check_arg(run.count(name) == 1 && run.at(name) == value, kOp,
              "--resume: {} was written with --{} {}, this run has {} (the batches would differ)",
              file, name, run.count(name) ? fmt::format("{}", run.at(name)) : "?", value);
  }
  check_arg(run.count("step") == 1, kOp, "{} holds no run/step", file);
  check_arg(model.size() == parameters.size(), kOp, "{} holds {} parameters, the model has {}",
            file, model.size(), parameters.size());
  for (const Parameter& parameter : parameters) {
    const auto found = model.find(parameter.name());
    check_arg(found != model.end(), kOp, "{} lacks the model's parameter '{}'", file,
              parameter.name());
    check_arg(found->second.global_shape() == parameter.tensor().global_shape(), kOp,
              "'{}' in {} has shape {}, the model's parameter has {}", parameter.name(), file,
              found->second.global_shape(), parameter.tensor().global_shape());
  }
  if (optimizer)
    optimizer->check_state_dict(state);
  else
    check_arg(state.empty(), kOp, "{} holds optimizer state, this rank's stages have no parameters",
              file);
  for (Parameter parameter : parameters) {
    const ShardTensor& tensor = parameter.tensor();
    const ShardTensor moved =
        model.at(parameter.name()).redistribute(tensor.placements(), tensor.spec().extents);
    parameter.assign_local(moved.to_local().to_dtype(tensor.dtype()));
  }
  if (optimizer) optimizer->load_state_dict(state);
  return run.at("step");
}

/// A loss for printing: "n/a" for the NaN of estimate mode (shape-only tensors have no value).
std::string loss_text(double loss, int digits) {
  return std::isnan(loss) ? std::string("n/a") : fmt::format("{:.{}g}", loss, digits);
}

/// Writes `[{"step": 1, "loss": ...}, ...]` with every loss to full double precision.
void write_losses(const std::string& file, const std::vector<std::pair<int64_t, double>>& losses) {
  std::string text = "[";
  for (size_t i = 0; i < losses.size(); ++i)
    text += fmt::format("{}\n {{\"step\": {}, \"loss\": {:.17g}}}", i ? "," : "", losses[i].first,
                        losses[i].second);
  text += "\n]\n";
  const std::string temporary = fmt::format("{}.tmp-{}", file, static_cast<long>(::getpid()));
  {
    std::ofstream out(temporary);
    out << text;
    check_arg(out.good(), kOp, "--losses-out {}: cannot write", file);
  }
  std::filesystem::rename(temporary, file);
}

/// One pipeline stage: the OnnxModel of the stage's subgraph on the stage's mesh. Its parameters
/// stay the model's own (the optimizer and reducer take them from model()), so the Module holds
/// none itself.
class OnnxStage final : public nn::Module {
 public:
  OnnxStage(io::OnnxGraph graph, const DeviceMesh& mesh, DType dtype,
            const std::map<std::string, std::vector<Placement>>& placements,
            const std::vector<nn::OnnxFusedProjection>& fused)
      : model_(std::move(graph), mesh, dtype, placements, fused) {}
  ShardTensor forward(const ShardTensor& x) override { return model_.forward(x); }
  nn::OnnxModel& model() { return model_; }

 private:
  nn::OnnxModel model_;
};

/// The placements of the tensor-parallel plan's weights on `mesh` (Shard(dim) over its "tp" dim;
/// none without one).
std::map<std::string, std::vector<Placement>> tensor_parallel_placements(
    const nn::OnnxTensorParallelPlan& plan, const DeviceMesh& mesh) {
  std::map<std::string, std::vector<Placement>> placements;
  const auto& names = mesh.names();
  const auto tp = std::find(names.begin(), names.end(), "tp");
  if (tp == names.end()) return placements;
  for (const auto& [name, dim] : plan.sharded) {
    std::vector<Placement> entry(mesh.ndim(), Placement::replicate());
    entry[tp - names.begin()] = Placement::shard(dim);
    placements[name] = entry;
  }
  return placements;
}

/// Collective over the world: writes the trained network of a pipelined run as ONNX. Each
/// parameter and buffer lives on the stage that uses it: that stage's ranks gather it on their
/// mesh (tp shards included) and its first rank broadcasts it to every rank; rank 0 writes the
/// whole graph with the same initializer names (io::write_onnx).
void save_pipelined_model(Comm& world, const io::OnnxGraph& graph,
                          const std::vector<io::OnnxGraph>& stage_graphs,
                          const std::map<int, std::shared_ptr<OnnxStage>>& held, int pp,
                          DType dtype, const std::string& file) {
  // Every rank lists the same (name, owner stage) pairs: the float initializers each stage reads
  // in a data position, the first stage that reads one owning it.
  std::vector<std::pair<std::string, int>> owned;
  std::set<std::string> seen;
  for (size_t s = 0; s < stage_graphs.size(); ++s) {
    std::set<std::string> data_inputs;
    for (const io::OnnxNode& node : stage_graphs[s].nodes)
      for (size_t k = 0; k < node.inputs.size(); ++k)
        if (!nn::onnx::is_constant_position(node.op_type, k)) data_inputs.insert(node.inputs[k]);
    for (const auto& [name, tensor] : stage_graphs[s].initializers)
      if (is_floating(tensor.dtype()) && data_inputs.count(name) && seen.insert(name).second)
        owned.emplace_back(name, static_cast<int>(s));
  }
  const int ranks_per_stage = world.size() / pp;
  std::vector<std::pair<std::string, Tensor>> values;
  for (const auto& [name, stage] : owned) {
    const Shape shape = [&] {
      for (const auto& [initializer, tensor] : graph.initializers)
        if (initializer == name) return tensor.shape();
      return Shape{};
    }();
    Tensor value = Tensor::empty(shape, dtype, Device::cpu());
    const auto holder = held.find(stage);
    if (holder != held.end())  // in the initializer's layout (a fused projection's unstacked)
      value.copy_from(
          holder->second->model().full_initializer(name).to(Device::cpu()).to_dtype(dtype));
    world.broadcast(value.raw_data(), static_cast<size_t>(value.numel()), dtype,
                    (stage % pp) * ranks_per_stage);
    values.emplace_back(name, value);
  }
  std::optional<std::string> problem;
  if (world.rank() == 0) {
    try {
      io::write_onnx(graph, values, file);
    } catch (const Error& error) {
      problem = untagged(error);
    }
  }
  agree_on_error(world, "onnx", problem);
}

void run_train(std::shared_ptr<Comm> world, const TrainOptions& options) {
  const bool root = world->rank() == 0;
  std::vector<int> domain;
  DType dtype = DType::f32;
  agreed_everywhere(*world, kOp, [&] {
    domain = parse_mesh(options.layout.mesh);
    check_options(options, domain, world->size());
    dtype = dtype_from_name(options.dtype);
    if (!options.plot.empty()) plot::check_available();
    if (root) {
      for (const std::string* file : {&options.losses_out, &options.save_model})
        if (!file->empty()) io::check_output_path(kOp, *file);
      // The directory is made by the first checkpoint: a refused run leaves nothing behind.
      if (!options.checkpoint.empty()) {
        if (std::filesystem::exists(options.checkpoint)) {
          check_arg(std::filesystem::is_directory(options.checkpoint), kOp,
                    "--checkpoint {} is not a directory", options.checkpoint);
          io::check_output_path(kOp, checkpoint_file(options.checkpoint, 0));
        } else {
          io::check_output_path(kOp, options.checkpoint);
        }
      }
    }
  });
  // The mesh: pp outermost, then dp, tp, the domain dims (pp and tp only when > 1).
  std::vector<int> mesh_shape;
  std::vector<std::string> names;
  if (options.pp > 1) {
    mesh_shape.push_back(options.pp);
    names.push_back("pp");
  }
  mesh_shape.push_back(options.dp);
  names.push_back("dp");
  if (options.tp > 1) {
    mesh_shape.push_back(options.tp);
    names.push_back("tp");
  }
  for (size_t m = 0; m < domain.size(); ++m) {
    mesh_shape.push_back(domain[m]);
    names.push_back(fmt::format("domain{}", m));
  }
  const DeviceMesh mesh(world, mesh_shape, names);

  // bf16 computes in bf16 with f32 master weights and an f32 loss; the data is read as f32.
  const DType read_dtype = dtype == DType::bf16 ? DType::f32 : dtype;
  io::OnnxGraph graph;
  agreed_everywhere(*world, "onnx", [&] { graph = io::read_onnx(options.model); });
  agreed_everywhere(*world, kOp, [&] {
    check_arg(graph.inputs.size() == 1 && graph.outputs.size() == 1, kOp,
              "--model {} has {} inputs and {} outputs; training takes one of each", options.model,
              graph.inputs.size(), graph.outputs.size());
  });

  // Model parallelism: the tensor-parallel plan and the pipeline's cuts, from the graph alone.
  nn::OnnxTensorParallelPlan tp_plan;
  std::vector<nn::OnnxCutPoint> cuts;
  std::vector<io::OnnxGraph> stage_graphs;
  agreed_everywhere(*world, kOp, [&] {
    if (options.tp > 1) {
      tp_plan = nn::onnx_tensor_parallel_plan(graph, options.tp);
      // Attention whose heads tp does not divide is refused: its heads cannot be split, and
      // leaving the block replicated would hide that the run is not tensor parallel there.
      for (const auto& pattern : tp_plan.skipped)
        check_arg(pattern.kind != "attention", kOp,
                  "--tp {}: the attention of {} from {} to {} has {} heads, which {} ranks do not "
                  "divide (tp must divide the heads)",
                  options.tp, options.model, pattern.first, pattern.second, pattern.width,
                  options.tp);
      std::vector<std::string> skipped;
      for (const auto& pattern : tp_plan.skipped)
        skipped.push_back(fmt::format("{} {} -> {} of width {}", pattern.kind, pattern.first,
                                      pattern.second, pattern.width));
      check_arg(
          !tp_plan.patterns.empty(), kOp,
          "--tp {}: {} has no tensor-parallel pattern (MatMul/Gemm .. MatMul/Gemm or Conv "
          ".. Conv through elementwise ops) whose width {} ranks divide{}",
          options.tp, options.model, options.tp,
          (skipped.empty() ? std::string() : fmt::format(" (found {})", fmt::join(skipped, "; "))) +
              (tp_plan.notes.empty() ? std::string()
                                     : fmt::format("; {}", fmt::join(tp_plan.notes, "; "))));
    }
    if (options.pp > 1) {
      if (options.stage_cuts.empty()) {
        cuts = nn::balanced_stage_cuts(
            graph, options.stages(), kOp,
            options.schedule == "interleaved"
                ? fmt::format("--pp {} x --chunks {}", options.pp, options.chunks_per_rank())
                : fmt::format("--pp {}", options.pp));
      } else {
        std::vector<std::string> tensors;
        for (size_t start = 0;;) {
          const size_t comma = options.stage_cuts.find(',', start);
          tensors.push_back(options.stage_cuts.substr(start, comma - start));
          if (comma == std::string::npos) break;
          start = comma + 1;
        }
        check_arg(static_cast<int>(tensors.size()) == options.stages() - 1, kOp,
                  "--stage-cuts names {} cut(s) for {} stages (--pp {} x {} chunk(s) per rank "
                  "need {})",
                  tensors.size(), options.stages(), options.pp, options.chunks_per_rank(),
                  options.stages() - 1);
        cuts = nn::named_stage_cuts(graph, tensors, kOp);
      }
      for (int s = 0; s < options.stages(); ++s)
        stage_graphs.push_back(nn::onnx_stage_graph(graph, cuts, s));
    }
  });

  // What looked like attention but stays replicated over tp (the reason in --json too).
  if (root)
    for (const std::string& note : tp_plan.notes)
      std::fprintf(stderr, "tessera: note: [train] --tp %d: %s\n", options.tp, note.c_str());
  std::optional<nn::OnnxModel> model;              // unpipelined
  std::unique_ptr<nn::Pipeline> pipe;              // --pp > 1
  std::map<int, std::shared_ptr<OnnxStage>> held;  // this rank's stages
  agreed_everywhere(*world, "onnx", [&] {
    if (options.pp == 1) {
      model.emplace(graph, mesh, dtype, tensor_parallel_placements(tp_plan, mesh), tp_plan.fused);
      return;
    }
    std::vector<nn::LayerBuilder> layers;
    for (int s = 0; s < options.stages(); ++s)
      layers.push_back([&, s](const DeviceMesh& stage_mesh) {
        auto stage = std::make_shared<OnnxStage>(stage_graphs[s], stage_mesh, dtype,
                                                 tensor_parallel_placements(tp_plan, stage_mesh),
                                                 tp_plan.fused);
        held[s] = stage;
        return stage;
      });
    std::vector<int> starts;
    for (int s = 0; s < options.stages(); ++s) starts.push_back(s);
    pipe = std::make_unique<nn::Pipeline>(
        mesh, std::move(layers),
        nn::PipelineOptions{.dim = "pp",
                            .schedule = nn::parse_schedule(options.schedule),
                            .micro_batches = options.micro_batches,
                            .batch_dim = 0,
                            .stage_starts = starts});
  });
  agreed_everywhere(*world, kOp, [&] {
    const bool has_parameters =
        model ? !model->named_parameters().empty()
              : std::any_of(graph.initializers.begin(), graph.initializers.end(),
                            [](const auto& entry) { return is_floating(entry.second.dtype()); });
    check_arg(has_parameters, kOp, "--model {} has no parameters to train", options.model);
  });
  const DataShapes shapes = survey_data(*world, graph.inputs[0], options);

  // The data lives on the model's mesh, or with a pipeline on the stage meshes of the first
  // stage (the input) and the last (the target).
  const DeviceMesh& data_mesh = pipe ? pipe->stage_mesh() : mesh;
  const bool reads_data = !pipe || pipe->holds_first_stage() || pipe->holds_last_stage();
  const int pp_rank = pipe ? mesh.coord()[0] : 0;
  BatchLayout layout;
  std::unique_ptr<BatchSource> batches;
  agreed_everywhere(*world, kOp, [&] {
    layout = batch_layout(options, domain, static_cast<int64_t>(shapes.input.size()));
    check_arg(shapes.target.size() == shapes.input.size(), kOp,
              "--target '{}' has shape {}, --input '{}' has {}: the target must be laid out like "
              "the input (same rank)",
              options.target, shapes.target, options.input, shapes.input);
  });
  if (!options.crop.empty()) {
    agreed_everywhere(*world, kOp, [&] {
      if (reads_data)
        batches = std::make_unique<CropBatches>(options, data_mesh, layout, shapes, read_dtype);
    });
  } else if (options.shuffle == 1) {
    if (reads_data)
      batches = std::make_unique<ShuffledBatches>(options, data_mesh, layout, read_dtype);
  } else {
    agreed_everywhere(*world, kOp, [&] {
      if (reads_data)
        batches =
            std::make_unique<FileOrderBatches>(options, data_mesh, layout, shapes, read_dtype);
    });
  }

  const bool use_masters = options.sharded_parameters() || dtype == DType::bf16;
  // One Masters per model: the whole model, or each stage this rank holds (on its stage mesh).
  std::vector<std::unique_ptr<Masters>> masters;
  std::vector<Parameter> trained;
  if (use_masters) {
    agreed_everywhere(*world, kOp, [&] {
      if (model) masters.push_back(std::make_unique<Masters>(*model, mesh, options, read_dtype));
      for (const auto& [stage, held_stage] : held)
        masters.push_back(std::make_unique<Masters>(held_stage->model(), pipe->stage_mesh(),
                                                    options, read_dtype));
    });
    for (const auto& stage_masters : masters)
      trained.insert(trained.end(), stage_masters->parameters().begin(),
                     stage_masters->parameters().end());
  } else if (model) {
    for (const auto& [name, parameter] : model->named_parameters()) trained.push_back(parameter);
  } else {
    for (const auto& [stage, held_stage] : held)
      for (const auto& [name, parameter] : held_stage->model().named_parameters())
        trained.push_back(parameter);
  }
  // A pipeline rank whose stages hold no parameter (only parameter-free ops) has nothing to update.
  std::unique_ptr<optim::Optimizer> optimizer =
      trained.empty() ? nullptr : make_optimizer(options, trained);
  // The reducer takes every gradient that is Partial over dp or the domain dims: one bucketed
  // all-reduce over the joint group instead of one blocking all-reduce per parameter from the
  // tape (the loss is a mean over the global batch and grid, so both reductions are sums).
  std::optional<nn::GradReducer> reducer;
  if (!use_masters && (options.dp > 1 || mesh_size(domain) > 1) && !trained.empty())
    reducer.emplace(trained);
  if (pipe && reducer) pipe->set_grad_reducer(&*reducer);
  const auto loss_of = [&](const ShardTensor& y, const ShardTensor& target) {
    return options.loss == "mse" ? ops::mse_loss(y, target)
                                 : ops::mean(ops::abs(ops::sub(y, target)));
  };

  int64_t first_step = 0;
  if (options.resume) {
    const int64_t newest = newest_checkpoint(*world, options.checkpoint, options.pp);
    const std::string file = checkpoint_file(options.checkpoint, newest, options.pp, pp_rank);
    agreed_everywhere(*world, kOp, [&] {
      first_step = load_checkpoint(file, data_mesh, trained, optimizer.get(), options);
    });
    agreed_everywhere(*world, kOp, [&] {
      check_arg(first_step <= options.steps, kOp, "--resume: {} is at step {}, beyond --steps {}",
                file, first_step, options.steps);
    });
  }

  ProgressBar bar;
  const bool terminal = root && ::isatty(STDERR_FILENO);
  std::vector<std::pair<int64_t, double>> losses;
  std::vector<double> step_seconds, bubble_fractions;
  host_allocator_reset_peak();
  if (!options.plot.empty())
    agreed_everywhere(*world, kOp, [&] {
      if (root) plot::prepare_plot_directory(options.plot);
    });
  // Rank 0 redraws DIR/loss.png every 10 steps and at the end; a plot that fails is reported
  // and training goes on.
  const auto draw_losses = [&] {
    plot::LossCurve curve{.label = "train", .step = {}, .loss = {}};
    for (const auto& [step, loss] : losses) {
      curve.step.push_back(static_cast<double>(step));
      curve.loss.push_back(loss);
    }
    try {
      plot::write_loss_plot(options.plot, curve);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "tessera: warning: losses not plotted: %s\n", error.what());
    }
  };
  const double start = now_seconds();
  for (int64_t step = first_step; step < options.steps; ++step) {
    const double step_start = now_seconds();
    // One `step` event per training step (read, forward, backward, update): what the cost model
    // takes the median of.
    std::optional<trace::Span> step_span(std::in_place, "step", fmt::format("train step {}", step));
    if (optimizer) optimizer->zero_grad();
    for (const auto& stage_masters : masters) stage_masters->gather_into_model();
    double loss_value = 0;
    if (pipe) {
      agreed_everywhere(*world, kOp, [&] {
        std::optional<ShardTensor> x, target;
        if (reads_data) std::tie(x, target) = batches->batch(step);
        if (x && dtype == DType::bf16) {
          NoGrad no_grad;
          x = ops::cast(*x, DType::bf16);
        }
        // A target unlike the output is seen by the last stage's ranks only: the pipeline
        // carries their error to every stage (nn::Pipeline::step), so every rank raises it
        // before any update.
        const auto checked_loss = [&](const ShardTensor& output, const ShardTensor& t) {
          const ShardTensor y = dtype == DType::bf16 ? ops::cast(output, DType::f32) : output;
          check_arg(y.global_shape() == t.global_shape(), kOp,
                    "the model's output for a micro-batch of --input '{}' has shape {}, the "
                    "micro-batch of --target '{}' has {}",
                    options.input, y.global_shape(), options.target, t.global_shape());
          return loss_of(y, t);
        };
        loss_value = pipe->step(x, target, checked_loss);
      });
      bubble_fractions.push_back(pipe->stats().bubble_fraction());
    } else
      agreed_everywhere(*world, kOp, [&] {
        auto [x, target] = batches->batch(step);
        if (dtype == DType::bf16) {
          NoGrad no_grad;
          x = ops::cast(x, DType::bf16);
        }
        Tape tape;
        ShardTensor y = model->forward(x);
        if (dtype == DType::bf16) y = ops::cast(y, DType::f32);
        check_arg(y.global_shape() == target.global_shape(), kOp,
                  "the model's output for a batch of --input '{}' has shape {}, the batch of "
                  "--target '{}' has {}",
                  options.input, y.global_shape(), options.target, target.global_shape());
        const ShardTensor loss = loss_of(y, target);
        tape.backward(loss);
        // Estimate mode: the loss has no value (NaN, printed as n/a); the gather still runs.
        const Tensor whole = loss.full_tensor().to(Device::cpu());
        loss_value = whole.is_shape_only() ? std::nan("") : whole.item_as_double({});
      });
    if (reducer) reducer->finish();
    if (optimizer) optimizer->step();
    step_span.reset();
    step_seconds.push_back(now_seconds() - step_start);
    losses.emplace_back(step + 1, loss_value);

    const int64_t done = step + 1;
    if (!options.checkpoint.empty() &&
        ((options.every > 0 && done % options.every == 0) || done == options.steps)) {
      // Made by the ranks that write (each stage's first rank); error_code: they may race.
      if (data_mesh.rank() == 0) {
        std::error_code error;
        std::filesystem::create_directories(options.checkpoint, error);
      }
      save_checkpoint(checkpoint_file(options.checkpoint, done, options.pp, pp_rank), data_mesh,
                      trained, optimizer.get(), run_counters(options, done));
    }
    if (!root) continue;
    if (!options.plot.empty() && (done % 10 == 0 || done == options.steps)) draw_losses();
    const double per_step = median(step_seconds);
    const double samples_per_second =
        per_step > 0 ? static_cast<double>(options.batch) / per_step : 0;
    std::string detail =
        fmt::format("loss {}, {:.4g} samples/s, ETA {}", loss_text(loss_value, 6),
                    samples_per_second, format_eta(per_step * (options.steps - done)));
    if (pipe) detail += fmt::format(", bubble {:.1f}%", 100 * bubble_fractions.back());
    if (terminal)
      bar(done, options.steps, detail);
    else if (!options.json)
      fmt::print("step {}/{}: {}\n", done, options.steps, detail);
  }
  const double total_seconds = now_seconds() - start;
  const int local_ranks = world->backend() == "local" ? world->size() : 1;
  const double peak_bytes_per_rank =
      static_cast<double>(host_allocator_stats().peak_in_use) / local_ranks;

  for (const auto& stage_masters : masters) stage_masters->gather_into_model();
  if (!options.save_model.empty())
    agreed_everywhere(*world, "onnx", [&] {
      if (model)
        model->save(options.save_model);
      else
        save_pipelined_model(*world, graph, stage_graphs, held, options.pp, dtype,
                             options.save_model);
    });
  // Rank 0's share of the values the optimizer updates: the model (DDP), its tp shard, or the
  // masters' shard of it (FSDP, hybrid).
  int64_t trained_elements = 0;
  for (const Parameter& parameter : trained)
    trained_elements += parameter.tensor().to_local().numel();
  // Rank 0's piece of each parameter the tp plan shards, and its whole size (the model's own
  // parameters, not the masters: what tp alone divides).
  nlohmann::json tp_elements = nlohmann::json::object();
  const auto count_tp_elements = [&](const nn::OnnxModel& held_model) {
    for (const auto& [name, parameter] : held_model.named_parameters())
      if (tp_plan.sharded.count(name))
        tp_elements[name] = {{"local", parameter.tensor().to_local().numel()},
                             {"total", shape_numel(parameter.tensor().global_shape())}};
  };
  if (model) count_tp_elements(*model);
  for (const auto& [stage, held_stage] : held) count_tp_elements(held_stage->model());
  if (!root) return;
  if (!options.losses_out.empty()) write_losses(options.losses_out, losses);
  const double step_median = median(step_seconds);
  const double samples_per_second =
      step_median > 0 ? static_cast<double>(options.batch) / step_median : 0;
  const bool ran = !losses.empty();
  const double final_loss = ran ? losses.back().second : 0;
  if (options.json) {
    nlohmann::json json = {
        {"command", "train"},
        {"model", options.model},
        {"data", options.data},
        {"loss", options.loss},
        {"optimizer", options.optimizer},
        {"parallel", options.parallel},
        {"dp", options.dp},
        {"pp", options.pp},
        {"tp", options.tp},
        {"mesh", mesh_shape},
        {"mesh_dims", names},
        {"ranks", world->size()},
        {"backend", world->backend()},
        {"dtype", options.dtype},
        {"device", options.device},
        {"batch", options.batch},
        {"steps", options.steps},
        {"first_step", first_step},
        {"steps_run", static_cast<int64_t>(losses.size())},
        {"step_seconds", step_median},
        {"samples_per_second", samples_per_second},
        {"peak_bytes_per_rank", peak_bytes_per_rank},
        {"trained_elements", trained_elements},
        {"total_seconds", total_seconds},
    };
    json["final_loss"] =
        ran && !std::isnan(final_loss) ? nlohmann::json(final_loss) : nlohmann::json(nullptr);
    if (options.tp > 1) {
      nlohmann::json patterns = nlohmann::json::array();
      for (const auto& pattern : tp_plan.patterns)
        patterns.push_back({{"kind", pattern.kind},
                            {"first", pattern.first},
                            {"second", pattern.second},
                            {"width", pattern.width}});
      json["tp_patterns"] = patterns;
      json["tp_sharded_parameters"] = tp_plan.sharded.size();
      json["tp_sharded_elements"] = tp_elements;
      json["tp_notes"] = tp_plan.notes;
    }
    if (pipe) {
      std::vector<std::string> cut_names;
      for (const nn::OnnxCutPoint& cut : cuts) cut_names.push_back(cut.tensor);
      json["schedule"] = options.schedule;
      json["micro_batches"] = options.micro_batches;
      json["chunks"] = options.chunks_per_rank();
      json["stages"] = options.stages();
      json["stage_cuts"] = cut_names;
      // Rank 0's share of each step spent waiting on other stages (median over the steps), and
      // the schedule's ideal (p-1)/(m+p-1) (interleaved: (p-1)/(vm+p-1)).
      json["bubble_fraction"] = median(bubble_fractions);
      json["ideal_bubble_fraction"] =
          nn::ideal_bubble_fraction(nn::parse_schedule(options.schedule), options.pp,
                                    options.micro_batches, options.chunks_per_rank());
    }
    fmt::print("{}\n", json.dump());
    return;
  }
  const std::string model_parallel =
      (options.pp > 1
           ? fmt::format(", pp {} ({} x {} micro-batches, bubble {:.1f}%)", options.pp,
                         options.schedule, options.micro_batches, 100 * median(bubble_fractions))
           : std::string()) +
      (options.tp > 1 ? fmt::format(", tp {} ({} pattern(s))", options.tp, tp_plan.patterns.size())
                      : std::string());
  fmt::print(
      "train: {} on mesh {} (dp {}, {}{}), {} backend: steps {}..{} of batch {}, final loss "
      "{}, median step {:.3f} ms, {:.4g} samples/s\n",
      options.model, mesh_shape, options.dp, options.parallel, model_parallel, world->backend(),
      first_step, options.steps, options.batch, ran ? loss_text(final_loss, 17) : std::string("-"),
      step_median * 1e3, samples_per_second);
}

}  // namespace

void register_train(CLI::App& app) {
  auto options = std::make_shared<TrainOptions>();
  auto* command = app.add_subcommand(
      "train", "Train a network exported from PyTorch (ONNX) on HDF5 samples, sharded");
  command->add_option("--model", options->model, "The ONNX model file (torch.onnx.export)")
      ->required();
  command->add_option("--data", options->data, "HDF5 file of the samples")->required();
  command->add_option("--input", options->input, "Dataset of the inputs, [samples, C, spatial..]")
      ->required();
  command
      ->add_option("--target", options->target,
                   "Dataset of the targets, [samples, C_out, spatial..] (the model's output shape)")
      ->required();
  command->add_option("--steps", options->steps, "Training steps")
      ->check(integer_at_least(1))
      ->required();
  command->add_option("--batch", options->batch, "Samples per step (the global batch)")
      ->check(integer_at_least(1))
      ->required();
  command->add_option("--loss", options->loss, "mse or l1 (the mean over the global batch)")
      ->capture_default_str();
  command->add_option("--optimizer", options->optimizer, "sgd, adam or adamw")
      ->capture_default_str();
  command->add_option("--lr", options->lr, "Learning rate")->required();
  command->add_option("--momentum", options->momentum, "SGD momentum")->capture_default_str();
  command->add_option("--weight-decay", options->weight_decay,
                      "Weight decay (default: 0; adamw 1e-2, as PyTorch)");
  command->add_option("--dp", options->dp, "Data-parallel ranks (a mesh dim before --mesh)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  command
      ->add_option("--parallel", options->parallel,
                   "ddp (replicated parameters, reduced gradients), fsdp (parameters sharded over "
                   "dp) or hybrid (sharded over --dp-shard ranks, replicated over dp / dp-shard)")
      ->capture_default_str();
  command
      ->add_option("--dp-shard", options->dp_shard,
                   "With --parallel hybrid: the ranks of dp each parameter is sharded over")
      ->check(integer_at_least(2));
  add_mesh_options(*command, options->layout, "2,3 (spatial dims of [samples, C, spatial..])");
  command->add_option("--shuffle", options->shuffle, "0: file order; 1: seeded shuffle per epoch")
      ->check(CLI::Range(0, 1))
      ->capture_default_str();
  command->add_option("--seed", options->seed, "Shuffling seed")
      ->check(integer_at_least(0))
      ->capture_default_str();
  command->add_option("--dtype", options->dtype, "f32, f64 or bf16 (f32 master weights)")
      ->capture_default_str();
  command->add_option("--device", options->device, "cpu, cuda or cuda:N")->capture_default_str();
  command->add_option("--checkpoint", options->checkpoint,
                      "Directory of training checkpoints (step_NNNNNNNN.h5)");
  command->add_option("--every", options->every, "A checkpoint every K steps (and at the end)")
      ->check(integer_at_least(1));
  command->add_flag("--resume", options->resume,
                    "Continue from the newest checkpoint in --checkpoint");
  command->add_option("--losses-out", options->losses_out,
                      "JSON file of each step's loss: [{\"step\": 1, \"loss\": ...}, ...]");
  command->add_option("--save-model", options->save_model,
                      "Write the trained network as ONNX (the same initializer names)");
  command->add_flag("--json", options->json, "End with one JSON object of the run's figures");
  command->add_option("--crop", options->crop,
                      "Train on random crops of these spatial extents, e.g. 32,32,32 (positions "
                      "drawn from --seed, the step and the sample)");
  command->add_option("--pp", options->pp, "Pipeline stages (a mesh dim before --dp)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  command
      ->add_option("--tp", options->tp,
                   "Tensor-parallel ranks (a mesh dim after --dp): the MLP and Conv..Conv "
                   "patterns of the graph split their weights over it")
      ->check(integer_at_least(1))
      ->capture_default_str();
  command
      ->add_option("--micro-batches", options->micro_batches,
                   "With --pp: micro-batches per step (dividing every dp rank's batch)")
      ->check(integer_at_least(1))
      ->capture_default_str();
  command->add_option("--schedule", options->schedule, "With --pp: gpipe, 1f1b or interleaved")
      ->capture_default_str();
  command
      ->add_option("--chunks", options->chunks,
                   "With --schedule interleaved: model chunks per pp rank (default 2)")
      ->check(integer_at_least(1));
  command->add_option("--stage-cuts", options->stage_cuts,
                      "With --pp: the activations to cut the graph at, comma separated (default: "
                      "cuts balancing the stages' parameters)");
  command->add_option("--plot", options->plot,
                      "Directory for loss.png, redrawn every 10 steps and at the end");
  add_trace_option(*command);
  command->callback([options, command] {
    options->weight_decay_given = command->count("--weight-decay") > 0;
    options->schedule_given = command->count("--schedule") > 0;
    select_device(options->device);
    int ranks = options->layout.ranks;
    if (ranks == 0) {
      const int64_t size = int64_t{options->pp} * options->dp * options->tp *
                           mesh_size(parse_mesh(options->layout.mesh));
      // Recorded in estimate mode, the world may have up to kMaxSimulatedRanks ranks.
      check_arg(size <= kMaxLocalRanks || estimate::recording_launches(), "cli",
                "--pp {} x --dp {} x --tp {} x --mesh {} has {} ranks; without mpiexec at most {} "
                "local ranks run (give --ranks or use mpiexec)",
                options->pp, options->dp, options->tp, options->layout.mesh, size, kMaxLocalRanks);
      ranks = static_cast<int>(size);
    }
    launch(backend_from_env(), ranks,
           [&](std::shared_ptr<Comm> world) { run_train(world, *options); });
  });
}

}  // namespace tessera::cli
