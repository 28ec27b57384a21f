// Layout math: placements, ShardSpec and the pure functions that say which global indices
// every rank owns. No communication happens here; every function takes the rank or mesh
// coordinate it answers for, so every rank can answer for every other rank.
//
// Conventions (fixed by the design page):
//  - mesh ranks are numbered row-major over the mesh shape;
//  - the default split of n over p gives the first n % p parts one more element;
//  - any extents >= 0 that sum to the global extent are legal, zeros included;
//  - offsets are prefix sums of extents.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/box.hpp"

namespace tessera {

/// Reduction applied by collectives and by Partial placements.
enum class ReduceOp : uint8_t { sum, avg, max, min, prod };

/// Name of a reduction ("sum", "avg", ...).
std::string reduce_op_name(ReduceOp op);

/// How a tensor is laid out along one mesh dim.
struct Placement {
  enum class Kind : uint8_t { shard, replicate, partial };
  Kind kind = Kind::replicate;
  int dim = -1;                     ///< tensor dim, for shard
  ReduceOp reduce = ReduceOp::sum;  ///< pending reduction, for partial

  /// Tensor dim `tensor_dim` split across the mesh dim.
  static Placement shard(int tensor_dim) { return {Kind::shard, tensor_dim, ReduceOp::sum}; }
  /// Every rank along the mesh dim holds the same full values.
  static Placement replicate() { return {Kind::replicate, -1, ReduceOp::sum}; }
  /// Every rank holds a partial value; the true value is their reduction by `op`.
  static Placement partial(ReduceOp op = ReduceOp::sum) { return {Kind::partial, -1, op}; }

  bool is_shard() const { return kind == Kind::shard; }
  bool is_replicate() const { return kind == Kind::replicate; }
  bool is_partial() const { return kind == Kind::partial; }
  /// "S(2)", "R" or "P(sum)".
  std::string str() const;
  bool operator==(const Placement&) const = default;
};

/// Parses "S(2)", "R", "P(sum)" (the output of Placement::str).
Placement parse_placement(const std::string& text);

/// The split of n elements over `parts` parts: the first n % parts parts get one more.
std::vector<int64_t> default_split(int64_t n, int parts);

/// Prefix sums of `extents`: parts+1 entries, starting at 0.
std::vector<int64_t> offsets_of(const std::vector<int64_t>& extents);

/// The part that owns global `index` (the one with offset <= index < offset + extent).
int owner_of(int64_t index, const std::vector<int64_t>& extents);

/// Mesh coordinate of `rank` (row-major).
std::vector<int> coord_of(int rank, const std::vector<int>& mesh_shape);

/// Rank of mesh coordinate `coord` (row-major).
int rank_of(const std::vector<int>& coord, const std::vector<int>& mesh_shape);

/// Number of ranks in a mesh of this shape.
int mesh_size(const std::vector<int>& mesh_shape);

/// The complete description of how a global tensor is spread over a mesh of a given shape.
struct ShardSpec {
  Shape global_shape;
  std::vector<int> mesh_shape;
  std::vector<Placement> placements;          ///< one per mesh dim
  std::vector<std::vector<int64_t>> extents;  ///< per mesh dim; filled only for Shard dims

  /// Validates and completes a spec. Missing extents of Shard dims get the default split.
  /// Throws InvalidArgument (tagged `op`) naming the first problem.
  static ShardSpec make(Shape global_shape, std::vector<int> mesh_shape,
                        std::vector<Placement> placements,
                        std::vector<std::vector<int64_t>> extents = {},
                        const std::string& op = "shard_spec");

  /// Global indices held by the rank at mesh coordinate `coord` (for Partial: the whole box).
  Box local_box(const std::vector<int>& coord) const;
  /// Global indices held by `rank`.
  Box local_box_of_rank(int rank) const { return local_box(coord_of(rank, mesh_shape)); }
  /// Local tensor shape of the rank at `coord`.
  Shape local_shape(const std::vector<int>& coord) const { return local_box(coord).shape(); }
  /// Mesh dim that shards tensor dim `tensor_dim`, or -1.
  int mesh_dim_sharding(int tensor_dim) const;
  /// True when some mesh dim is Partial.
  bool has_partial() const;
  /// "global (10, 7) on mesh (2, 2): S(0)[3, 7] R".
  std::string str() const;
  bool operator==(const ShardSpec&) const = default;
};

}  // namespace tessera
