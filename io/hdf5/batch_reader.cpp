// io::BatchReader (io/hdf5/batch_reader.hpp): per-rank hyperslab reads of each step's samples,
// produced by a background thread into a bounded queue and handed out in order by next().
#include "io/hdf5/batch_reader.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "core/agree.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/shard_tensor_detail.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io_detail.hpp"

namespace tessera::io {

namespace {

constexpr const char* kOp = "BatchReader";

/// splitmix64: spreads (seed, epoch) over the 64-bit seed space of the shuffling generator.
uint64_t mix(uint64_t value) {
  value += 0x9e3779b97f4a7c15ull;
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ull;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebull;
  return value ^ (value >> 31);
}

/// One batch as this rank read it (or the reason it could not).
struct Slot {
  BatchPosition position;
  Tensor local;
  std::optional<std::string> problem;
};

}  // namespace

struct BatchReader::State {
  std::string file, dataset;
  std::optional<DatasetReader> reader;  ///< the dataset, opened once for every read
  DeviceMesh mesh;
  BatchReaderOptions options;
  detail::Header header;
  int dp_mesh_dim = -1;
  std::vector<Placement> placements;          ///< of the batch tensor, per mesh dim
  std::vector<std::vector<int64_t>> extents;  ///< the options' spatial extents, per mesh dim
  int64_t steps = 0;

  // The background reader and its queue of batches, in position order.
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Slot> queue;
  BatchPosition produce_next, consume_next;
  uint64_t generation = 0;  ///< bumped by seek(): batches read for an older one are dropped
  bool stopping = false;
  std::thread thread;

  State(const DeviceMesh& mesh_in) : mesh(mesh_in) {}

  int64_t samples() const { return header.shape[0]; }

  /// Rows of the batch at `step` (the last one is smaller without drop_last).
  int64_t rows_of(int64_t step) const {
    return std::min(options.batch_size, samples() - step * options.batch_size);
  }

  BatchPosition advance(BatchPosition position) const {
    if (++position.step == steps) {
      position.step = 0;
      ++position.epoch;
    }
    return position;
  }

  std::vector<int64_t> order(int64_t epoch) const {
    std::vector<int64_t> indices(static_cast<size_t>(samples()));
    for (size_t i = 0; i < indices.size(); ++i) indices[i] = static_cast<int64_t>(i);
    if (!options.shuffle) return indices;
    // Fisher-Yates with std::mt19937_64 (its output sequence is fixed by the standard) and a
    // multiply-shift reduction to [0, i] (std::uniform_int_distribution is not portable).
    std::mt19937_64 generator(mix(options.seed ^ mix(static_cast<uint64_t>(epoch))));
    for (size_t i = indices.size(); i > 1; --i) {
      const auto pick =
          static_cast<size_t>((static_cast<unsigned __int128>(generator()) * i) >> 64);
      std::swap(indices[i - 1], indices[pick]);
    }
    return indices;
  }

  std::vector<int64_t> batch_samples(BatchPosition position) const {
    const std::vector<int64_t> all = order(position.epoch);
    const auto first = all.begin() + position.step * options.batch_size;
    return {first, first + rows_of(position.step)};
  }

  ShardSpec spec_of(int64_t rows) const {
    Shape shape = header.shape;
    shape[0] = rows;
    return ShardSpec::make(shape, mesh.shape(), placements, extents, kOp);
  }

