// Launch interface of the conv bias gradient kernel (device code in conv_bias_cuda.cu, C++17
// for nvcc): db[c] = sum of dy over N and every spatial position, in the order of
// ops/conv/conv_bias_plan.hpp, accumulated in float for f16, bf16 and f32 and in double for
// f64, rounded once to db's dtype. No atomics: bit-identical on every run.
#pragma once

#include <cuda_runtime.h>

#include "ops/conv/conv_bias_plan.hpp"
#include "ops/pointwise/pointwise_cuda.cuh"

namespace tessera::ops::kernels {

/// Bytes of one accumulator of `type` (the workspace's element size).
inline size_t conv_bias_accumulator_bytes(ElementType type) {
  return type == ElementType::f64 ? sizeof(double) : sizeof(float);
}

/// db[c * plan.out_stride] = sum over the reduced indices of dy[c * plan.channel_stride + ..],
/// overwriting db, queued on `stream`. `workspace` holds bias_grad_workspace_elements(plan)
/// accumulators (may be null when that is 0). With no reduced element (plan.groups 0) db = 0.
cudaError_t launch_conv_bias_grad(ElementType type, const BiasGradPlan& plan, const void* dy,
                                  void* db, void* workspace, cudaStream_t stream);

}  // namespace tessera::ops::kernels
