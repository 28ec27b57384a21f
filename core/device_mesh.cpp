// DeviceMesh (see device_mesh.hpp).
#include "core/device_mesh.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/agree.hpp"

namespace tessera {

namespace {

std::vector<std::string> default_names(size_t ndim) {
  std::vector<std::string> names;
  for (size_t m = 0; m < ndim; ++m) names.push_back(fmt::format("d{}", m));
  return names;
}

std::optional<std::string> mesh_problem(const std::vector<int>& shape,
                                        const std::vector<std::string>& names, int world) {
  if (shape.empty()) return "a mesh needs at least one dim";
  for (int extent : shape)
    if (extent <= 0) return fmt::format("mesh shape {} has a non-positive dim", shape);
  if (names.size() != shape.size())
    return fmt::format("{} names given for a {}-d mesh", names.size(), shape.size());
  for (size_t a = 0; a < names.size(); ++a)
    for (size_t b = a + 1; b < names.size(); ++b)
      if (names[a] == names[b]) return fmt::format("mesh dim name '{}' is used twice", names[a]);
  if (mesh_size(shape) != world)
    return fmt::format("mesh shape {} has {} ranks but the communicator has {}", shape,
                       mesh_size(shape), world);
  return std::nullopt;
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<Comm> comm, std::vector<int> shape,
                       std::vector<std::string> names)
    : comm_(std::move(comm)),
      layout_(std::make_shared<Layout>(Layout{std::move(shape), std::move(names), {}})) {
  if (layout_->names.empty()) layout_->names = default_names(layout_->shape.size());
  agree_on_error(*comm_, "mesh", mesh_problem(layout_->shape, layout_->names, comm_->size()));
  agree_on_description(*comm_, "mesh", "mesh",
                       fmt::format("shape {} names {}", layout_->shape, layout_->names));
  layout_->coord = coord_of(comm_->rank(), layout_->shape);
  sub_comms_ = std::make_shared<std::map<std::vector<int>, std::shared_ptr<Comm>>>();
}

DeviceMesh::DeviceMesh(Trusted, std::shared_ptr<Comm> comm, std::vector<int> shape,
                       std::vector<std::string> names)
    : comm_(std::move(comm)),
      layout_(std::make_shared<Layout>(Layout{std::move(shape), std::move(names), {}})) {
  layout_->coord = coord_of(comm_->rank(), layout_->shape);
  sub_comms_ = std::make_shared<std::map<std::vector<int>, std::shared_ptr<Comm>>>();
}

int DeviceMesh::size() const {
  return mesh_size(layout_->shape);
}

int DeviceMesh::dim_index(const std::string& name) const {
  const auto it = std::find(layout_->names.begin(), layout_->names.end(), name);
  check_arg(it != layout_->names.end(), "mesh", "no mesh dim named '{}' (the mesh has {})", name,
            layout_->names);
  return static_cast<int>(it - layout_->names.begin());
}

std::shared_ptr<Comm> DeviceMesh::sub_comm(const std::vector<int>& dims) const {
  for (size_t i = 0; i < dims.size(); ++i) {
    check_arg(dims[i] >= 0 && dims[i] < ndim(), "mesh", "mesh dim {} of a {}-d mesh", dims[i],
              ndim());
    check_arg(std::find(dims.begin() + i + 1, dims.end(), dims[i]) == dims.end(), "mesh",
              "mesh dim {} appears twice in {}", dims[i], dims);
  }
  auto& cached = (*sub_comms_)[dims];
  if (cached) return cached;
  std::vector<int> identity(ndim());
  for (int m = 0; m < ndim(); ++m) identity[m] = m;
  if (dims == identity) return cached = comm_;
  // color: position along the other dims; key: row-major position along `dims`.
  int color = 0, key = 0;
  for (int m = 0; m < ndim(); ++m)
    if (std::find(dims.begin(), dims.end(), m) == dims.end())
      color = color * layout_->shape[m] + layout_->coord[m];
  for (int dim : dims) key = key * layout_->shape[dim] + layout_->coord[dim];
  return cached = comm_->split(color, key);
}

DeviceMesh DeviceMesh::rename(std::vector<std::string> names) const {
  if (auto problem = mesh_problem(layout_->shape, names, size()))
    throw InvalidArgument("mesh", *problem);
  DeviceMesh renamed(Trusted{}, comm_, layout_->shape, std::move(names));
  renamed.sub_comms_ = sub_comms_;  // same dims, same groups
  return renamed;
}

DeviceMesh DeviceMesh::split(int dim, const std::vector<int>& sizes,
                             const std::vector<std::string>& names) const {
  check_arg(dim >= 0 && dim < ndim(), "mesh", "split of mesh dim {} of a {}-d mesh", dim, ndim());
  check_arg(mesh_size(sizes) == layout_->shape[dim] && sizes.size() == names.size(), "mesh",
            "cannot split mesh dim {} of size {} into sizes {} named {}", dim, layout_->shape[dim],
            sizes, names);
  std::vector<int> shape(layout_->shape.begin(), layout_->shape.begin() + dim);
  std::vector<std::string> new_names(layout_->names.begin(), layout_->names.begin() + dim);
  shape.insert(shape.end(), sizes.begin(), sizes.end());
  new_names.insert(new_names.end(), names.begin(), names.end());
  shape.insert(shape.end(), layout_->shape.begin() + dim + 1, layout_->shape.end());
  new_names.insert(new_names.end(), layout_->names.begin() + dim + 1, layout_->names.end());
  if (auto problem = mesh_problem(shape, new_names, size()))
    throw InvalidArgument("mesh", *problem);
  return DeviceMesh(Trusted{}, comm_, shape, new_names);
}

DeviceMesh DeviceMesh::flatten(int first, int last, const std::string& name) const {
  check_arg(0 <= first && first <= last && last < ndim(), "mesh",
            "flatten of mesh dims [{}, {}] of a {}-d mesh (adjacent dims, first <= last)", first,
            last, ndim());
  std::vector<int> shape(layout_->shape.begin(), layout_->shape.begin() + first);
  std::vector<std::string> names(layout_->names.begin(), layout_->names.begin() + first);
  int merged = 1;
  for (int m = first; m <= last; ++m) merged *= layout_->shape[m];
  shape.push_back(merged);
  names.push_back(name);
  shape.insert(shape.end(), layout_->shape.begin() + last + 1, layout_->shape.end());
  names.insert(names.end(), layout_->names.begin() + last + 1, layout_->names.end());
  if (auto problem = mesh_problem(shape, names, size())) throw InvalidArgument("mesh", *problem);
  return DeviceMesh(Trusted{}, comm_, shape, names);
}

DeviceMesh DeviceMesh::submesh(const std::vector<int>& dims) const {
  std::vector<int> shape;
  std::vector<std::string> names;
  for (int dim : dims) {
    check_arg(dim >= 0 && dim < ndim(), "mesh", "mesh dim {} of a {}-d mesh", dim, ndim());
    shape.push_back(layout_->shape[dim]);
    names.push_back(layout_->names[dim]);
  }
  return DeviceMesh(Trusted{}, sub_comm(dims), shape, names);
}

std::optional<DeviceMesh> DeviceMesh::slice(int dim, int start, int stop) const {
  check_arg(dim >= 0 && dim < ndim() && 0 <= start && start < stop && stop <= layout_->shape[dim],
            "mesh", "slice [{}, {}) of mesh dim {} with {} ranks", start, stop, dim,
            dim >= 0 && dim < ndim() ? layout_->shape[dim] : 0);
  const bool inside = layout_->coord[dim] >= start && layout_->coord[dim] < stop;
  std::vector<int> shape = layout_->shape;
  shape[dim] = stop - start;
  std::vector<int> local_coord = layout_->coord;
  local_coord[dim] -= start;
  // Row-major rank inside the block keeps the mesh's rank order.
  auto comm = comm_->split(inside ? 0 : -1, inside ? rank_of(local_coord, shape) : 0);
  if (!comm) return std::nullopt;
  return DeviceMesh(Trusted{}, comm, shape, layout_->names);
}

std::string DeviceMesh::str() const {
  std::vector<std::string> dims;
  for (int m = 0; m < ndim(); ++m)
    dims.push_back(fmt::format("{}={}", layout_->names[m], layout_->shape[m]));
  return fmt::format("mesh ({}), rank {} at ({})", fmt::join(dims, ", "), rank(),
                     fmt::join(layout_->coord, ", "));
}

}  // namespace tessera
