// dropout's mask bit as the cpu and cuda kernels compute it: plain C++17 (included by
// dropout_cuda.cu too), constexpr so device code calls it (dropout_cuda.cu is compiled with
// --expt-relaxed-constexpr). The bit of the element at global row-major index i is a
// counter-based draw: splitmix64(splitmix64(seed) ^ i), whose top 53 bits make u in [0, 1);
// the element is kept when u >= p.
#pragma once

#include <cstdint>

namespace tessera::ops::kernels {

/// One round of splitmix64.
constexpr uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Whether dropout(p, seed) keeps the element at global row-major index `index`.
constexpr bool dropout_keeps(uint64_t seed, uint64_t index, double p) {
  const uint64_t bits = splitmix64(splitmix64(seed) ^ index);
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0) >= p;
}

/// Most dims of a dropout piece.
constexpr int kDropoutDims = 8;

/// A local piece of a tensor: its extents, the global index of its first element along each dim
/// and the global tensor's row-major strides.
struct DropoutPiece {
  int ndim = 0;
  int64_t extent[kDropoutDims] = {};
  int64_t lo[kDropoutDims] = {};
  int64_t global_stride[kDropoutDims] = {};
};

}  // namespace tessera::ops::kernels
