// cuDNN conv kernels (see conv_cudnn.hpp), on cuDNN 9's legacy convolution API
// (cudnnConvolutionForward / BackwardData / BackwardFilter, cudnnAddTensor); the bias gradient
// is the project's own reduction (conv_bias_cuda.cu), as cuDNN's takes no f16 or bf16.
// That API takes strided tensor descriptors directly, which is what running on boxes of a
// haloed buffer needs, and it measures algorithms with cudnnFind*AlgorithmEx on our own
// buffers and workspace. cuDNN 9 marks it deprecated (the graph API is its successor), so this
// file silences that warning. By default the same calls run through the graph API instead
// (conv_cudnn_graph.cpp), which reaches engines the legacy algorithm enums do not name;
// TESSERA_CUDNN_API=legacy keeps them here.
//
// Per call: descriptors are built from the operands (ops/conv/conv_cudnn_key.hpp does the
// dims/strides math), the algorithm comes from a process-wide cache keyed by everything it
// depends on, measured once per key (benchmark mode), and the convolution is queued on the
// device's compute stream with a workspace from the device backend's allocator. Each thread has
// one cudnnHandle per device, pointed at the stream of the call.
#include "ops/conv/conv_cudnn.hpp"

#include <cudnn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/errors.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/conv/conv_bias_cuda.cuh"
#include "ops/conv/conv_bias_plan.hpp"
#include "ops/conv/conv_cudnn_graph.hpp"
#include "ops/conv/conv_cudnn_key.hpp"
#include "ops/conv/cudnn_common.hpp"
#include "ops/cuda_support.hpp"

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace tessera::ops {
namespace {

using cudnn_common::data_type;
using cudnn_common::log_measurements;
using cudnn_common::Workspace;

constexpr const char* kOp = "conv";

// TESSERA_CUDNN_DETERMINISTIC=1 keeps only algorithms that give bit-identical results run to
// run (cuDNN's atomics-based backward algorithms are excluded).
bool deterministic_only() {
  static const bool on = [] {
    const char* value = std::getenv("TESSERA_CUDNN_DETERMINISTIC");
    return value != nullptr && std::string(value) == "1";
  }();
  return on;
}

CudnnAlgoCache& algorithm_cache() {
  static CudnnAlgoCache* cache = new CudnnAlgoCache;
  return *cache;
}

// ---- handles ----

// The calling thread's cuDNN handles, one per device, destroyed when the thread ends.
class ThreadHandles {
 public:
  ~ThreadHandles() {
    for (const auto& [device, handle] : handles_) {
      try {
        gpu::set_device(device);
      } catch (...) {
        continue;  // the driver is already gone at process exit: nothing to free
      }
      cudnnDestroy(handle);
    }
  }
  cudnnHandle_t get(int device) {
    auto it = handles_.find(device);
    if (it != handles_.end()) return it->second;
    cudnnHandle_t handle = nullptr;
    TESSERA_CUDNN_CHECK(cudnnCreate(&handle), device, "handle creation");
    return handles_.emplace(device, handle).first->second;
  }

 private:
  std::map<int, cudnnHandle_t> handles_;
};

// The handle of `device` for this thread, set to `stream` (the device must be current).
cudnnHandle_t handle_for(int device, const Stream& stream) {
  thread_local ThreadHandles handles;
  cudnnHandle_t handle = handles.get(device);
  TESSERA_CUDNN_CHECK(cudnnSetStream(handle, static_cast<cudaStream_t>(stream.handle)), device,
                      "setting the stream");
  return handle;
}

// ---- descriptors (RAII) ----

template <typename T, cudnnStatus_t (*Create)(T*), cudnnStatus_t (*Destroy)(T)>
class Descriptor {
 public:
  explicit Descriptor(int device) {
    TESSERA_CUDNN_CHECK(Create(&value_), device, "descriptor creation");
  }
  ~Descriptor() { Destroy(value_); }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  T get() const { return value_; }

 private:
  T value_ = nullptr;
};

using TensorDesc =
    Descriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor>;
using FilterDesc =
    Descriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor>;
using ConvDesc = Descriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
                            cudnnDestroyConvolutionDescriptor>;

cudnnMathType_t math_type(CudnnMath math) {
  switch (math) {
    case CudnnMath::fma: return CUDNN_FMA_MATH;
    case CudnnMath::default_math: return CUDNN_DEFAULT_MATH;
    case CudnnMath::tensor_op: return CUDNN_TENSOR_OP_MATH;
  }
  return CUDNN_FMA_MATH;
}

// alpha = 1 and beta = 0 or 1, in the type cuDNN reads for the operands' dtype (double for
// f64, float for the rest).
struct Scaling {
  double alpha_double = 1, zero_double = 0, one_double = 1;
  float alpha_float = 1, zero_float = 0, one_float = 1;
  bool is_double = false;
  explicit Scaling(DType dtype) : is_double(dtype == DType::f64) {}
  const void* alpha() const {
    return is_double ? static_cast<const void*>(&alpha_double) : &alpha_float;
  }
  const void* beta(bool accumulate) const {
    if (is_double) return accumulate ? &one_double : &zero_double;
    return accumulate ? &one_float : &zero_float;
  }
};

void set_tensor(const TensorDesc& desc, const CudnnTensorDims& dims, DType dtype, int device) {
  TESSERA_CUDNN_CHECK(cudnnSetTensorNdDescriptor(desc.get(), data_type(dtype), dims.rank,
                                                 dims.dims.data(), dims.strides.data()),
                      device, "tensor descriptor");
}

// ---- one convolution: descriptors, key, algorithm ----

std::string operand_text(const ConvOperand& operand) {
  return fmt::format("({})/({})", fmt::join(operand.shape, ","), fmt::join(operand.strides, ","));
}

void check_operands(const std::vector<const ConvOperand*>& operands, const char* what) {
  const ConvOperand& first = *operands.front();
  TESSERA_CHECK_ARG(first.device.is_cuda(), kOp, "cuDNN {} of a {} operand", what,
                    first.device.str());
  for (const ConvOperand* operand : operands) {
    TESSERA_CHECK_ARG(operand->device == first.device, kOp, "cuDNN {} on operands of {} and {}",
                      what, first.device.str(), operand->device.str());
    check_arg(operand->dtype == first.dtype, kOp, "cuDNN {} on operands of dtypes {} and {}", what,
              dtype_name(first.dtype), dtype_name(operand->dtype));
  }
  data_type(first.dtype);  // throws for dtypes cuDNN does not convolve
}

// The descriptors of one conv (x, w, y in forward terms) and the key of its algorithm.
struct ConvCall {
  int device;
  DType dtype;
  CudnnConvKey key;
  TensorDesc x_desc, y_desc;
  FilterDesc w_desc;
  ConvDesc conv_desc;
  std::string what;  // for error messages

  ConvCall(CudnnDirection direction, const ConvOperand& x, const ConvOperand& w,
           const ConvOperand& y, const ConvGeometry& geometry)
      : device(x.device.index),
        dtype(x.dtype),
        x_desc(x.device.index),
        y_desc(x.device.index),
        w_desc(x.device.index),
        conv_desc(x.device.index) {
    const int spatial = static_cast<int>(x.shape.size()) - 2;
    key.direction = direction;
    key.dtype = dtype;
    key.math = cudnn_math_for(dtype, conv_allow_tf32());
    key.deterministic = deterministic_only();
    key.device = device;
    key.layout = activation_layout(x.shape, x.strides);
    key.x = cudnn_tensor_dims(x.shape, x.strides, kOp);
    key.y = cudnn_tensor_dims(y.shape, y.strides, kOp);
    key.w = cudnn_filter_dims(w.shape, w.strides, kOp);
    // The dispatcher hands cuDNN only padding that is the same on both sides (pad_lo == pad_hi).
    key.params =
        cudnn_conv_params(spatial, geometry.stride, geometry.dilation, kOp, geometry.pad_lo);
    key.groups = static_cast<int>(geometry.groups);
    what = fmt::format("{} (x {}, w {}, y {})", describe(key), operand_text(x), operand_text(w),
                       operand_text(y));
    set_tensor(x_desc, key.x, dtype, device);
    set_tensor(y_desc, key.y, dtype, device);
    TESSERA_CUDNN_CHECK(
        cudnnSetFilterNdDescriptor(w_desc.get(), data_type(dtype),
                                   key.w.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                   key.w.rank, key.w.dims.data()),
        device, what);
    // Compute in f32 for f32/f16/bf16 (f16 and bf16 accumulate in f32), in f64 for f64.
    const cudnnDataType_t compute = dtype == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    TESSERA_CUDNN_CHECK(
        cudnnSetConvolutionNdDescriptor(
            conv_desc.get(), key.params.spatial, key.params.padding.data(),
            key.params.stride.data(), key.params.dilation.data(), CUDNN_CROSS_CORRELATION, compute),
        device, what);
    TESSERA_CUDNN_CHECK(cudnnSetConvolutionGroupCount(conv_desc.get(), key.groups), device, what);
    TESSERA_CUDNN_CHECK(cudnnSetConvolutionMathType(conv_desc.get(), math_type(key.math)), device,
                        what);
  }
};

int algorithm_count(CudnnDirection direction) {
  switch (direction) {
    case CudnnDirection::forward: return CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
    case CudnnDirection::backward_data: return CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
    case CudnnDirection::backward_filter: return CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  }
  return 0;
}

// Workspace bytes of `algorithm`, or nullopt when cuDNN cannot run it on this problem.
std::optional<size_t> workspace_of(cudnnHandle_t handle, const ConvCall& call, int algorithm) {
  size_t bytes = 0;
  cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
  switch (call.key.direction) {
    case CudnnDirection::forward:
      status = cudnnGetConvolutionForwardWorkspaceSize(
          handle, call.x_desc.get(), call.w_desc.get(), call.conv_desc.get(), call.y_desc.get(),
          static_cast<cudnnConvolutionFwdAlgo_t>(algorithm), &bytes);
      break;
    case CudnnDirection::backward_data:
      status = cudnnGetConvolutionBackwardDataWorkspaceSize(
          handle, call.w_desc.get(), call.y_desc.get(), call.conv_desc.get(), call.x_desc.get(),
          static_cast<cudnnConvolutionBwdDataAlgo_t>(algorithm), &bytes);
      break;
    case CudnnDirection::backward_filter:
      status = cudnnGetConvolutionBackwardFilterWorkspaceSize(
          handle, call.x_desc.get(), call.y_desc.get(), call.conv_desc.get(), call.w_desc.get(),
          static_cast<cudnnConvolutionBwdFilterAlgo_t>(algorithm), &bytes);
      break;
  }
  if (status != CUDNN_STATUS_SUCCESS) return std::nullopt;
  return bytes;
}

template <typename Perf>
std::vector<CudnnAlgoMeasurement> measurements_of(const Perf* results, int count) {
  std::vector<CudnnAlgoMeasurement> measurements;
  for (int i = 0; i < count; ++i)
    measurements.push_back({static_cast<int>(results[i].algo),
                            results[i].status == CUDNN_STATUS_SUCCESS, results[i].time,
                            results[i].memory, results[i].determinism == CUDNN_DETERMINISTIC,
                            static_cast<int>(results[i].mathType)});
  return measurements;
}

// The operands' device pointers, in forward terms; the output of the direction is written by
// the measurement (its contents are recomputed by the real call afterwards).
struct ConvPointers {
  void* x;
  void* w;
  void* y;
};

// Runs every algorithm cuDNN can run on this problem (cudnnFind*AlgorithmEx, on the operands
// themselves) and keeps the fastest that fits the workspace limit.
CudnnAlgoChoice measure(cudnnHandle_t handle, const ConvCall& call, const ConvPointers& p,
                        const Stream& stream) {
  const auto [limit, free_bytes] = cudnn_common::workspace_limit(call.device);
  size_t offered = 0;
  std::string needs;  // for TESSERA_CUDNN_LOG: each algorithm's workspace need
  for (int algorithm = 0; algorithm < algorithm_count(call.key.direction); ++algorithm) {
    const auto bytes = workspace_of(handle, call, algorithm);
    if (bytes && *bytes <= limit) offered = std::max(offered, *bytes);
    if (log_measurements())
      needs += bytes ? fmt::format(" {}:{:.1f}MiB{}", algorithm, *bytes / 1048576.0,
                                   *bytes > limit ? "(over)" : "")
                     : fmt::format(" {}:n/a", algorithm);
  }
  Workspace workspace(offered, Device::cuda(call.device), stream);
  constexpr int kMaxAlgorithms = 16;
  int returned = 0;
  std::vector<CudnnAlgoMeasurement> measurements;
  switch (call.key.direction) {
    case CudnnDirection::forward: {
      cudnnConvolutionFwdAlgoPerf_t results[kMaxAlgorithms];
      TESSERA_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(
                              handle, call.x_desc.get(), p.x, call.w_desc.get(), p.w,
                              call.conv_desc.get(), call.y_desc.get(), p.y, kMaxAlgorithms,
                              &returned, results, workspace.data(), workspace.bytes()),
                          call.device, call.what);
      measurements = measurements_of(results, returned);
      break;
    }
    case CudnnDirection::backward_data: {
      cudnnConvolutionBwdDataAlgoPerf_t results[kMaxAlgorithms];
      TESSERA_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(
                              handle, call.w_desc.get(), p.w, call.y_desc.get(), p.y,
                              call.conv_desc.get(), call.x_desc.get(), p.x, kMaxAlgorithms,
                              &returned, results, workspace.data(), workspace.bytes()),
                          call.device, call.what);
      measurements = measurements_of(results, returned);
      break;
    }
    case CudnnDirection::backward_filter: {
      cudnnConvolutionBwdFilterAlgoPerf_t results[kMaxAlgorithms];
      TESSERA_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(
                              handle, call.x_desc.get(), p.x, call.y_desc.get(), p.y,
                              call.conv_desc.get(), call.w_desc.get(), p.w, kMaxAlgorithms,
                              &returned, results, workspace.data(), workspace.bytes()),
                          call.device, call.what);
      measurements = measurements_of(results, returned);
      break;
    }
  }
  std::optional<CudnnAlgoChoice> choice =
      choose_algorithm(measurements, cudnn_determinism_for(call.key.dtype, call.key.deterministic),
                       workspace.bytes());
  if (!choice)
    throw NotAvailable(kOp, fmt::format("cuDNN has no algorithm for conv {} within a workspace "
                                        "of {} bytes{}",
                                        call.what, workspace.bytes(),
                                        call.key.deterministic ? " that is deterministic" : ""));
  // Without TF32 an f32 conv keeps FMA math whatever the measurement reports.
  if (call.key.math == CudnnMath::fma) choice->math = CUDNN_FMA_MATH;
  if (log_measurements()) {
    std::string times;
    for (const CudnnAlgoMeasurement& m : measurements)
      times += m.ok ? fmt::format(" {}:{:.3f}ms{}", m.algorithm, m.milliseconds,
                                  m.deterministic ? "" : "(atomics)")
                    : fmt::format(" {}:failed", m.algorithm);
    fmt::print(
        stderr,
        "[cudnn] {}: limit {:.0f} MiB (free or cached {:.0f} MiB), offered {:.1f} MiB; needs{}; "
        "measured{}; chose algorithm {} ({:.1f} MiB)\n",
        describe(call.key), limit / 1048576.0, free_bytes / 1048576.0, offered / 1048576.0, needs,
        times, choice->algorithm, choice->workspace_bytes / 1048576.0);
  }
  return *choice;
}

