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
  if (m == 0 || n == 0 || batches == 0) return;
  cublasHandle_t handle = handle_for(c.device());
  check(cublasSetStream(handle, stream_handle(stream)), "set stream");
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int64_t lda = trans_a ? m : k, ldb = trans_b ? k : n;
  // Accumulating every product into one C: one call per product (they would race in a batch).
  const int64_t calls = accumulate && batches > 1 ? batches : 1;
  const int64_t per_call = calls == 1 ? batches : 1;
  const int64_t c_step = accumulate ? 0 : m * n;
  const size_t bytes = c.element_size();
  for (int64_t call = 0; call < calls; ++call) {
    const char* pa = static_cast<const char*>(a.raw_data()) + call * a_step * bytes;
    const char* pb = static_cast<const char*>(b.raw_data()) + call * b_step * bytes;
    char* pc = static_cast<char*>(c.raw_data());
    if (c.dtype() == DType::f64) {
      const double alpha = 1, beta = accumulate ? 1 : 0;
      check(cublasDgemmStridedBatched(
                handle, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                &alpha, reinterpret_cast<const double*>(pb), static_cast<int>(ldb), b_step,
                reinterpret_cast<const double*>(pa), static_cast<int>(lda), a_step, &beta,
                reinterpret_cast<double*>(pc), static_cast<int>(n), c_step,
                static_cast<int>(per_call)),
            "Dgemm");
    } else {
      const float alpha = 1, beta = accumulate ? 1 : 0;
      check(cublasSgemmStridedBatched(
                handle, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                &alpha, reinterpret_cast<const float*>(pb), static_cast<int>(ldb), b_step,
                reinterpret_cast<const float*>(pa), static_cast<int>(lda), a_step, &beta,
                reinterpret_cast<float*>(pc), static_cast<int>(n), c_step,
                static_cast<int>(per_call)),
            "Sgemm");
    }
  }
}

}  // namespace tessera::ops
