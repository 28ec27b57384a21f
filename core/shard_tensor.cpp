// ShardTensor construction (from_local, scatter, distribute) and leaving (gather, full_tensor).
// redistribute lives in redistribute.cpp.
#include "core/shard_tensor.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>

#include "core/agree.hpp"
#include "core/autograd.hpp"
#include "core/shard_tensor_detail.hpp"

namespace tessera {

namespace detail {

ShardSpec make_agreed_spec(const DeviceMesh& mesh, const std::string& op, const Shape& global_shape,
                           std::vector<Placement> placements,
                           std::vector<std::vector<int64_t>> extents, DType dtype) {
  std::optional<ShardSpec> spec;
  std::optional<std::string> problem;
  try {
    spec =
        ShardSpec::make(global_shape, mesh.shape(), std::move(placements), std::move(extents), op);
  } catch (const InvalidArgument& error) {
    // Strip the "[op] " prefix: agree_on_error adds it back.
    const std::string text = error.what();
    problem = text.substr(text.find("] ") + 2);
  }
  agree_on_error_and_description(mesh.comm(), op, problem, "layout", [&] {
    return fmt::format("{} {}", dtype_name(dtype), spec->str());
  });
  return *spec;
}

bool holds_partial_values(const ShardSpec& spec, const std::vector<int>& coord) {
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_partial() && spec.placements[m].reduce == ReduceOp::sum &&
        coord[m] != 0)
      return false;
  return true;
}

}  // namespace detail

namespace {
std::atomic<uint64_t> next_shard_tensor_id{1};
}

ShardTensor::ShardTensor(Tensor local, DeviceMesh mesh, ShardSpec spec)
    : local_(std::move(local)),
      mesh_(std::move(mesh)),
      spec_(std::move(spec)),
      id_(next_shard_tensor_id.fetch_add(1)) {}

ShardTensor ShardTensor::contiguous() const {
  if (local_.is_contiguous()) return *this;
  ShardTensor result = *this;
  result.local_ = local_.contiguous();
  return result;
}

ShardTensor ShardTensor::from_local(Tensor local, DeviceMesh mesh, Shape global_shape,
                                    std::vector<Placement> placements,
                                    std::vector<std::vector<int64_t>> extents) {
  CommOpScope scope("from_local");
  ShardSpec spec = detail::make_agreed_spec(mesh, "from_local", global_shape, std::move(placements),
                                            std::move(extents), local.dtype());
  const Shape expected = spec.local_shape(mesh.coord());
  std::optional<std::string> problem;
  if (local.shape() != expected)
    problem = fmt::format(
        "local shape {} on rank {} (mesh coord {}) differs from the layout's {} "
        "({})",
        local.shape(), mesh.rank(), mesh.coord(), expected, spec.str());
  agree_on_error(mesh.comm(), "from_local", problem);
  return ShardTensor(std::move(local), std::move(mesh), std::move(spec));
}

ShardTensor ShardTensor::from_local(Tensor local, DeviceMesh mesh,
                                    std::vector<Placement> placements) {
  CommOpScope scope("from_local");
  Comm& comm = mesh.comm();
  // Agree on rank and dtype first, so the shape gather below has equal counts everywhere.
  agree_on_description(comm, "from_local", "tensor rank and dtype",
                       fmt::format("{}-d {}", local.ndim(), dtype_name(local.dtype())));
  const size_t ndim = static_cast<size_t>(local.ndim());
  std::vector<int64_t> shapes(ndim * comm.size());
  std::vector<size_t> counts(comm.size(), ndim);
  comm.all_gather_v(local.shape().data(), ndim, shapes.data(), counts, DType::i64);
  auto shape_of = [&](int rank) {
    return Shape(shapes.begin() + rank * ndim, shapes.begin() + (rank + 1) * ndim);
  };
  // Global extent of a sharded dim = sum of the extents along its mesh dim at coordinate 0 of
  // the other mesh dims; unsharded dims take rank 0's extent. Every rank computes the same.
  Shape global_shape = shape_of(0);
  std::vector<std::vector<int64_t>> extents(mesh.ndim());
  for (int m = 0; m < std::min<int>(mesh.ndim(), static_cast<int>(placements.size())); ++m) {
    if (!placements[m].is_shard()) continue;
    const int dim = placements[m].dim;
    if (dim < 0 || dim >= static_cast<int>(ndim)) break;  // reported by make_agreed_spec
    std::vector<int> coord(mesh.ndim(), 0);
    global_shape[dim] = 0;
    for (int c = 0; c < mesh.size(m); ++c) {
      coord[m] = c;
      extents[m].push_back(shape_of(rank_of(coord, mesh.shape()))[dim]);
      global_shape[dim] += extents[m].back();
    }
  }
  ShardSpec spec = detail::make_agreed_spec(mesh, "from_local", global_shape, std::move(placements),
                                            std::move(extents), local.dtype());
  for (int rank = 0; rank < comm.size(); ++rank) {
    const Shape expected = spec.local_shape(coord_of(rank, mesh.shape()));
    if (shape_of(rank) != expected)
      throw AgreedError(
          "from_local",
          fmt::format("local shape {} on rank {} (mesh coord {}) does not fit the "
                      "layout {} implied by the other ranks (expected {})",
                      shape_of(rank), rank, coord_of(rank, mesh.shape()), spec.str(), expected));
  }
  return ShardTensor(std::move(local), std::move(mesh), std::move(spec));
}