// The algorithm for `call`: cached, or measured now and cached. Measurements run one at a time
// in the process: local ranks sharing a GPU reach the same convs together, and four measuring at
// once would time each algorithm against the others' (and cache what won under contention);
// the others wait and then find the first one's choice when their key is the same.
CudnnAlgoChoice algorithm_for(cudnnHandle_t handle, const ConvCall& call, const ConvPointers& p,
                              const Stream& stream) {
  if (const auto cached = algorithm_cache().find(call.key)) return *cached;
  static std::mutex measuring;
  std::lock_guard lock(measuring);
  if (const auto cached = algorithm_cache().find(call.key)) return *cached;
  return algorithm_cache().insert(call.key, measure(handle, call, p, stream));
}

// TESSERA_CUDNN_API: graph (the default, conv_cudnn_graph.cpp) or legacy (below). A bad value gives
// the same InvalidArgument on every conv call (the static is set only once a value parses).
CudnnApi cudnn_api() {
  static const CudnnApi api = cudnn_api_from_env(std::getenv("TESSERA_CUDNN_API"));
  return api;
}

// Queues the convolution of `call` with its algorithm (output = alpha * op + 0).
void run(const ConvCall& call, const ConvPointers& p) {
  const Stream stream = compute_stream_for(Device::cuda(call.device));
  if (cudnn_api() == CudnnApi::graph) {
    conv_graph_run(call.key, p.x, p.w, p.y, stream, call.what + " (graph API)");
    return;
  }
  cudnnHandle_t handle = handle_for(call.device, stream);
  const CudnnAlgoChoice choice = algorithm_for(handle, call, p, stream);
  TESSERA_CUDNN_CHECK(
      cudnnSetConvolutionMathType(call.conv_desc.get(), static_cast<cudnnMathType_t>(choice.math)),
      call.device, call.what);
  Workspace workspace(choice.workspace_bytes, Device::cuda(call.device), stream);
  const Scaling scaling(call.dtype);
  switch (call.key.direction) {
    case CudnnDirection::forward:
      TESSERA_CUDNN_CHECK(
          cudnnConvolutionForward(
              handle, scaling.alpha(), call.x_desc.get(), p.x, call.w_desc.get(), p.w,
              call.conv_desc.get(), static_cast<cudnnConvolutionFwdAlgo_t>(choice.algorithm),
              workspace.data(), workspace.bytes(), scaling.beta(false), call.y_desc.get(), p.y),
          call.device, call.what);
      break;
    case CudnnDirection::backward_data:
      TESSERA_CUDNN_CHECK(
          cudnnConvolutionBackwardData(
              handle, scaling.alpha(), call.w_desc.get(), p.w, call.y_desc.get(), p.y,
              call.conv_desc.get(), static_cast<cudnnConvolutionBwdDataAlgo_t>(choice.algorithm),
              workspace.data(), workspace.bytes(), scaling.beta(false), call.x_desc.get(), p.x),
          call.device, call.what);
      break;
    case CudnnDirection::backward_filter:
      TESSERA_CUDNN_CHECK(
          cudnnConvolutionBackwardFilter(
              handle, scaling.alpha(), call.x_desc.get(), p.x, call.y_desc.get(), p.y,
              call.conv_desc.get(), static_cast<cudnnConvolutionBwdFilterAlgo_t>(choice.algorithm),
              workspace.data(), workspace.bytes(), scaling.beta(false), call.w_desc.get(), p.w),
          call.device, call.what);
      break;
  }
}