  /// This rank's piece of the batch at `position`: runs of consecutive sample indices are read
  /// with one hyperslab each.
  Slot read(BatchPosition position) const {
    Slot slot{position, {}, std::nullopt};
    try {
      const std::vector<int64_t> chosen = batch_samples(position);
      const Box box = spec_of(static_cast<int64_t>(chosen.size())).local_box(mesh.coord());
      slot.local = Tensor::empty(box.shape(), header.dtype);
      if (box.empty()) return slot;
      const size_t row_bytes =
          static_cast<size_t>(box.volume() / box.extent(0)) * dtype_size(header.dtype);
      char* out = static_cast<char*>(slot.local.raw_data());
      for (int64_t row = box.lo[0]; row < box.hi[0];) {
        int64_t run = 1;
        while (row + run < box.hi[0] && chosen[row + run] == chosen[row] + run) ++run;
        Box slab = box;
        slab.lo[0] = chosen[row];
        slab.hi[0] = chosen[row] + run;
        reader->read_into(slab, header.dtype, out + (row - box.lo[0]) * row_bytes);
        row += run;
      }
    } catch (const std::exception& error) {
      slot.problem = fmt::format("rank {}: epoch {} step {}: {}", mesh.rank(), position.epoch,
                                 position.step, detail::reason_of(error));
    }
    return slot;
  }

  void produce() {
    std::unique_lock lock(mutex);
    while (true) {
      changed.wait(
          lock, [&] { return stopping || queue.size() < static_cast<size_t>(options.read_ahead); });
      if (stopping) return;
      const BatchPosition position = produce_next;
      const uint64_t read_for = generation;
      lock.unlock();
      Slot slot = read(position);
      lock.lock();
      if (read_for != generation) continue;  // a seek() happened meanwhile
      queue.push_back(std::move(slot));
      produce_next = advance(position);
      changed.notify_all();
    }
  }
};

BatchReader::BatchReader(std::string file, std::string dataset, const DeviceMesh& mesh,
                         BatchReaderOptions options)
    : state_(std::make_unique<State>(mesh)) {
  CommOpScope scope(kOp);
  State& state = *state_;
  state.header = detail::agreed_header(mesh, kOp, file, dataset, {}, options.as, 0, 0);
  const Shape& shape = state.header.shape;
  const int ndim = static_cast<int>(shape.size());

  std::optional<std::string> problem;
  auto refuse = [&](std::string message) {
    if (!problem) problem = fmt::format("file '{}', dataset '{}': {}", file, dataset, message);
  };
  for (int m = 0; m < mesh.ndim(); ++m)
    if (mesh.names()[m] == options.dp_dim) state.dp_mesh_dim = m;
  std::vector<int> shard_dims = options.shard_dims;
  const int domain_dims = mesh.ndim() - (state.dp_mesh_dim >= 0 ? 1 : 0);
  if (shard_dims.empty())
    for (int j = 0; j < domain_dims; ++j) shard_dims.push_back(2 + j);
  if (ndim < 2)
    refuse(
        fmt::format("expected a dataset of (samples, C, spatial..) with at least 2 dims, "
                    "found shape ({})",
                    fmt::join(shape, ", ")));
  else if (shape[0] == 0)
    refuse("expected at least one sample, found an empty leading dim");
  if (options.batch_size < 1)
    refuse(fmt::format("expected batch_size >= 1, found {}", options.batch_size));
  else if (!problem && options.drop_last && options.batch_size > shape[0])
    refuse(fmt::format("batch_size {} exceeds the {} samples, so drop_last leaves no batch",
                       options.batch_size, shape[0]));
  if (options.read_ahead < 0)
    refuse(fmt::format("expected read_ahead >= 0, found {}", options.read_ahead));
  if (static_cast<int>(shard_dims.size()) != domain_dims)
    refuse(
        fmt::format("expected {} shard_dims (one per mesh dim other than '{}' of mesh {}), "
                    "found {} ({})",
                    domain_dims, options.dp_dim, mesh.str(), shard_dims.size(), shard_dims));
  std::set<int> used;
  for (int dim : shard_dims) {
    if (dim == -1) continue;
    if (dim < 1 || dim >= std::max(ndim, 1))
      refuse(fmt::format("shard dim {} is not a dim of the sample (1..{} for shape ({}))", dim,
                         ndim - 1, fmt::join(shape, ", ")));
    else if (!used.insert(dim).second)
      refuse(fmt::format("shard dim {} is listed twice in ({})", dim, fmt::join(shard_dims, ", ")));
  }
  agree_on_error(mesh.comm(), kOp, problem);

  for (int m = 0, j = 0; m < mesh.ndim(); ++m) {
    if (m == state.dp_mesh_dim) {
      state.placements.push_back(Placement::shard(0));
      continue;
    }
    const int dim = shard_dims[j++];
    state.placements.push_back(dim < 0 ? Placement::replicate() : Placement::shard(dim));
  }
  state.extents = options.extents;
  if (!state.extents.empty() && state.dp_mesh_dim >= 0 &&
      static_cast<int>(state.extents.size()) == mesh.ndim())
    state.extents[state.dp_mesh_dim].clear();  // the batch split is always the default one
  state.file = std::move(file);
  state.dataset = std::move(dataset);
  state.options = std::move(options);
  state.steps = state.options.drop_last
                    ? shape[0] / state.options.batch_size
                    : (shape[0] + state.options.batch_size - 1) / state.options.batch_size;
  // Validates the spatial extents against the layout, as the same AgreedError everywhere.
  Shape batch_shape = shape;
  batch_shape[0] = state.options.batch_size;
  tessera::detail::make_agreed_spec(mesh, kOp, batch_shape, state.placements, state.extents,
                                    state.header.dtype);
  // Every rank opens the file once, here; every sample of every epoch is read through it.
  std::optional<std::string> unreadable;
  try {
    state.reader.emplace(state.file, state.dataset);
  } catch (const std::exception& error) {
    unreadable = fmt::format("rank {}: {}", mesh.rank(), detail::reason_of(error));
  }
  agree_on_error(mesh.comm(), kOp, unreadable);
  if (state.options.read_ahead > 0) state.thread = std::thread([&state] { state.produce(); });
}

BatchReader::~BatchReader() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->changed.notify_all();
  if (state_->thread.joinable()) state_->thread.join();
}

