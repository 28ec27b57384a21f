// Reading the committed PyTorch fixtures (tests/fixtures/<family>/: raw little-endian float64
// .bin files described by manifest.json) and the uneven layouts the fixture tests shard them with.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/layout.hpp"
#include "core/tensor.hpp"

namespace tessera::testing {

/// The fixture directory of one op family, e.g. fixture_dir("na") (TESSERA_FIXTURE_DIR is set
/// by tests/CMakeLists.txt).
inline std::string fixture_dir(const std::string& family) {
  return std::string(TESSERA_FIXTURE_DIR) + "/" + family + "/";
}

/// One fixture array of `shape` as an f64 tensor; throws when the file is missing or short.
inline Tensor read_fixture(const std::string& dir, const std::string& file, const Shape& shape) {
  Tensor tensor = Tensor::empty(shape, DType::f64);
  std::ifstream in(dir + file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open fixture " + dir + file);
  in.read(static_cast<char*>(tensor.raw_data()), static_cast<std::streamsize>(tensor.nbytes()));
  if (in.gcount() != static_cast<std::streamsize>(tensor.nbytes()))
    throw std::runtime_error("fixture " + dir + file + " is shorter than its shape");
  return tensor;
}

/// The manifest.json of a fixture directory; throws when it is missing.
inline nlohmann::json read_manifest(const std::string& dir) {
  std::ifstream file(dir + "manifest.json");
  if (!file) throw std::runtime_error("missing " + dir + "manifest.json");
  return nlohmann::json::parse(file);
}

/// Uneven extents of n over `parts`: the first part gets about twice the others' share.
inline std::vector<int64_t> lopsided(int64_t n, int parts) {
  std::vector<int64_t> extents = default_split(n, parts);
  if (parts > 1 && extents.back() > 0) {
    const int64_t moved = (extents.back() + 1) / 2;
    extents.back() -= moved;
    extents.front() += moved;
  }
  return extents;
}

/// How the fixture tests shard a fixture's x over `world` ranks: the world over the last spatial
/// dim, or a 2x2 mesh over the last two spatial dims (4 ranks, 2-d and 3-d calls), lopsided.
struct FixtureLayout {
  std::vector<int> mesh;
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
};

inline FixtureLayout fixture_layout(const Shape& x_shape, int spatial, int world) {
  FixtureLayout layout;
  layout.mesh = world == 4 && spatial >= 2 ? std::vector<int>{2, 2} : std::vector<int>{world};
  const int ndim = static_cast<int>(layout.mesh.size());
  for (int m = 0; m < ndim; ++m) {
    const int dim = static_cast<int>(x_shape.size()) - ndim + m;
    layout.placements.push_back(Placement::shard(dim));
    layout.extents.push_back(lopsided(x_shape[dim], layout.mesh[m]));
  }
  return layout;
}

}  // namespace tessera::testing