// ---- bias and zero fills ----

int64_t numel_of(const ConvOperand& operand) {
  return shape_numel(operand.shape);
}

// The descriptor of bias[C] broadcast over an activation of `rank` cuDNN dims: [1, C, 1, ..].
CudnnTensorDims bias_dims(const ConvOperand& bias, int rank) {
  check_arg(bias.shape.size() == 1, kOp, "bias of shape ({}), expected one entry per channel",
            fmt::join(bias.shape, ","));
  CudnnTensorDims dims;
  dims.rank = rank;
  const int64_t stride = std::max<int64_t>(bias.strides[0], 1);
  for (int d = 0; d < rank; ++d) {
    dims.dims[d] = 1;
    dims.strides[d] = static_cast<int>(d == 0 ? bias.shape[0] * stride : stride);
  }
  dims.dims[1] = static_cast<int>(bias.shape[0]);
  return dims;
}

// Every element of `operand` set to zero (any strides), on the device's compute stream.
void zero_fill(const ConvOperand& operand) {
  if (numel_of(operand) == 0) return;
  const int device = operand.device.index;
  gpu::set_device(device);
  const Stream stream = compute_stream_for(operand.device);
  cudnnHandle_t handle = handle_for(device, stream);
  TensorDesc desc(device);
  // A weight operand is filled through its activation-shaped view (same dims and strides), a
  // 1-d one (db) as [1, C, 1, 1].
  set_tensor(desc,
             operand.shape.size() == 1 ? bias_dims(operand, 4)
                                       : cudnn_tensor_dims(operand.shape, operand.strides, kOp),
             operand.dtype, device);
  const double zero = 0;  // all bits zero: 0 in every floating dtype cuDNN reads it as
  TESSERA_CUDNN_CHECK(cudnnSetTensor(handle, desc.get(), operand.data, &zero), device,
                      "zero fill of " + operand_text(operand));
}

