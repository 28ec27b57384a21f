// ShardTensor::redistribute: any layout to any layout on one mesh, moving exactly the bytes
// that change owner.
//
// Plan:
//  1. Partial mesh dims that do not stay the same Partial are reduced: reduce_scatter_v when
//     the target shards a tensor dim that is whole on this rank, all_reduce otherwise.
//  2. Data moves between the two (now non-partial) layouts over the sub-communicator of the
//     mesh dims that change: an all_gather_v for a single Shard->Replicate, a local copy when
//     every changing dim was replicated, an all_to_all_w of box intersections otherwise.
//     Along a changing dim that was replicated, rank r receives only from the rank with r's
//     coordinate on that dim, so every element arrives exactly once. Boxes travel as strided
//     blocks (all_to_all_w), so no pack or unpack pass is added to the backend's own copy.
//  3. Replicate->Partial(sum) keeps the values on coordinate 0 and zeros elsewhere.
#include <fmt/format.h>

#include <algorithm>

#include "core/autograd.hpp"
#include "core/shard_tensor.hpp"
#include "core/shard_tensor_detail.hpp"
#include "core/trace.hpp"

namespace tessera {

namespace {

/// Uninitialised bytes on `device` from its caching allocator (no zero-fill, reused across
/// calls).
Tensor staging_buffer(size_t bytes, Device device) {
  return Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, device);
}

/// A block of no elements (the same on sender and receiver, whatever the empty box's shape).
StridedBlock empty_block() {
  return StridedBlock{0, {0}, {1}};
}

/// The box `box` (coordinates of `base`) of `base` as a strided block relative to base's data.
StridedBlock block_of(const Tensor& base, const Box& box) {
  if (box.empty()) return empty_block();
  const Tensor view = base.view_box(box);
  return StridedBlock{view.storage_offset() - base.storage_offset(), view.shape(), view.strides()};
}

/// True when blocks of `shape` split along `dim` are contiguous runs of a row-major buffer.
bool blocks_contiguous_along(const Shape& shape, int dim) {
  for (int d = 0; d < dim; ++d)
    if (shape[d] != 1) return false;
  return true;
}

/// Step 1 for one mesh dim: Partial along `mesh_dim` becomes Shard(dim) with `extents`.
/// `copied` counts what this rank copies outside the collective.
Tensor reduce_scatter_partial(const Tensor& local, const DeviceMesh& mesh, int mesh_dim, int dim,
                              const std::vector<int64_t>& extents, ReduceOp op,
                              trace::CopyTally& copied) {
  auto comm = mesh.sub_comm({mesh_dim});
  const Tensor source = local.contiguous();
  const std::vector<int64_t> offsets = offsets_of(extents);
  std::vector<size_t> counts(extents.size());
  Box block = Box::of_shape(source.shape());
  for (size_t c = 0; c < extents.size(); ++c) {
    block.lo[dim] = offsets[c];
    block.hi[dim] = offsets[c + 1];
    counts[c] = static_cast<size_t>(block.volume());
  }
  Tensor packed;
  if (blocks_contiguous_along(source.shape(), dim)) {
    packed = source;
  } else {
    packed = Tensor::empty(source.shape(), source.dtype(), source.device());
    const std::vector<size_t> displs = displacements_of(counts);
    auto* out = static_cast<char*>(packed.comm_data());
    for (size_t c = 0; c < extents.size(); ++c) {
      block.lo[dim] = offsets[c];
      block.hi[dim] = offsets[c + 1];
      copied.copy(source.view_box(block));
      if (out == nullptr) continue;
      source.pack_box(block, out + displs[c] * source.element_size());
    }
  }
  Shape shape = source.shape();
  shape[dim] = extents[mesh.coord()[mesh_dim]];
  Tensor result = Tensor::empty(shape, source.dtype(), source.device());
  comm->reduce_scatter_v(packed.comm_data(), result.comm_data(), counts, source.dtype(), op);
  return result;
}

/// Step 2, fast path: Shard(dim) -> Replicate along one mesh dim, as one all_gather_v.
Tensor all_gather_shards(const Tensor& local, const DeviceMesh& mesh, const ShardSpec& from,
                         const ShardSpec& to, int mesh_dim, trace::CopyTally& copied) {
  auto comm = mesh.sub_comm({mesh_dim});
  const int dim = from.placements[mesh_dim].dim;
  const Tensor source = local.contiguous();
  const Shape out_shape = to.local_shape(mesh.coord());
  const std::vector<int64_t>& extents = from.extents[mesh_dim];
  const int64_t slab = shape_numel(out_shape) / std::max<int64_t>(out_shape[dim], 1);
  std::vector<size_t> counts(extents.size());
  for (size_t c = 0; c < extents.size(); ++c) counts[c] = static_cast<size_t>(extents[c] * slab);
  Tensor result = Tensor::empty(out_shape, source.dtype(), source.device());
  if (blocks_contiguous_along(out_shape, dim)) {
    comm->all_gather_v(source.comm_data(), counts[mesh.coord()[mesh_dim]], result.comm_data(),
                       counts, source.dtype());
    return result;
  }
  const std::vector<size_t> displs = displacements_of(counts);
  const Tensor staging =
      staging_buffer((displs.back() + counts.back()) * source.element_size(), source.device());
  comm->all_gather_v(source.comm_data(), counts[mesh.coord()[mesh_dim]], staging.comm_data(),
                     counts, source.dtype());
  const std::vector<int64_t> offsets = offsets_of(extents);
  Box block = Box::of_shape(out_shape);
  for (size_t c = 0; c < extents.size(); ++c) {
    block.lo[dim] = offsets[c];
    block.hi[dim] = offsets[c + 1];
    copied.copy(result.view_box(block));
    if (staging.is_shape_only()) continue;  // estimate mode: nothing to unpack
    result.unpack_box(block, staging.data<uint8_t>() + displs[c] * source.element_size());
  }
  return result;
}

/// Step 2, general path: all_to_all_w of box intersections over the changing mesh dims.
Tensor exchange_boxes(const Tensor& local, const DeviceMesh& mesh, const ShardSpec& from,
                      const ShardSpec& to, const std::vector<int>& changed,
                      trace::CopyTally& copied) {
  auto comm = mesh.sub_comm(changed);
  std::vector<int> group_shape;
  for (int m : changed) group_shape.push_back(mesh.size(m));
  const std::vector<int>& my_coord = mesh.coord();
  auto mesh_coord_of_peer = [&](int peer) {
    std::vector<int> coord = my_coord;
    const std::vector<int> along = coord_of(peer, group_shape);
    for (size_t i = 0; i < changed.size(); ++i) coord[changed[i]] = along[i];
    return coord;
  };
  // Along a changing dim that `from` does not shard, only the rank at the receiver's
  // coordinate sends (the values are the same on every rank of that dim).
  auto designated = [&](const std::vector<int>& sender, const std::vector<int>& receiver) {
    for (int m : changed)
      if (!from.placements[m].is_shard() && sender[m] != receiver[m]) return false;
    return true;
  };
  const Box my_from = from.local_box(my_coord);
  const Box my_to = to.local_box(my_coord);
  const int peers = comm->size();
  const int me = comm->rank();
  Tensor result = Tensor::empty(my_to.shape(), local.dtype(), local.device());
  // Blocks are strided views of the source and result tensors: nothing is packed here.
  std::vector<StridedBlock> send_blocks(peers, empty_block()), recv_blocks(peers, empty_block());
  for (int peer = 0; peer < peers; ++peer) {
    if (peer == me) continue;
    const std::vector<int> coord = mesh_coord_of_peer(peer);
    if (designated(my_coord, coord))
      send_blocks[peer] =
          block_of(local, intersect(my_from, to.local_box(coord)).relative_to(my_from.lo));
    if (designated(coord, my_coord))
      recv_blocks[peer] =
          block_of(result, intersect(from.local_box(coord), my_to).relative_to(my_to.lo));
  }
  // This rank's own part is a direct copy, never a message.
  const Box kept = intersect(my_from, my_to);
  if (!kept.empty()) {
    Tensor target = result.view_box(kept.relative_to(my_to.lo));
    const Tensor from_view = local.view_box(kept.relative_to(my_from.lo));
    copied.copy(target, &from_view);
    target.copy_from(from_view);
  }
  comm->all_to_all_w(local.comm_data(), send_blocks, result.comm_data(), recv_blocks,
                     local.dtype());
  return result;
}

/// Step 2: moves `local` from layout `from` to layout `to` (neither has a Partial dim that
/// differs between them).
Tensor move_between_layouts(const Tensor& local, const DeviceMesh& mesh, const ShardSpec& from,
                            const ShardSpec& to, trace::CopyTally& copied) {
  std::vector<int> changed;
  for (int m = 0; m < mesh.ndim(); ++m)
    if (from.placements[m] != to.placements[m] || from.extents[m] != to.extents[m])
      changed.push_back(m);
  if (changed.empty()) return local;
  if (changed.size() == 1 && from.placements[changed[0]].is_shard() &&
      to.placements[changed[0]].is_replicate())
    return all_gather_shards(local, mesh, from, to, changed[0], copied);
  const bool all_replicated = std::all_of(changed.begin(), changed.end(),
                                          [&](int m) { return !from.placements[m].is_shard(); });
  if (all_replicated) {  // the target box lies inside the local box: slice it
    const Box my_from = from.local_box(mesh.coord());
    const Tensor kept = local.view_box(to.local_box(mesh.coord()).relative_to(my_from.lo));
    copied.copy(kept);
    return kept.clone();
  }
  return exchange_boxes(local, mesh, from, to, changed, copied);
}

}  // namespace

