// TESSERA_CUDA_CHECK: turns a failed CUDA runtime call into an Error naming the call, the
// device and the op.
#pragma once

#include <cuda_runtime.h>

#include "core/comm/comm.hpp"
#include "core/errors.hpp"

#define TESSERA_CUDA_CHECK(call, device)                                                        \
  do {                                                                                          \
    const cudaError_t tessera_status_ = (call);                                                 \
    if (tessera_status_ != cudaSuccess)                                                         \
      throw ::tessera::Error(                                                                   \
          ::tessera::current_comm_op(),                                                         \
          fmt::format("{} failed on cuda:{}: {} ({})", #call, (device),                         \
                      cudaGetErrorString(tessera_status_), cudaGetErrorName(tessera_status_))); \
  } while (0)
