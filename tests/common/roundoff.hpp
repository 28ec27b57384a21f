// Unit roundoff of the storage dtypes, for error bounds of the GPU tests.
#pragma once

#include <cmath>

#include "core/dtype.hpp"

namespace tessera::testing {

/// Unit roundoff of a storage dtype (f16 2^-11, bf16 2^-8, f32 2^-24, else f64's 2^-53).
inline double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f32: return std::ldexp(1.0, -24);
    default: return std::ldexp(1.0, -53);
  }
}

}  // namespace tessera::testing
