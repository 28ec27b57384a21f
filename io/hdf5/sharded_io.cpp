// Sharded HDF5 IO (io/hdf5/sharded_io.hpp) on top of the serial single-dataset calls of
// h5_file.hpp. Compiled only when Tessera is built with HDF5.
#include "io/hdf5/sharded_io.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <utility>

#include "core/agree.hpp"
#include "core/autograd.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/shard_tensor_detail.hpp"
#include "core/trace.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/hdf5/sharded_io_detail.hpp"
#include "io/host_staging.hpp"
#include "io/output_path.hpp"

namespace tessera::io {

std::string detail::reason_of(const std::exception& error) {
  const std::string text = error.what();
  if (!text.empty() && text.front() == '[') {
    const size_t end = text.find("] ");
    if (end != std::string::npos) return text.substr(end + 2);
  }
  return text;
}

namespace {

/// Slab k of a box travels with tag k % kTagModulus (MPI guarantees tags up to 32767; messages
/// of one pair with the same tag arrive in the order they were posted).
constexpr int kTagModulus = 32768;

using detail::reason_of;

/// Bytes of one index of the first dim of a non-empty box (the whole box when it is 0-d).
size_t row_bytes(const Box& box, size_t element) {
  if (box.ndim() == 0) return element;
  return static_cast<size_t>(box.volume() / box.extent(0)) * element;
}

/// The slabs a box moves in: consecutive ranges of its first dim of
/// max(1, (staging_bytes / 2) / row_bytes) rows; none for an empty box, the box itself when 0-d.
std::vector<Box> slabs_of(const Box& box, size_t element, size_t staging_bytes) {
  if (box.empty()) return {};
  if (box.ndim() == 0) return {box};
  const size_t half = std::max<size_t>(1, staging_bytes / 2);
  const int64_t rows = static_cast<int64_t>(std::max<size_t>(1, half / row_bytes(box, element)));
  std::vector<Box> slabs;
  for (int64_t lo = box.lo[0]; lo < box.hi[0]; lo += rows) {
    Box slab = box;
    slab.lo[0] = lo;
    slab.hi[0] = std::min(lo + rows, box.hi[0]);
    slabs.push_back(std::move(slab));
  }
  return slabs;
}

/// One slab on its way between the root and `peer`.
struct Piece {
  int peer;
  Box box;  // global indices
  int tag;
};

/// Every slab of every rank's box, in rank order, for the ranks `moves` selects.
template <typename Selected>
std::vector<Piece> pieces_of(const ShardSpec& spec, int size, size_t element, size_t staging_bytes,
                             Selected moves) {
  std::vector<Piece> pieces;
  for (int rank = 0; rank < size; ++rank) {
    if (!moves(rank)) continue;
    const std::vector<Box> slabs = slabs_of(spec.local_box_of_rank(rank), element, staging_bytes);
    for (size_t k = 0; k < slabs.size(); ++k)
      pieces.push_back({rank, slabs[k], static_cast<int>(k % kTagModulus)});
  }
  return pieces;
}

/// Receives (or sends) every slab of this rank's own box from (to) `root`: in one batch from a
/// cpu tensor's own storage; for a cuda tensor one slab at a time through pinned host staging
/// (io/host_staging.hpp), the device copy of the next slab overlapping the message of this one.
void move_own_slabs(Comm& comm, const Tensor& local, const Box& box, size_t staging_bytes, int root,
                    P2POp::Kind kind) {
  const size_t element = dtype_size(local.dtype());
  const std::vector<Box> slabs = slabs_of(box, element, staging_bytes);
  if (slabs.empty()) return;
  std::vector<ByteRange> ranges;
  for (const Box& slab : slabs) {
    const size_t offset =
        box.ndim() == 0 ? 0 : static_cast<size_t>(slab.lo[0] - box.lo[0]) * row_bytes(box, element);
    ranges.push_back({offset, static_cast<size_t>(slab.volume()) * element});
  }
  auto op_of = [&](size_t k, void* host) {
    const int tag = static_cast<int>(k % kTagModulus);
    return kind == P2POp::Kind::send ? P2POp::send(host, ranges[k].bytes, root, tag)
                                     : P2POp::recv(host, ranges[k].bytes, root, tag);
  };
  if (local.device().is_cpu()) {
    std::vector<P2POp> ops;
    // A shape-only tensor (estimate mode) has no storage: its slabs are null payloads, which the
    // estimate's communicator records with their bytes and peers without moving them.
    char* base = static_cast<char*>(local.comm_data());
    for (size_t k = 0; k < ranges.size(); ++k)
      ops.push_back(op_of(k, base ? base + ranges[k].offset : nullptr));
    comm.send_recv(ops);
  } else if (kind == P2POp::Kind::send) {
    stream_to_host(
        local, ranges,
        [&](size_t k, const void* host) {
          comm.send_recv(std::vector{op_of(k, const_cast<void*>(host))});
        },
        current_comm_op());
  } else {
    stream_from_host(
        local, ranges, [&](size_t k, void* host) { comm.send_recv(std::vector{op_of(k, host)}); },
        current_comm_op());
  }
}

/// True when `rank` holds the copy of its box that is written: of the ranks holding the same box
/// (replicas over the non-Shard mesh dims), the one at coordinate 0 of those dims.
bool holds_written_copy(const ShardSpec& spec, const DeviceMesh& mesh, int rank) {
  const std::vector<int> coord = coord_of(rank, mesh.shape());
  for (int m = 0; m < mesh.ndim(); ++m)
    if (!spec.placements[m].is_shard() && coord[m] != 0) return false;
  return true;
}

/// Estimate mode (core/estimate/estimate_mode.hpp): a write opens no file; it is one `io` event
/// with the bytes this rank would write.
void record_estimated_write(const std::string& op, const ShardTensor& tensor,
                            const std::string& file, const std::string& dataset) {
  trace::Span span("io", op);
  span.arg("file", file);
  span.arg("dataset", dataset);
  const bool writes = holds_written_copy(tensor.spec(), tensor.mesh(), tensor.mesh().rank());
  span.arg("bytes", writes ? static_cast<int64_t>(tensor.to_local().nbytes()) : 0);
}

}  // namespace

detail::Header detail::agreed_header(const DeviceMesh& mesh, const std::string& op,
                                     const std::string& file, const std::string& dataset,
                                     const std::vector<Placement>& placements,
                                     std::optional<DType> as, int root, size_t staging_bytes) {
  Comm& comm = mesh.comm();
  std::optional<std::string> problem;
  if (root < 0 || root >= comm.size())
    problem = fmt::format("root {} outside a mesh of {} ranks", root, comm.size());
  for (size_t m = 0; m < placements.size() && !problem; ++m)
    if (placements[m].is_partial())
      problem = fmt::format(
          "placement {} on mesh dim {} is Partial: a dataset holds full values, so it cannot be "
          "read as partial ones (read it Replicate or Shard, then redistribute)",
          placements[m].str(), m);
  detail::Header header;
  if (!problem && comm.rank() == root) {
    try {
      const DatasetInfo info = dataset_info(file, dataset);
      if (!as && !info.dtype)
        problem = fmt::format(
            "file '{}', dataset '{}': expected an element type of f32, f64, f16, bf16, i32, i64 "
            "or u8, found {}",
            file, info.path, info.file_type);
      if (!problem) {
        header.shape = info.shape;
        header.dtype = as ? *as : *info.dtype;
        // A read of an empty box checks that the elements convert to the dtype.
        const Shape origin(info.shape.size(), 0);
        if (shape_numel(info.shape) != 0 || info.shape.empty())
          read_hyperslab(file, dataset, Box{origin, origin}, header.dtype);
      }
    } catch (const std::exception& error) {
      problem = reason_of(error);
    }
  }
  agree_on_error(comm, op, problem);
  int64_t values[3] = {static_cast<int64_t>(header.shape.size()),
                       static_cast<int64_t>(header.dtype), static_cast<int64_t>(staging_bytes)};
  comm.broadcast(values, 3, DType::i64, root);
  header.shape.resize(static_cast<size_t>(values[0]));
  comm.broadcast(header.shape.data(), header.shape.size(), DType::i64, root);
  header.dtype = static_cast<DType>(values[1]);
  header.staging_bytes = static_cast<size_t>(values[2]);
  return header;
}

ShardTensor detail::without_partial(const ShardTensor& tensor) {
  if (!tensor.spec().has_partial()) return tensor;
  NoGrad written_values;  // values on their way to a file: nothing for a tape to record
  std::vector<Placement> reduced = tensor.placements();
  for (Placement& placement : reduced)
    if (placement.is_partial()) placement = Placement::replicate();
  return tensor.redistribute(reduced, tensor.spec().extents);
}

std::optional<std::string> detail::stream_to_root(const ShardTensor& source,
                                                  const std::string& file,
                                                  const std::string& dataset, int root,
                                                  size_t staging_bytes) {
  const DeviceMesh& mesh = source.mesh();
  Comm& comm = mesh.comm();
  const ShardSpec& spec = source.spec();
  auto canonical = [&](int rank) { return holds_written_copy(spec, mesh, rank); };
  const DType dtype = source.dtype();
  const size_t element = dtype_size(dtype);
  const Tensor local = source.to_local().contiguous();  // any device: IO stages it in slabs
  std::optional<std::string> problem;
  if (comm.rank() != root) {
    if (canonical(comm.rank()))
      move_own_slabs(comm, local, source.local_box(), staging_bytes, root, P2POp::Kind::send);
  } else {
    // Writes one box; after the first failure, only receives (to release the senders).
    auto write_box = [&](const Box& box, const Tensor& data) {
      if (problem || box.empty()) return;
      try {
        write_hyperslab(file, dataset, box, data);
      } catch (const std::exception& error) {
        problem = reason_of(error);
      }
    };
    const std::vector<Piece> pieces =
        pieces_of(spec, comm.size(), element, staging_bytes,
                  [&](int rank) { return rank != root && canonical(rank); });
    const size_t half = std::max<size_t>(1, staging_bytes / 2);
    size_t next = 0;
    std::vector<std::pair<const Piece*, Tensor>> batch;
    // Posts the receives of the next batch (at least one piece, more within half the budget).
    auto post_batch = [&]() -> std::unique_ptr<P2PBatch> {
      batch.clear();
      std::vector<P2POp> ops;
      size_t bytes = 0;
      while (next < pieces.size()) {
        const size_t piece_bytes = static_cast<size_t>(pieces[next].box.volume()) * element;
        if (!batch.empty() && bytes + piece_bytes > half) break;
        batch.emplace_back(&pieces[next], Tensor::empty(pieces[next].box.shape(), dtype));
        ops.push_back(P2POp::recv(batch.back().second.comm_data(), piece_bytes, pieces[next].peer,
                                  pieces[next].tag));
        bytes += piece_bytes;
        ++next;
      }
      if (ops.empty()) return nullptr;
      return comm.start_send_recv(ops);
    };
    std::unique_ptr<P2PBatch> in_flight = post_batch();
    if (canonical(root)) write_box(source.local_box(), local);
    while (in_flight) {
      in_flight->wait();
      auto received = std::move(batch);
      in_flight = post_batch();
      for (const auto& [piece, data] : received) write_box(piece->box, data);
    }
  }
  return problem;
}

size_t detail::agreed_slab_calls(Comm& comm, const Box& box, DType dtype, Device device,
                                 bool moves) {
  int64_t calls =
      moves ? static_cast<int64_t>(
                  contiguous_slabs(box.shape(), dtype_size(dtype), io_slab_bytes(device)).size())
            : 0;
  comm.all_reduce(&calls, &calls, 1, DType::i64, ReduceOp::max);
  return static_cast<size_t>(std::max<int64_t>(calls, 1));
}

bool collective_io_available(const DeviceMesh& mesh) {
  return detail::collective_io_available(mesh.comm());
}

ShardTensor read_sharded(const std::string& file, const std::string& dataset,
                         const DeviceMesh& mesh, std::vector<Placement> placements,
                         std::vector<std::vector<int64_t>> extents, std::optional<DType> as,
                         bool collective) {
  const std::string op = "read_sharded";
  // Estimate mode: the header is read from the file; the box comes back shape-only
  // (read_hyperslab reads no element then).
  trace::Span span("io", op);
  span.arg("file", file);
  span.arg("dataset", dataset);
  CommOpScope scope(op);
  const detail::Header header =
      detail::agreed_header(mesh, op, file, dataset, placements, as, 0, 0);
  ShardSpec spec = tessera::detail::make_agreed_spec(mesh, op, header.shape, std::move(placements),
                                                     std::move(extents), header.dtype);
  std::optional<std::string> problem;
  Tensor local;
  const Box box = spec.local_box(mesh.coord());
  const Device device = current_rank_context().device();
  // A dataset without elements has no storage to read collectively (every rank knows).
  const bool together =
      collective && detail::collective_io_available(mesh.comm()) && shape_numel(header.shape) != 0;
  const size_t calls =
      together ? detail::agreed_slab_calls(mesh.comm(), box, header.dtype, device, true) : 0;
  try {
    local = together ? detail::collective_read(mesh.comm(), file, dataset, box, header.dtype,
                                               device, calls)
                     : read_hyperslab(file, dataset, box, header.dtype, device);
  } catch (const std::exception& error) {
    problem = fmt::format("rank {}: {}", mesh.rank(), reason_of(error));
  }
  agree_on_error(mesh.comm(), op, problem);
  return ShardTensor(std::move(local), mesh, std::move(spec));
}

ShardTensor scatter(const std::string& file, const std::string& dataset, const DeviceMesh& mesh,
                    std::vector<Placement> placements, std::vector<std::vector<int64_t>> extents,
                    int root, size_t staging_bytes, std::optional<DType> as) {
  // Estimate mode: the root reads the header from the file and every box shape-only
  // (read_hyperslab reads no element then); the slabs travel as null payloads, so the recorded
  // messages are the real scatter's.
  const std::string op = "scatter";
  trace::Span span("io", op);
  span.arg("file", file);
  span.arg("dataset", dataset);
  CommOpScope scope(op);
  Comm& comm = mesh.comm();
  const detail::Header header =
      detail::agreed_header(mesh, op, file, dataset, placements, as, root, staging_bytes);
  ShardSpec spec = tessera::detail::make_agreed_spec(mesh, op, header.shape, std::move(placements),
                                                     std::move(extents), header.dtype);
  const DType dtype = header.dtype;
  const size_t element = dtype_size(dtype);
  const Box own_box = spec.local_box(mesh.coord());
  const Device device = current_rank_context().device();
  Tensor local;  // the root reads its own box straight into a tensor of its own
  std::optional<std::string> problem;

  if (comm.rank() != root) {
    local = Tensor::empty(own_box.shape(), dtype, device);
    move_own_slabs(comm, local, own_box, header.staging_bytes, root, P2POp::Kind::recv);
  } else {
    // Reads one box; after the first failure, sends zeros so that every receive completes and
    // the error is agreed at the end instead of leaving receivers waiting.
    auto read_box = [&](const Box& box, Device into = Device::cpu()) {
      if (!problem) {
        try {
          return read_hyperslab(file, dataset, box, dtype, into);
        } catch (const std::exception& error) {
          problem = reason_of(error);
        }
      }
      return Tensor::zeros(box.shape(), dtype, into);
    };
    const std::vector<Piece> pieces = pieces_of(spec, comm.size(), element, header.staging_bytes,
                                                [&](int rank) { return rank != root; });
    const size_t half = std::max<size_t>(1, header.staging_bytes / 2);
    size_t next = 0;
    // The next batch: at least one piece, more while their bytes stay within half the budget.
    auto read_batch = [&] {
      std::vector<std::pair<const Piece*, Tensor>> batch;
      size_t bytes = 0;
      while (next < pieces.size()) {
        const size_t piece_bytes = static_cast<size_t>(pieces[next].box.volume()) * element;
        if (!batch.empty() && bytes + piece_bytes > half) break;
        batch.emplace_back(&pieces[next], read_box(pieces[next].box));
        bytes += piece_bytes;
        ++next;
      }
      return batch;
    };
    bool own_read = false;
    auto batch = read_batch();
    while (!batch.empty()) {
      std::vector<P2POp> ops;
      for (const auto& [piece, data] : batch)
        ops.push_back(
            P2POp::send(data.comm_data(), data.numel() * element, piece->peer, piece->tag));
      std::unique_ptr<P2PBatch> in_flight = comm.start_send_recv(ops);
      auto following = read_batch();
      if (following.empty() && !own_read) {
        local = read_box(own_box, device);
        own_read = true;
      }
      in_flight->wait();
      batch = std::move(following);
    }
    if (!own_read) local = read_box(own_box, device);
  }
  agree_on_error(comm, op, problem);
  return ShardTensor(std::move(local), mesh, std::move(spec));
}

namespace {

/// Collective: the temporary file a write goes to first (named from the root's pid, the same on
/// every rank), prepared by `root` as a copy of `file` (its other datasets are kept) holding a new
/// empty `dataset` of `tensor`'s global shape and dtype. Agreed: throws AgreedError everywhere.
std::string prepare_temporary(const std::string& op, Comm& comm, const std::string& file,
                              const std::string& dataset, const ShardTensor& tensor, int root,
                              WriteOptions storage) {
  int64_t pid = static_cast<int64_t>(::getpid());
  comm.broadcast(&pid, 1, DType::i64, root);
  const std::string temporary = fmt::format("{}.tmp-{}", file, pid);
  std::optional<std::string> problem;
  if (comm.rank() == root) {
    try {
      check_output_path(op, file);
      std::error_code stale;
      std::filesystem::remove(temporary, stale);  // a leftover of an earlier run with this pid
      // Other objects of an existing file are kept (a copy); a file holding nothing but the dataset
      // being replaced is started afresh instead (copying it would only add unused space).
      if (std::filesystem::exists(file) && !holds_only_dataset(file, dataset))
        std::filesystem::copy_file(file, temporary);
      storage.truncate_file = false;
      create_dataset(temporary, dataset, tensor.global_shape(), tensor.dtype(), storage);
    } catch (const std::exception& error) {
      problem = reason_of(error);
      std::error_code ignored;
      std::filesystem::remove(temporary, ignored);
    }
  }
  agree_on_error(comm, op, problem);
  return temporary;
}

}  // namespace

void detail::agree_or_discard(const std::string& op, Comm& comm, const std::string& temporary,
                              int root, const std::optional<std::string>& problem) {
  try {
    agree_on_error(comm, op, problem);
  } catch (...) {
    if (comm.rank() == root) {
      std::error_code ignored;
      std::filesystem::remove(temporary, ignored);
    }
    throw;
  }
}

void detail::finish_temporary(const std::string& op, Comm& comm, const std::string& temporary,
                              const std::string& file, int root,
                              const std::optional<std::string>& problem) {
  agree_or_discard(op, comm, temporary, root, problem);
  std::optional<std::string> renamed;
  if (comm.rank() == root) {
    try {
      std::filesystem::rename(temporary, file);
    } catch (const std::exception& error) {
      renamed = reason_of(error);
    }
  }
  agree_or_discard(op, comm, temporary, root, renamed);
}

void gather_write(const ShardTensor& tensor, const std::string& file, const std::string& dataset,
                  int root, size_t staging_bytes, const WriteOptions& storage) {
  if (estimate::active()) return record_estimated_write("gather_write", tensor, file, dataset);
  const std::string op = "gather_write";
  trace::Span span("io", op);
  span.arg("file", file);
  span.arg("dataset", dataset);
  CommOpScope scope(op);
  const DeviceMesh& mesh = tensor.mesh();
  Comm& comm = mesh.comm();
  agree_on_error(comm, op,
                 root < 0 || root >= comm.size()
                     ? std::optional<std::string>(
                           fmt::format("root {} outside a mesh of {} ranks", root, comm.size()))
                     : std::nullopt);
  int64_t budget = static_cast<int64_t>(staging_bytes);
  comm.broadcast(&budget, 1, DType::i64, root);
  staging_bytes = static_cast<size_t>(budget);

  const ShardTensor source = detail::without_partial(tensor);
  const std::string temporary = prepare_temporary(op, comm, file, dataset, source, root, storage);
  detail::finish_temporary(op, comm, temporary, file, root,
                           detail::stream_to_root(source, temporary, dataset, root, staging_bytes));
}

namespace {

/// Collective: every rank with `writes` puts `local` into `box` of the existing `dataset` of
/// `file`: collective MPI-IO when `collective` and available (and the dataset has elements),
/// writers in rank order with the serial driver otherwise. Returns this rank's problem (not
/// agreed: the caller agrees on it).
std::optional<std::string> write_own_boxes(Comm& comm, const std::string& file,
                                           const std::string& dataset, const Box& box,
                                           const Tensor& local, bool writes, bool collective,
                                           bool has_elements) {
  std::optional<std::string> problem;
  if (collective && detail::collective_io_available(comm) && has_elements) {
    const size_t calls =
        detail::agreed_slab_calls(comm, box, local.dtype(), local.device(), writes);
    try {
      detail::collective_write(comm, file, dataset, box, local, !writes, calls);
    } catch (const std::exception& error) {
      problem = fmt::format("rank {}: {}", comm.rank(), reason_of(error));
    }
    return problem;
  }
  // Writers take turns in rank order: each waits for the previous rank's token, opens, writes
  // and closes the file, then passes the token on (serial HDF5 must never have two writers).
  char token = 0;
  if (comm.rank() > 0) comm.send_recv(std::vector{P2POp::recv(&token, 1, comm.rank() - 1, 0)});
  if (writes) {
    try {
      write_hyperslab(file, dataset, box, local);
    } catch (const std::exception& error) {
      problem = fmt::format("rank {}: {}", comm.rank(), reason_of(error));
    }
  }
  if (comm.rank() + 1 < comm.size())
    comm.send_recv(std::vector{P2POp::send(&token, 1, comm.rank() + 1, 0)});
  return problem;
}

}  // namespace

void write_sharded(const ShardTensor& tensor, const std::string& file, const std::string& dataset,
                   bool collective, const WriteOptions& storage) {
  const std::string op = "write_sharded";
  if (estimate::active()) return record_estimated_write(op, tensor, file, dataset);
  trace::Span span("io", op);
  span.arg("file", file);
  span.arg("dataset", dataset);
  CommOpScope scope(op);
  const DeviceMesh& mesh = tensor.mesh();
  Comm& comm = mesh.comm();
  const ShardTensor source = detail::without_partial(tensor);
  const std::string temporary = prepare_temporary(op, comm, file, dataset, source, 0, storage);
  const bool writes =
      holds_written_copy(source.spec(), mesh, comm.rank()) && !source.local_box().empty();
  const Tensor local = source.to_local().contiguous();  // any device: IO stages it in slabs
  const std::optional<std::string> problem =
      write_own_boxes(comm, temporary, dataset, source.local_box(), local, writes, collective,
                      shape_numel(source.global_shape()) != 0);
  detail::finish_temporary(op, comm, temporary, file, 0, problem);
}

void write_sharded_at(const ShardTensor& tensor, const std::string& file,
                      const std::string& dataset, const std::vector<int64_t>& leading,
                      bool collective) {
  const std::string op = "write_sharded_at";
  if (estimate::active()) return record_estimated_write(op, tensor, file, dataset);
  CommOpScope scope(op);
  const DeviceMesh& mesh = tensor.mesh();
  Comm& comm = mesh.comm();
  const ShardTensor source = detail::without_partial(tensor);
  // The dataset's shape must be some leading extents followed by the tensor's global shape, with
  // `leading` inside them; rank 0 checks (every rank agrees on its verdict).
  std::optional<std::string> problem;
  if (comm.rank() == 0) {
    try {
      const Shape shape = dataset_info(file, dataset).shape;
      const size_t lead = leading.size();
      bool fits = shape.size() == lead + source.global_shape().size() &&
                  std::equal(source.global_shape().begin(), source.global_shape().end(),
                             shape.begin() + static_cast<std::ptrdiff_t>(lead));
      for (size_t d = 0; fits && d < lead; ++d) fits = leading[d] >= 0 && leading[d] < shape[d];
      if (!fits)
        problem = fmt::format(
            "dataset '{}' of '{}' has shape {}; index {} of a tensor of global "
            "shape {} does not fit in it",
            dataset, file, shape, leading, source.global_shape());
    } catch (const std::exception& error) {
      problem = reason_of(error);
    }
  }
  agree_on_error(comm, op, problem);
  const Box own = source.local_box();
  Box box;
  Shape local_shape;
  for (int64_t index : leading) {
    box.lo.push_back(index);
    box.hi.push_back(index + 1);
    local_shape.push_back(1);
  }
  box.lo.insert(box.lo.end(), own.lo.begin(), own.lo.end());
  box.hi.insert(box.hi.end(), own.hi.begin(), own.hi.end());
  const Shape own_shape = own.shape();
  local_shape.insert(local_shape.end(), own_shape.begin(), own_shape.end());
  const bool writes = holds_written_copy(source.spec(), mesh, comm.rank()) && !own.empty();
  const Tensor local = source.to_local().contiguous().reshape(local_shape);
  agree_on_error(comm, op,
                 write_own_boxes(comm, file, dataset, box, local, writes, collective,
                                 shape_numel(source.global_shape()) != 0));
}

}  // namespace tessera::io