ShardTensor ShardTensor::scatter(const Tensor& full, DeviceMesh mesh,
                                 std::vector<Placement> placements,
                                 std::vector<std::vector<int64_t>> extents, int root) {
  CommOpScope scope("scatter");
  Comm& comm = mesh.comm();
  check_arg(root >= 0 && root < comm.size(), "scatter", "root {} outside a mesh of {} ranks", root,
            comm.size());
  // Only the root knows the tensor: share its rank, dtype, shape and memory space (a few
  // integers).
  int64_t header[3] = {full.ndim(), static_cast<int64_t>(full.dtype()), full.device().is_cuda()};
  comm.broadcast(header, 3, DType::i64, root);
  Shape global_shape = comm.rank() == root ? full.shape() : Shape(header[0]);
  comm.broadcast(global_shape.data(), global_shape.size(), DType::i64, root);
  const DType dtype = static_cast<DType>(header[1]);
  const ShardSpec spec = detail::make_agreed_spec(mesh, "scatter", global_shape,
                                                  std::move(placements), std::move(extents), dtype);
  // The data moves in the root tensor's memory space (for a device tensor: every rank's own
  // device).
  const Device rank_device = current_rank_context().device();
  const Device wire_device =
      comm.rank() == root ? full.device() : (header[2] ? rank_device : Device::cpu());

  // Rank r receives its box, unless Partial(sum) makes it a zero rank.
  std::vector<size_t> counts(comm.size());
  for (int rank = 0; rank < comm.size(); ++rank) {
    const std::vector<int> coord = coord_of(rank, mesh.shape());
    counts[rank] = detail::holds_partial_values(spec, coord)
                       ? static_cast<size_t>(spec.local_box(coord).volume())
                       : 0;
  }
  Tensor packed;
  if (comm.rank() == root) {
    const std::vector<size_t> displs = displacements_of(counts);
    packed =
        Tensor::empty({static_cast<int64_t>(displs.back() + counts.back())}, dtype, wire_device);
    for (int rank = 0; rank < comm.size() && !packed.is_shape_only(); ++rank)
      if (counts[rank])
        full.pack_box(spec.local_box_of_rank(rank),
                      static_cast<char*>(packed.raw_data()) + displs[rank] * dtype_size(dtype));
  }
  Tensor local = Tensor::empty(spec.local_shape(mesh.coord()), dtype, wire_device);
  comm.scatter_v(packed.comm_data(), counts, local.comm_data(), counts[comm.rank()], dtype, root);
  if (!counts[comm.rank()]) local.fill(0);
  // Pieces live on their rank's device; where that is the cpu, the root keeps its tensor's.
  const Device device =
      rank_device.is_cuda() ? rank_device : (comm.rank() == root ? full.device() : rank_device);
  return ShardTensor(local.to(device), std::move(mesh), spec);
}

ShardTensor ShardTensor::distribute(const Tensor& replicated, DeviceMesh mesh,
                                    std::vector<Placement> placements,
                                    std::vector<std::vector<int64_t>> extents) {
  CommOpScope scope("distribute");
  ShardSpec spec =
      detail::make_agreed_spec(mesh, "distribute", replicated.shape(), std::move(placements),
                               std::move(extents), replicated.dtype());
  Tensor local = replicated.view_box(spec.local_box(mesh.coord())).clone();
  if (!detail::holds_partial_values(spec, mesh.coord())) local.fill(0);
  return ShardTensor(std::move(local), std::move(mesh), std::move(spec));
}

Tensor ShardTensor::full_tensor() const {
  NoGrad plain_values;  // a plain Tensor: nothing for a tape to record
  std::vector<Placement> replicated(mesh_.ndim(), Placement::replicate());
  return redistribute(replicated).to_local().contiguous();
}

Tensor ShardTensor::gather(int root) const {
  CommOpScope scope("gather");
  NoGrad plain_values;
  Comm& comm = mesh_.comm();
  check_arg(root >= 0 && root < comm.size(), "gather", "root {} outside a mesh of {} ranks", root,
            comm.size());
  // Pending reductions first; then one copy of every box (coordinate 0 of replicated dims).
  std::vector<Placement> reduced = spec_.placements;
  for (Placement& placement : reduced)
    if (placement.is_partial()) placement = Placement::replicate();
  const ShardTensor source = spec_.has_partial() ? redistribute(reduced, spec_.extents) : *this;
  const ShardSpec& spec = source.spec_;
  std::vector<size_t> counts(comm.size());
  for (int rank = 0; rank < comm.size(); ++rank) {
    const std::vector<int> coord = coord_of(rank, mesh_.shape());
    bool canonical = true;
    for (int m = 0; m < mesh_.ndim(); ++m)
      canonical = canonical && (spec.placements[m].is_shard() || coord[m] == 0);
    counts[rank] = canonical ? static_cast<size_t>(spec.local_box(coord).volume()) : 0;
  }
  // The data stays in the pieces' memory space (device tensors gather on the root's device).
  const Tensor local = source.local_.contiguous();
  const size_t element = dtype_size(dtype());
  const std::vector<size_t> displs = displacements_of(counts);
  Tensor staging;
  if (comm.rank() == root)
    staging =
        Tensor::empty({static_cast<int64_t>(displs.back() + counts.back())}, dtype(), device());
  comm.gather_v(local.comm_data(), counts[comm.rank()], staging.comm_data(), counts, dtype(), root);
  if (comm.rank() != root) return Tensor();
  Tensor full = Tensor::empty(spec.global_shape, dtype(), device());
  for (int rank = 0; rank < comm.size() && !staging.is_shape_only(); ++rank)
    if (counts[rank])
      full.unpack_box(spec.local_box_of_rank(rank),
                      static_cast<const char*>(staging.raw_data()) + displs[rank] * element);
  return full;
}

}  // namespace tessera