// y += bias broadcast over N and the spatial dims.
void add_bias(const ConvOperand& bias, const ConvOperand& y) {
  const int device = y.device.index;
  const Stream stream = compute_stream_for(y.device);
  cudnnHandle_t handle = handle_for(device, stream);
  const CudnnTensorDims y_dims = cudnn_tensor_dims(y.shape, y.strides, kOp);
  TensorDesc bias_desc(device), y_desc(device);
  set_tensor(bias_desc, bias_dims(bias, y_dims.rank), y.dtype, device);
  set_tensor(y_desc, y_dims, y.dtype, device);
  const Scaling scaling(y.dtype);
  TESSERA_CUDNN_CHECK(cudnnAddTensor(handle, scaling.alpha(), bias_desc.get(), bias.data,
                                     scaling.beta(true), y_desc.get(), y.data),
                      device, "bias of " + operand_text(y));
}

void check_shape(const ConvOperand& operand, const Shape& expected, const char* name,
                 const ConvOperand& x, const ConvOperand& w) {
  check_arg(operand.shape == expected, kOp,
            "{} has shape ({}), expected ({}) for input ({}) and weight ({})", name,
            fmt::join(operand.shape, ","), fmt::join(expected, ","), fmt::join(x.shape, ","),
            fmt::join(w.shape, ","));
  check_arg(operand.strides.size() == operand.shape.size(), kOp, "{} has {} strides for {} dims",
            name, operand.strides.size(), operand.shape.size());
}

}  // namespace

