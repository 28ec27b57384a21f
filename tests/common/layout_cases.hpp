// Seeded generators of layout test cases, shared by the unit and the distributed suites: every
// ordered factorization of a world size into a mesh shape, and random extents (zeros included)
// that sum to a given total. Every rank that seeds a CaseRng alike draws the same cases, so the
// ranks of a distributed test agree on them without communicating.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace tessera::testing {

/// Deterministic random source of test cases (same seed, same draws, on every rank).
class CaseRng {
 public:
  explicit CaseRng(uint64_t seed) : engine_(seed) {}
  /// Uniform integer in [lo, hi].
  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(engine_);
  }
  /// True with probability `p`.
  bool chance(double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(engine_) < p; }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

namespace detail {
inline void factorizations_into(int n, int factors, std::vector<int>& prefix,
                                std::vector<std::vector<int>>& out) {
  if (factors == 1) {
    prefix.push_back(n);
    out.push_back(prefix);
    prefix.pop_back();
    return;
  }
  for (int first = 1; first <= n; ++first) {
    if (n % first) continue;
    prefix.push_back(first);
    factorizations_into(n / first, factors - 1, prefix, out);
    prefix.pop_back();
  }
}
}  // namespace detail

/// Every ordered factorization of `world_size` into 1 to `max_dims` factors (unit factors
/// included): 4 -> (4), (1,4), (2,2), (4,1), (1,1,4), (1,2,2), ..., (4,1,1).
inline std::vector<std::vector<int>> mesh_factorizations(int world_size, int max_dims = 3) {
  std::vector<std::vector<int>> shapes;
  std::vector<int> prefix;
  for (int dims = 1; dims <= max_dims; ++dims)
    detail::factorizations_into(world_size, dims, prefix, shapes);
  return shapes;
}

/// `parts` extents >= 0 summing to `total`, with zeros common (about a third of the parts are
/// forced empty, and random cuts add more when `total` is small).
inline std::vector<int64_t> random_extents(int64_t total, int parts, CaseRng& rng) {
  std::vector<int> open;  // parts allowed to be non-empty
  for (int p = 0; p < parts; ++p)
    if (!rng.chance(1.0 / 3.0)) open.push_back(p);
  if (open.empty()) open.push_back(static_cast<int>(rng.uniform(0, parts - 1)));
  std::vector<int64_t> cuts{0, total};
  for (size_t i = 1; i < open.size(); ++i) cuts.push_back(rng.uniform(0, total));
  std::sort(cuts.begin(), cuts.end());
  std::vector<int64_t> extents(parts, 0);
  for (size_t i = 0; i < open.size(); ++i) extents[open[i]] = cuts[i + 1] - cuts[i];
  return extents;
}

}  // namespace tessera::testing
