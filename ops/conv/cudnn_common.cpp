// The pieces both cuDNN paths of the conv share (see cudnn_common.hpp).
#include "ops/conv/cudnn_common.hpp"

#include <fmt/format.h>

#include <cstdlib>

#include "core/backend/backend.hpp"
#include "core/errors.hpp"
#include "core/gpu_runtime.hpp"
#include "ops/conv/conv_cudnn_key.hpp"

namespace tessera::ops::cudnn_common {

namespace {
constexpr const char* kOp = "conv";
}  // namespace

cudnnDataType_t data_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return CUDNN_DATA_FLOAT;
    case DType::f64: return CUDNN_DATA_DOUBLE;
    case DType::f16: return CUDNN_DATA_HALF;
    case DType::bf16: return CUDNN_DATA_BFLOAT16;
    default: break;
  }
  throw InvalidArgument(
      kOp, fmt::format("cuDNN convolutions take f32, f64, f16 or bf16, got {}", dtype_name(dtype)));
}

bool log_measurements() {
  static const bool on = [] {
    const char* value = std::getenv("TESSERA_CUDNN_LOG");
    return value != nullptr && std::string(value) == "1";
  }();
  return on;
}

void throw_error(const char* call, cudnnStatus_t status, int device, const std::string& what) {
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  const std::string message =
      fmt::format("{} failed{}: {} ({}){} for conv {}", call,
                  device >= 0 ? fmt::format(" on cuda:{}", device) : std::string(),
                  cudnnGetErrorString(status), static_cast<int>(status),
                  detail[0] != 0 ? fmt::format(" [{}]", detail) : std::string(), what);
  if (status == CUDNN_STATUS_NOT_SUPPORTED) throw NotAvailable(kOp, message);
  throw Error(kOp, message);
}

WorkspaceLimit workspace_limit(int device) {
  size_t free_bytes = 0, total_bytes = 0;
  gpu::memory_info(device, &free_bytes, &total_bytes);
  const Device cuda = Device::cuda(device);
  free_bytes += backend_for(cuda).allocator_stats(cuda).cached;
  static const char* const cap_mb = std::getenv("TESSERA_CUDNN_WORKSPACE_MB");
  return {cudnn_workspace_limit(cap_mb, total_bytes, free_bytes), free_bytes};
}

Workspace::Workspace(size_t bytes, Device device, const Stream& stream)
    : bytes_(bytes), device_(device), stream_(stream) {
  if (bytes_ > 0) data_ = backend_for(device_).allocate(bytes_, device_, stream_, kOp);
}

Workspace::~Workspace() {
  if (data_ != nullptr) backend_for(device_).release(data_, bytes_, device_, stream_);
}

}  // namespace tessera::ops::cudnn_common