ShardTensor BatchReader::next() {
  CommOpScope scope(kOp);
  State& state = *state_;
  Slot slot;
  if (state.options.read_ahead == 0) {
    slot = state.read(state.consume_next);
  } else {
    std::unique_lock lock(state.mutex);
    state.changed.wait(lock, [&] { return !state.queue.empty(); });
    slot = std::move(state.queue.front());
    state.queue.pop_front();
    state.changed.notify_all();
  }
  agree_on_error(state.mesh.comm(), kOp, slot.problem);
  const int64_t rows = state.rows_of(slot.position.step);
  {
    std::lock_guard lock(state.mutex);
    state.consume_next = state.advance(slot.position);
    if (state.options.read_ahead == 0) state.produce_next = state.consume_next;
  }
  // Read ahead on the host; the batch goes to the rank's device here, once.
  const Device device = current_rank_context().device();
  Tensor local = device.is_cpu() ? std::move(slot.local) : slot.local.to(device);
  return ShardTensor(std::move(local), state.mesh, state.spec_of(rows));
}

BatchPosition BatchReader::position() const {
  std::lock_guard lock(state_->mutex);
  return state_->consume_next;
}

void BatchReader::seek(BatchPosition position) {
  State& state = *state_;
  check_arg(position.epoch >= 0 && position.step >= 0 && position.step < state.steps, kOp,
            "cannot seek to epoch {} step {}: an epoch has steps 0..{}", position.epoch,
            position.step, state.steps - 1);
  {
    std::lock_guard lock(state.mutex);
    ++state.generation;
    state.queue.clear();
    state.produce_next = state.consume_next = position;
  }
  state.changed.notify_all();
}

int64_t BatchReader::samples() const {
  return state_->samples();
}

Shape BatchReader::sample_shape() const {
  return Shape(state_->header.shape.begin() + 1, state_->header.shape.end());
}

int64_t BatchReader::steps_per_epoch() const {
  return state_->steps;
}

std::vector<int64_t> BatchReader::batch_samples(BatchPosition position) const {
  return state_->batch_samples(position);
}

std::vector<int64_t> BatchReader::epoch_order(int64_t epoch) const {
  return state_->order(epoch);
}

}  // namespace tessera::io
