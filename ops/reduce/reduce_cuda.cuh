// Launch interface of the reduction cuda kernels (device code in reduce_cuda.cu, C++17 for
// nvcc): deterministic sums over the plan's reduced dims (ops/reduce/reduce_plan.hpp gives the
// order), of the elements or of squared differences (mse_loss). No atomics: the same plan and
// input give bit-identical outputs on every run. Sums accumulate in float for f16, bf16 and
// f32, in double for f64; the result is multiplied by `scale` in that type, then rounded once.
#pragma once

#include <cuda_runtime.h>

#include "ops/pointwise/pointwise_cuda.cuh"
#include "ops/reduce/reduce_plan.hpp"

namespace tessera::ops::kernels {

/// What a reduction adds per element.
enum class ReduceLoad : int {
  value,               ///< a
  squared_difference,  ///< (a - b)^2
};

/// Bytes of one accumulator of `type` (the workspace's element size).
inline size_t reduce_accumulator_bytes(ElementType type) {
  return type == ElementType::f64 ? sizeof(double) : sizeof(float);
}

/// out[kept index] = scale * sum over the reduced indices of load(a, b), queued on `stream`.
/// `b` is read only for squared_difference; `workspace` must hold
/// reduce_workspace_elements(plan) accumulators (may be null when that is 0).
cudaError_t launch_reduce(ElementType type, const ReducePlan& plan, ReduceLoad load, const void* a,
                          const void* b, void* out, void* workspace, double scale,
                          cudaStream_t stream);

}  // namespace tessera::ops::kernels