ConvOperand conv_operand(const Tensor& tensor) {
  return {tensor.raw_data(), tensor.shape(), tensor.strides(), tensor.dtype(), tensor.device()};
}

bool conv_cudnn_available() {
  return true;
}

void conv_forward_cudnn(const ConvOperand& x, const ConvOperand& w, const ConvOperand* bias,
                        const ConvGeometry& geometry, const ConvOperand& y) {
  std::vector<const ConvOperand*> operands{&x, &w, &y};
  if (bias != nullptr) operands.push_back(bias);
  check_operands(operands, "forward");
  check_shape(y, conv_output_shape(x.shape, w.shape, geometry), "y", x, w);
  if (bias != nullptr)
    check_arg(bias->shape == Shape{w.shape[0]}, kOp, "bias has shape ({}), expected ({})",
              fmt::join(bias->shape, ","), w.shape[0]);
  if (numel_of(y) == 0) return;
  gpu::set_device(x.device.index);
  if (numel_of(w) == 0) {  // no input channel per group: y is the bias (or zero)
    zero_fill(y);
  } else {
    const ConvCall call(CudnnDirection::forward, x, w, y, geometry);
    run(call, {x.data, w.data, y.data});
  }
  if (bias != nullptr) add_bias(*bias, y);
}

void conv_backward_data_cudnn(const ConvOperand& dy, const ConvOperand& w,
                              const ConvGeometry& geometry, const ConvOperand& dx) {
  check_operands({&dy, &w, &dx}, "backward data");
  check_shape(dy, conv_output_shape(dx.shape, w.shape, geometry), "dy", dx, w);
  if (numel_of(dx) == 0) return;
  gpu::set_device(dx.device.index);
  if (numel_of(dy) == 0 || numel_of(w) == 0) {
    zero_fill(dx);
    return;
  }
  const ConvCall call(CudnnDirection::backward_data, dx, w, dy, geometry);
  run(call, {dx.data, w.data, dy.data});
}

