// Layout math (see layout.hpp for the conventions).
#include "core/layout.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>

#include "core/checked_math.hpp"
#include "core/errors.hpp"

namespace tessera {

std::string reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
    case ReduceOp::prod: return "prod";
  }
  return "unknown";
}

std::string Placement::str() const {
  switch (kind) {
    case Kind::shard: return fmt::format("S({})", dim);
    case Kind::replicate: return "R";
    case Kind::partial: return fmt::format("P({})", reduce_op_name(reduce));
  }
  return "?";
}

Placement parse_placement(const std::string& text) {
  if (text == "R") return Placement::replicate();
  if (text.size() > 3 && text[1] == '(' && text.back() == ')') {
    const std::string inner = text.substr(2, text.size() - 3);
    if (text[0] == 'S') return Placement::shard(std::stoi(inner));
    if (text[0] == 'P')
      for (ReduceOp op :
           {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod})
        if (reduce_op_name(op) == inner) return Placement::partial(op);
  }
  throw InvalidArgument("placement", fmt::format("cannot parse '{}' (expected S(d), R or "
                                                 "P(sum|avg|max|min|prod))",
                                                 text));
}

std::vector<int64_t> default_split(int64_t n, int parts) {
  check_arg(parts > 0 && n >= 0, "layout", "cannot split {} elements over {} parts", n, parts);
  std::vector<int64_t> extents(parts, n / parts);
  for (int64_t p = 0; p < n % parts; ++p) ++extents[p];
  return extents;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& extents) {
  std::vector<int64_t> offsets(extents.size() + 1, 0);
  std::partial_sum(extents.begin(), extents.end(), offsets.begin() + 1);
  return offsets;
}

int owner_of(int64_t index, const std::vector<int64_t>& extents) {
  const std::vector<int64_t> offsets = offsets_of(extents);
  check_arg(index >= 0 && index < offsets.back(), "layout",
            "index {} is outside the extent {} split as {}", index, offsets.back(), extents);
  // The last part whose offset is <= index: skips empty parts that share the offset.
  const auto it = std::upper_bound(offsets.begin(), offsets.end(), index);
  return static_cast<int>(it - offsets.begin()) - 1;
}

std::vector<int> coord_of(int rank, const std::vector<int>& mesh_shape) {
  std::vector<int> coord(mesh_shape.size());
  for (size_t m = mesh_shape.size(); m-- > 0;) {
    coord[m] = rank % mesh_shape[m];
    rank /= mesh_shape[m];
  }
  return coord;
}

int rank_of(const std::vector<int>& coord, const std::vector<int>& mesh_shape) {
  int rank = 0;
  for (size_t m = 0; m < mesh_shape.size(); ++m) rank = rank * mesh_shape[m] + coord[m];
  return rank;
}

int mesh_size(const std::vector<int>& mesh_shape) {
  return std::accumulate(mesh_shape.begin(), mesh_shape.end(), 1, std::multiplies<int>());
}

ShardSpec ShardSpec::make(Shape global_shape, std::vector<int> mesh_shape,
                          std::vector<Placement> placements,
                          std::vector<std::vector<int64_t>> extents, const std::string& op) {
  check_arg(placements.size() == mesh_shape.size(), op,
            "{} placements given for a {}-d mesh (one per mesh dim expected)", placements.size(),
            mesh_shape.size());
  check_arg(extents.empty() || extents.size() == mesh_shape.size(), op,
            "extents given for {} mesh dims, the mesh has {}", extents.size(), mesh_shape.size());
  for (int64_t extent : global_shape)
    check_arg(extent >= 0, op, "global shape {} has a negative extent", global_shape);
  extents.resize(mesh_shape.size());
  std::vector<int> sharded_by(global_shape.size(), -1);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    check_arg(mesh_shape[m] > 0, op, "mesh shape {} has a non-positive dim", mesh_shape);
    const Placement& placement = placements[m];
    if (!placement.is_shard()) {
      TESSERA_CHECK_ARG(extents[m].empty(), op, "mesh dim {} is {} but was given extents {}", m,
                        placement.str(), extents[m]);
      continue;
    }
    const int dim = placement.dim;
    check_arg(dim >= 0 && dim < static_cast<int>(global_shape.size()), op,
              "mesh dim {} shards tensor dim {}, but the tensor has {} dims", m, dim,
              global_shape.size());
    check_arg(sharded_by[dim] < 0, op,
              "tensor dim {} is sharded by mesh dims {} and {}; sharding one tensor dim over "
              "several mesh dims is not supported (flatten those mesh dims first)",
              dim, sharded_by[dim], m);
    sharded_by[dim] = static_cast<int>(m);
    if (extents[m].empty()) extents[m] = default_split(global_shape[dim], mesh_shape[m]);
    check_arg(static_cast<int>(extents[m].size()) == mesh_shape[m], op,
              "mesh dim {} has {} ranks but {} extents were given ({})", m, mesh_shape[m],
              extents[m].size(), extents[m]);
    int64_t total = 0;
    for (int64_t extent : extents[m]) {
      check_arg(extent >= 0, op, "extents {} of tensor dim {} contain a negative value", extents[m],
                dim);
      total = checked_add(total, extent, op, "sum of extents");  // no wrap-around to a match
    }
    check_arg(total == global_shape[dim], op,
              "extents {} of tensor dim {} sum to {}, expected the global extent {}", extents[m],
              dim, total, global_shape[dim]);
  }
  return ShardSpec{std::move(global_shape), std::move(mesh_shape), std::move(placements),
                   std::move(extents)};
}

Box ShardSpec::local_box(const std::vector<int>& coord) const {
  Box box = Box::of_shape(global_shape);
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    if (!placements[m].is_shard()) continue;
    const int dim = placements[m].dim;
    int64_t offset = 0;
    for (int c = 0; c < coord[m]; ++c) offset += extents[m][c];
    box.lo[dim] = offset;
    box.hi[dim] = offset + extents[m][coord[m]];
  }
  return box;
}

int ShardSpec::mesh_dim_sharding(int tensor_dim) const {
  for (size_t m = 0; m < placements.size(); ++m)
    if (placements[m].is_shard() && placements[m].dim == tensor_dim) return static_cast<int>(m);
  return -1;
}

bool ShardSpec::has_partial() const {
  return std::any_of(placements.begin(), placements.end(),
                     [](const Placement& p) { return p.is_partial(); });
}

std::string ShardSpec::str() const {
  std::string text = fmt::format("global {} on mesh {}:", global_shape, mesh_shape);
  for (size_t m = 0; m < placements.size(); ++m) {
    text += ' ';
    text += placements[m].str();
    if (placements[m].is_shard()) text += fmt::format("{}", extents[m]);
  }
  return text;
}

}  // namespace tessera
