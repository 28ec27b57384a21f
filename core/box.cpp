// Box arithmetic.
#include "core/box.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/errors.hpp"

namespace tessera {

Box Box::of_shape(const Shape& shape) {
  return Box{std::vector<int64_t>(shape.size(), 0), shape};
}

Shape Box::shape() const {
  Shape extents(ndim());
  for (size_t d = 0; d < ndim(); ++d) extents[d] = extent(d);
  return extents;
}

int64_t Box::volume() const {
  int64_t count = 1;
  for (size_t d = 0; d < ndim(); ++d) count *= extent(d);
  return count;
}

Box Box::relative_to(const std::vector<int64_t>& origin) const {
  Box moved = *this;
  for (size_t d = 0; d < ndim(); ++d) {
    moved.lo[d] -= origin[d];
    moved.hi[d] -= origin[d];
  }
  return moved;
}

Box Box::shifted(const std::vector<int64_t>& delta) const {
  Box moved = *this;
  for (size_t d = 0; d < ndim(); ++d) {
    moved.lo[d] += delta[d];
    moved.hi[d] += delta[d];
  }
  return moved;
}

std::string Box::str() const {
  std::string text = "[";
  for (size_t d = 0; d < ndim(); ++d) text += fmt::format("{}{}:{}", d ? ", " : "", lo[d], hi[d]);
  return text + "]";
}

Box intersect(const Box& a, const Box& b) {
  check_arg(a.ndim() == b.ndim(), "box", "cannot intersect a {}-d box with a {}-d box", a.ndim(),
            b.ndim());
  Box result = a;
  for (size_t d = 0; d < a.ndim(); ++d) {
    result.lo[d] = std::max(a.lo[d], b.lo[d]);
    result.hi[d] = std::max(result.lo[d], std::min(a.hi[d], b.hi[d]));
  }
  return result;
}

std::vector<Box> boxes_around(const Box& whole, const Box& inner, size_t first_dim,
                              size_t end_dim) {
  if (inner.empty()) return whole.empty() ? std::vector<Box>{} : std::vector<Box>{whole};
  std::vector<Box> pieces;
  Box rest = whole;
  for (size_t dim = first_dim; dim < end_dim; ++dim) {
    if (inner.lo[dim] > rest.lo[dim]) {
      Box below = rest;
      below.hi[dim] = inner.lo[dim];
      pieces.push_back(below);
    }
    if (inner.hi[dim] < rest.hi[dim]) {
      Box above = rest;
      above.lo[dim] = inner.hi[dim];
      pieces.push_back(above);
    }
    rest.lo[dim] = inner.lo[dim];
    rest.hi[dim] = inner.hi[dim];
  }
  return pieces;
}

}  // namespace tessera