ShardTensor ShardTensor::redistribute(std::vector<Placement> placements,
                                      std::vector<std::vector<int64_t>> extents) const {
  CommOpScope scope("redistribute");
  const ShardSpec target =
      detail::make_agreed_spec(mesh_, "redistribute", spec_.global_shape, std::move(placements),
                               std::move(extents), dtype());
  return redistribute_to(target);
}

ShardTensor ShardTensor::redistribute_to(const ShardSpec& target) const {
  CommOpScope scope("redistribute");
  check_arg(target.global_shape == spec_.global_shape && target.mesh_shape == mesh_.shape(),
            "redistribute", "to a layout of global shape {} on mesh {}: the tensor is {} on {}",
            target.global_shape, target.mesh_shape, spec_.global_shape, mesh_.shape());
  if (target == spec_) return *this;
  trace::Span span("redistribute", "redistribute");
  if (span.recording()) {
    span.arg("from", spec_.str());
    span.arg("to", target.str());
    span.arg("local_bytes", static_cast<int64_t>(local_.nbytes()));
  }
  // Device tensors stay on their device: every buffer below is made on local_'s device. A
  // strided piece (a view) is made contiguous once: the collectives carry contiguous payloads.
  Tensor local = local_.contiguous();
  ShardSpec current = spec_;
  trace::CopyTally copied(span);  // outside the collectives

  // 1. Reduce the Partial dims that do not stay the same Partial.
  for (int m = 0; m < mesh_.ndim(); ++m) {
    const Placement from = current.placements[m];
    const Placement want = target.placements[m];
    if (!from.is_partial() || from == want) continue;
    if (want.is_shard() && current.mesh_dim_sharding(want.dim) < 0) {
      local =
          reduce_scatter_partial(local, mesh_, m, want.dim, target.extents[m], from.reduce, copied);
      current.placements[m] = want;
      current.extents[m] = target.extents[m];
    } else {
      copied.copy(local);
      local = local.contiguous().clone();
      mesh_.sub_comm({m})->all_reduce(local.comm_data(), local.comm_data(),
                                      static_cast<size_t>(local.numel()), local.dtype(),
                                      from.reduce);
      current.placements[m] = Placement::replicate();
    }
  }

  // 2. Move data; target Partial dims that are not already Partial travel as Replicate.
  ShardSpec movement = target;
  for (int m = 0; m < mesh_.ndim(); ++m)
    if (movement.placements[m].is_partial() && !current.placements[m].is_partial())
      movement.placements[m] = Placement::replicate();
  local = move_between_layouts(local, mesh_, current, movement, copied);

  // 3. Replicate -> Partial(sum): only coordinate 0 keeps the values.
  bool zero = false;
  for (int m = 0; m < mesh_.ndim(); ++m)
    zero = zero || (movement.placements[m] != target.placements[m] &&
                    target.placements[m].reduce == ReduceOp::sum && mesh_.coord()[m] != 0);
  if (zero) {
    local = Tensor::zeros(local.shape(), local.dtype(), local.device());
    copied.fill(local);
  }
  copied.record(span);
  ShardTensor result(local, mesh_, target);
  record_redistribute(*this, result);  // differentiable whenever a tape records
  return result;
}

}  // namespace tessera