void conv_backward_filter_cudnn(const ConvOperand& x, const ConvOperand& dy,
                                const ConvGeometry& geometry, const ConvOperand& dw) {
  check_operands({&x, &dy, &dw}, "backward filter");
  check_shape(dy, conv_output_shape(x.shape, dw.shape, geometry), "dy", x, dw);
  if (numel_of(dw) == 0) return;
  gpu::set_device(x.device.index);
  if (numel_of(dy) == 0 || numel_of(x) == 0) {
    zero_fill(dw);
    return;
  }
  const ConvCall call(CudnnDirection::backward_filter, x, dw, dy, geometry);
  run(call, {x.data, dw.data, dy.data});
}

void conv_backward_bias_cudnn(const ConvOperand& dy, const ConvOperand& db) {
  check_operands({&dy, &db}, "backward bias");
  check_arg(dy.shape.size() >= 3 && dy.shape.size() <= 5 && db.shape == Shape{dy.shape[1]}, kOp,
            "db of shape ({}) for dy of shape ({}): expected ({})", fmt::join(db.shape, ","),
            fmt::join(dy.shape, ","), dy.shape.size() >= 2 ? dy.shape[1] : 0);
  if (numel_of(db) == 0) return;
  gpu::set_device(dy.device.index);
  // cuDNN's cudnnConvolutionBackwardBias takes no f16 or bf16 dy (CUDNN_STATUS_NOT_SUPPORTED
  // in cuDNN 9), so every dtype runs the project's deterministic reduction (one path, tested
  // in all of them). An empty dy (N or a spatial extent 0) gives db = 0 through it too.
  const BiasGradPlan plan = bias_grad_plan(
      dy.shape, dy.strides, db.strides.empty() ? 1 : db.strides[0], dtype_size(dy.dtype));
  const Stream stream = compute_stream_for(dy.device);
  const kernels::ElementType type = element_type(dy.dtype, kOp);
  // The chunk sums are handed back stream-ordered: reused only by work queued after ours.
  const Workspace workspace(static_cast<size_t>(bias_grad_workspace_elements(plan)) *
                                kernels::conv_bias_accumulator_bytes(type),
                            dy.device, stream);
  check_launch(kernels::launch_conv_bias_grad(type, plan, dy.data, db.data, workspace.data(),
                                              stream_handle(stream)),
               kOp, dy.device, "conv bias gradient");
}

size_t conv_cudnn_cached_algorithms() {
  return algorithm_cache().size() + conv_graph_cached_choices();
}

std::vector<std::string> conv_cudnn_algorithm_choices() {
  std::vector<std::string> lines;
  for (const auto& [key, choice] : algorithm_cache().entries())
    lines.push_back(fmt::format("{}: algorithm {} math {} workspace {} bytes", describe(key),
                                choice.algorithm, choice.math, choice.workspace_bytes));
  for (std::string& line : conv_graph_choices()) lines.push_back(std::move(line));
  std::sort(lines.begin(), lines.end());
  return lines;
}

}  // namespace tessera::ops
