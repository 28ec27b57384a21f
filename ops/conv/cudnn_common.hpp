// What the two cuDNN paths of the conv share (conv_cudnn.cpp, the legacy calls, and
// conv_cudnn_graph.cpp, the graph API): dtype mapping, errors, the TESSERA_CUDNN_LOG switch and
// the workspace taken from the device backend's allocator. Includes cuDNN: for those two files.
#pragma once

#include <cudnn.h>

#include <cstddef>
#include <string>

#include "core/device.hpp"
#include "core/dtype.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera::ops::cudnn_common {

/// cuDNN's data type of `dtype`; InvalidArgument (tagged conv) for a dtype cuDNN does not convolve.
cudnnDataType_t data_type(DType dtype);

/// True when TESSERA_CUDNN_LOG=1: each measurement is printed to stderr (the conv, the workspace
/// offered, every candidate's workspace need and time, the choice).
bool log_measurements();

/// Throws for a failed cuDNN call: the call, the status, cuDNN's last error text, the device
/// (none when `device` < 0) and the conv; NotAvailable for CUDNN_STATUS_NOT_SUPPORTED, Error
/// otherwise.
[[noreturn]] void throw_error(const char* call, cudnnStatus_t status, int device,
                              const std::string& what);

/// The workspace a measurement on `device` may offer one conv (cudnn_workspace_limit, with
/// TESSERA_CUDNN_WORKSPACE_MB), and the memory it was judged from: the device's free bytes plus
/// what the caching allocator holds for reuse (it gives its cache back and retries when the
/// device runs out).
struct WorkspaceLimit {
  size_t limit = 0;
  size_t available = 0;
};
WorkspaceLimit workspace_limit(int device);

/// Device memory from the backend's allocator for the length of one call, handed back
/// stream-ordered (the allocator reuses it only after the queued work).
class Workspace {
 public:
  Workspace(size_t bytes, Device device, const Stream& stream);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_;
  Device device_;
  Stream stream_;
  void* data_ = nullptr;
};

}  // namespace tessera::ops::cudnn_common

#define TESSERA_CUDNN_CHECK(call, device, what)                                                  \
  do {                                                                                           \
    const cudnnStatus_t tessera_cudnn_status_ = (call);                                          \
    if (tessera_cudnn_status_ != CUDNN_STATUS_SUCCESS)                                           \
      ::tessera::ops::cudnn_common::throw_error(#call, tessera_cudnn_status_, (device), (what)); \
  } while (0)
