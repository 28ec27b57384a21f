// Launch interface of the optimizers' cuda kernels (device code in optimizer_cuda.cu, C++17 for
// nvcc): one elementwise update of `count` contiguous elements per launch, queued on `stream`,
// returning the launch status; nothing synchronizes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/optim/update_rules.hpp"

namespace tessera::optim::kernels {

/// SGD: p, grad and (with momentum) b of `count` elements.
template <typename T>
cudaError_t launch_sgd(const rules::Sgd<T>& rule, T* p, const T* grad, T* b, int64_t count,
                       cudaStream_t stream);

/// Adam/AdamW: p, grad, m, v and (amsgrad) v_max of `count` elements.
template <typename T>
cudaError_t launch_adam(const rules::Adam<T>& rule, T* p, const T* grad, T* m, T* v, T* v_max,
                        int64_t count, cudaStream_t stream);

}  // namespace tessera::optim::kernels
