// DeviceMesh: an N-d grid of ranks with named dims over a communicator. Rank r of the
// communicator sits at coordinate coord_of(r, shape) (row-major, see layout.hpp). Sub-
// communicators over any set of mesh dims are created on first use (a collective over the
// whole mesh, so every rank must ask in the same order) and cached.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/comm.hpp"

namespace tessera {

class DeviceMesh {
 public:
  /// Collective over `comm`: a mesh of `shape` named `names` (default "d0", "d1", ...). Throws
  /// AgreedError on every rank when the mesh size differs from the communicator size or when
  /// ranks disagree about shape or names.
  DeviceMesh(std::shared_ptr<Comm> comm, std::vector<int> shape,
             std::vector<std::string> names = {});

  /// Number of mesh dims.
  int ndim() const { return static_cast<int>(layout_->shape.size()); }
  /// Ranks along every mesh dim.
  const std::vector<int>& shape() const { return layout_->shape; }
  /// Ranks along mesh dim `dim`.
  int size(int dim) const { return layout_->shape.at(dim); }
  /// Ranks in the mesh.
  int size() const;
  /// Names of the mesh dims.
  const std::vector<std::string>& names() const { return layout_->names; }
  /// Index of the mesh dim called `name`; throws InvalidArgument naming the known dims.
  int dim_index(const std::string& name) const;
  /// This rank's mesh coordinate.
  const std::vector<int>& coord() const { return layout_->coord; }
  /// This rank in the mesh communicator.
  int rank() const { return comm_->rank(); }
  /// The communicator of the whole mesh.
  Comm& comm() const { return *comm_; }
  const std::shared_ptr<Comm>& comm_ptr() const { return comm_; }

  /// Communicator of the ranks that differ from this one only along `dims`; its rank order is
  /// row-major over those dims in the order given. Collective over the mesh on first use.
  std::shared_ptr<Comm> sub_comm(const std::vector<int>& dims) const;
  /// sub_comm of the one mesh dim called `name`.
  std::shared_ptr<Comm> dim_comm(const std::string& name) const {
    return sub_comm(std::vector<int>{dim_index(name)});
  }

  /// The same mesh with new dim names.
  DeviceMesh rename(std::vector<std::string> names) const;
  /// Mesh dim `dim` split into several dims of `sizes` (product must equal its size).
  DeviceMesh split(int dim, const std::vector<int>& sizes,
                   const std::vector<std::string>& names) const;
  /// Adjacent mesh dims [first, last] merged into one dim called `name`.
  DeviceMesh flatten(int first, int last, const std::string& name) const;
  /// The mesh over `dims` that contains this rank (collective over the mesh on first use).
  DeviceMesh submesh(const std::vector<int>& dims) const;
  /// Collective: the block of ranks with coord[dim] in [start, stop), as a mesh of the same
  /// dims; ranks outside the block get nullopt.
  std::optional<DeviceMesh> slice(int dim, int start, int stop) const;

  /// "mesh (dp=2, domain=4), rank 5 at (1, 1)".
  std::string str() const;

 private:
  struct Trusted {};
  DeviceMesh(Trusted, std::shared_ptr<Comm> comm, std::vector<int> shape,
             std::vector<std::string> names);

  /// Shape, names and this rank's coordinate: set by the constructors, never changed after, and
  /// shared by the copies (a mesh is copied with every ShardTensor, so a copy allocates nothing).
  struct Layout {
    std::vector<int> shape;
    std::vector<std::string> names;
    std::vector<int> coord;
  };
  std::shared_ptr<Comm> comm_;
  std::shared_ptr<Layout> layout_;
  std::shared_ptr<std::map<std::vector<int>, std::shared_ptr<Comm>>> sub_comms_;
};

}  // namespace tessera
