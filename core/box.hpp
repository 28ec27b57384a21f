// Box: a half-open N-d range of global (or local) indices [lo, hi), the unit of every
// layout, halo and redistribution computation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

/// Extents of a tensor, one entry per dimension.
using Shape = std::vector<int64_t>;

/// A half-open N-d index range [lo, hi); empty when any hi <= lo.
struct Box {
  std::vector<int64_t> lo;
  std::vector<int64_t> hi;

  /// The box [0, shape).
  static Box of_shape(const Shape& shape);
  /// Number of dimensions.
  size_t ndim() const { return lo.size(); }
  /// Extent along `dim` (never negative).
  int64_t extent(size_t dim) const { return hi[dim] > lo[dim] ? hi[dim] - lo[dim] : 0; }
  /// Extents of every dim.
  Shape shape() const;
  /// Number of indices in the box.
  int64_t volume() const;
  /// True when the box holds no index.
  bool empty() const { return volume() == 0; }
  /// The box moved by -origin (global -> local coordinates of a piece starting at origin).
  Box relative_to(const std::vector<int64_t>& origin) const;
  /// The box moved by +delta.
  Box shifted(const std::vector<int64_t>& delta) const;
  /// "[lo0:hi0, lo1:hi1, ...]".
  std::string str() const;
  bool operator==(const Box&) const = default;
};

/// The intersection of two boxes of equal rank (possibly empty).
Box intersect(const Box& a, const Box& b);

/// `whole` minus `inner` (inner within whole; an empty inner leaves all of whole) as disjoint
/// boxes whose union is the rest: per dim in [first_dim, end_dim), the slab below and the slab
/// above inner's range, the earlier dims already cut to inner's. The other dims keep whole's
/// extent (inner must span them). At most 2 (end_dim - first_dim) boxes, none empty.
std::vector<Box> boxes_around(const Box& whole, const Box& inner, size_t first_dim, size_t end_dim);

}  // namespace tessera
