// Benchmark inputs: deterministic tensors whose element at global row-major index i depends only
// on (seed, i), so that each rank builds exactly its own box of a global tensor (no rank makes
// the whole tensor and keeps a slice of it) and every layout sees the same global values. And
// the check of an output against a reference (the #wrong column).
#pragma once

#include <cstdint>

#include "core/box.hpp"
#include "core/tensor.hpp"

namespace tessera::bench {

/// The value of the element at global row-major index `index` of the benchmark tensor seeded
/// `seed`: uniform in [-0.5, 0.5) on a grid of 2^-24 (exact in f32).
float input_value(uint64_t seed, uint64_t index);

/// The box `box` of the global tensor of `global_shape` seeded `seed`, made in f32 and converted
/// to `dtype` element by element (what random_tensor(global_shape, seed, dtype) holds there),
/// with the rank's compute threads when the box is large.
Tensor random_box(const Shape& global_shape, const Box& box, uint64_t seed,
                  DType dtype = DType::f32);

/// The whole tensor of `shape` seeded `seed` in `dtype`: benchmark inputs that every rank can
/// build alike.
Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype = DType::f32);

/// How `output` differs from `reference`: the elements off by more than `tolerance` *
/// (1 + |reference|), and the largest |output - reference| / (1 + |reference|).
struct Mismatch {
  int64_t wrong = 0;
  double max_error = 0;
};

/// The mismatch of `output` against `reference` (same shape and floating dtype), compared in f64
/// element by element on the host's threads (no converted copy of either tensor). Both on the
/// cpu.
Mismatch count_wrong(const Tensor& reference, const Tensor& output, double tolerance);

}  // namespace tessera::bench
