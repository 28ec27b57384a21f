// Sums of f64 lanes held in vector registers, for the cpu loops that add float or double values
// in a fixed order (the norms' chunk sums, softmax's rows): eight lanes per GCC vector, two
// vectors for 16 lanes, folded in one fixed order.
#pragma once

#include <cstring>
#include <type_traits>

namespace tessera::ops {

/// Eight f64 lanes in a vector register (two halves of 256 bits with AVX2).
using Lanes8 = double __attribute__((vector_size(64)));

/// The sum of 16 lanes, 0-7 in `low` and 8-15 in `high`, in a fixed order: lane l + lane l + 8,
/// then the halves of that folded onto each other (4, 2, 1). In vector registers: an array folded
/// through memory stalls on narrower loads of a wider store, which on rows of a few elements
/// costs more than the sums.
[[gnu::always_inline]] inline double fold(const Lanes8& low, const Lanes8& high) {
  using V4 = double __attribute__((vector_size(32)));
  using V2 = double __attribute__((vector_size(16)));
  const Lanes8 eight = low + high;
  const V4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) +
                  __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  const V2 two =
      __builtin_shufflevector(four, four, 0, 1) + __builtin_shufflevector(four, four, 2, 3);
  return two[0] + two[1];
}

/// Elements 0..7 of p widened to f64 lanes (through a reference: a 512-bit vector returned by
/// value has an ABI of its own). float and double by whole vectors; other element types (f16,
/// bf16) through float, one by one.
template <typename T>
[[gnu::always_inline]] inline void widen8(const T* p, Lanes8& v) {
  if constexpr (std::is_same_v<T, float>) {
    using Floats8 = float __attribute__((vector_size(32)));
    Floats8 f;
    std::memcpy(&f, p, sizeof f);
    v = __builtin_convertvector(f, Lanes8);
  } else if constexpr (std::is_same_v<T, double>) {
    std::memcpy(&v, p, sizeof v);
  } else {
    for (int l = 0; l < 8; ++l) v[l] = static_cast<double>(static_cast<float>(p[l]));
  }
}

}  // namespace tessera::ops
