// cuBLAS bodies of linear and matmul's products (see linear_cuda.hpp). Row-major C = op(A)
// op(B) is the column-major C^T = op(B)^T op(A)^T, so cuBLAS gets B first. One handle per
// thread and device, pointed at the caller's stream on every call.
#include "ops/linear/linear_cuda.hpp"

#include <cublas_v2.h>
#include <fmt/format.h>

#include <map>

#include "core/errors.hpp"
#include "core/gpu_runtime.hpp"
#include "ops/cuda_support.hpp"
#include "ops/linear/gemm_plan.hpp"

namespace tessera::ops {

namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error("matmul",
                fmt::format("cuBLAS {} failed (status {})", what, static_cast<int>(status)));
}

/// This thread's cuBLAS handle for `device` (created on first use, kept for the thread's life).
cublasHandle_t handle_for(Device device) {
  struct Handles {
    std::map<int, cublasHandle_t> by_device;
    ~Handles() {
      for (auto& [index, handle] : by_device) cublasDestroy(handle);
    }
  };
  thread_local Handles handles;
  auto it = handles.by_device.find(device.index);
  if (it != handles.by_device.end()) return it->second;
  gpu::set_device(device.index);
  cublasHandle_t handle = nullptr;
  check(cublasCreate(&handle), "create");
  // Results must not depend on the stream's history: no TF32, deterministic algorithms.
  check(cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH), "set math mode");
  handles.by_device[device.index] = handle;
  return handle;
}

}  // namespace

void gemm_cuda(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const Tensor& a,
               int64_t a_step, const Tensor& b, int64_t b_step, Tensor& c, int64_t batches,
               bool accumulate, const Stream& stream) {
  require_cuda_operands({&a, &b, &c}, "matmul");
  check_arg(a.dtype() == c.dtype() && b.dtype() == c.dtype() &&
                (c.dtype() == DType::f32 || c.dtype() == DType::f64),
            "matmul", "cuBLAS products take f32 or f64 operands of one dtype, got {}, {}, {}",
            dtype_name(a.dtype()), dtype_name(b.dtype()), dtype_name(c.dtype()));
  const CublasGemmPlan plan =
      plan_cublas_gemm(trans_a, trans_b, m, n, k, a_step, b_step, batches, accumulate);
  if (plan.action == CublasGemmPlan::Action::nothing) return;
  const size_t bytes = c.element_size();
  if (plan.action == CublasGemmPlan::Action::zero) {
    // All-zero bits are 0.0 in f32 and f64.
    gpu::set_device(c.device().index);
    gpu::zero_bytes_async(c.raw_data(), static_cast<size_t>(plan.zero_count) * bytes,
                          stream_handle(stream), c.device().index);
    return;
  }
  cublasHandle_t handle = handle_for(c.device());
  check(cublasSetStream(handle, stream_handle(stream)), "set stream");
  const cublasOperation_t op_first = plan.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = plan.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int rows = static_cast<int>(plan.rows), cols = static_cast<int>(plan.cols),
            depth = static_cast<int>(plan.depth);
  const int ld_first = static_cast<int>(plan.ld_first),
            ld_second = static_cast<int>(plan.ld_second), ld_out = static_cast<int>(plan.ld_out);
  const int per_call = static_cast<int>(plan.per_call);
  for (int64_t call = 0; call < plan.calls; ++call) {
    const char* first =
        static_cast<const char*>(b.raw_data()) + call * plan.call_step_first * bytes;
    const char* second =
        static_cast<const char*>(a.raw_data()) + call * plan.call_step_second * bytes;
    char* out = static_cast<char*>(c.raw_data());
    if (c.dtype() == DType::f64) {
      const double alpha = 1, beta = accumulate ? 1 : 0;
      check(cublasDgemmStridedBatched(
                handle, op_first, op_second, rows, cols, depth, &alpha,
                reinterpret_cast<const double*>(first), ld_first, plan.stride_first,
                reinterpret_cast<const double*>(second), ld_second, plan.stride_second, &beta,
                reinterpret_cast<double*>(out), ld_out, plan.stride_out, per_call),
            "Dgemm");
    } else {
      const float alpha = 1, beta = accumulate ? 1 : 0;
      check(cublasSgemmStridedBatched(
                handle, op_first, op_second, rows, cols, depth, &alpha,
                reinterpret_cast<const float*>(first), ld_first, plan.stride_first,
                reinterpret_cast<const float*>(second), ld_second, plan.stride_second, &beta,
                reinterpret_cast<float*>(out), ld_out, plan.stride_out, per_call),
            "Sgemm");
    }
  }
}

}  // namespace tessera::ops
