// The cuda bodies of neighborhood attention (see na_cuda.hpp): the call validated as the cpu
// kernels validate it (na_problem.hpp), seen as the kernels' NaCall, and the launches of
// na_cuda.cu on the stream.
#include "ops/attention/na_cuda.hpp"

#include <cstdint>
#include <cstdlib>

#include "ops/attention/na_cuda.cuh"
#include "ops/attention/na_problem.hpp"
#include "ops/cuda_support.hpp"

namespace tessera::ops {

namespace {

kernels::NaElement na_element(DType dtype) {
  switch (dtype) {
    case DType::f64: return kernels::NaElement::f64;
    case DType::f16: return kernels::NaElement::f16;
    case DType::bf16: return kernels::NaElement::bf16;
    default: return kernels::NaElement::f32;
  }
}

bool aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0;
}

/// A contiguous tensor whose data starts on a 16-byte boundary (the fused kernels read rows in
/// 16-byte vectors): t itself when it is one, else a fresh copy (a view at an odd offset).
Tensor rows_of(const Tensor& t) {
  const Tensor contiguous = t.contiguous();
  return aligned(contiguous) ? contiguous : contiguous.clone();
}

/// Whether `device` has bf16 tensor cores (compute capability 8.0 or newer).
bool has_tensor_cores(Device device) {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index) ==
             cudaSuccess &&
         major >= 8;
}

/// The tensor-core kernels TESSERA_NA_CUDA_KERNEL asks for (read once; default mma, the
/// register-tiled kernels; `fused` keeps the earlier shared-memory ones).
kernels::NaKernel tensor_core_family() {
  static const kernels::NaKernel chosen = [] {
    const char* value = std::getenv("TESSERA_NA_CUDA_KERNEL");
    kernels::NaKernel kernel = kernels::NaKernel::mma;
    check_arg(kernels::parse_na_kernel_family(value, kernels::NaKernel::mma, kernel), "na",
              "TESSERA_NA_CUDA_KERNEL={}: expected fused or mma", value ? value : "");
    return kernel;
  }();
  return chosen;
}

/// The kernel for contiguous q, k, v: the dispatch of choose_na_kernel, its tensor-core choice
/// as TESSERA_NA_CUDA_KERNEL says.
kernels::NaKernel kernel_for(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t dim = q.ndim() > 0 ? q.shape(q.ndim() - 1) : 0;
  const int64_t batch_heads = q.ndim() >= 2 ? q.shape(0) * q.shape(q.ndim() - 2) : 0;
  const kernels::NaKernel kernel = kernels::choose_na_kernel(
      na_element(q.dtype()), dim, batch_heads, aligned(q) && aligned(k) && aligned(v),
      has_tensor_cores(q.device()));
  return kernel == kernels::NaKernel::fused ? tensor_core_family() : kernel;
}

/// The kernel a call runs: `asked` if the call allows it, else the dispatch's. The fused kernel
/// keeps coordinates in 32 bits, so global extents of 2^30 or more take the plain one.
kernels::NaKernel checked_kernel(std::optional<kernels::NaKernel> asked, const Tensor& q,
                                 const Tensor& k, const Tensor& v, const NaGeometry& geometry) {
  bool small = true;
  for (int64_t extent : geometry.extent) small = small && extent < (int64_t{1} << 30);
  const kernels::NaKernel possible = small ? kernel_for(q, k, v) : kernels::NaKernel::plain;
  if (!asked) return possible;
  check_arg(*asked == kernels::NaKernel::plain || possible != kernels::NaKernel::plain, "na",
            "the tensor-core cuda kernels do not take {} q of shape {} (f16/bf16, D of 32, 64 or "
            "128)",
            dtype_name(q.dtype()), q.shape());
  return *asked;
}

}  // namespace

kernels::NaKernel na_cuda_kernel_for(const Tensor& q) {
  const Tensor rows = rows_of(q);
  return kernel_for(rows, rows, rows);
}

/// Read once from TESSERA_NA_MMA_FORWARD_BLOCKS.
int na_cuda_mma_forward_blocks() {
  static const int chosen = [] {
    const char* value = std::getenv("TESSERA_NA_MMA_FORWARD_BLOCKS");
    int blocks = 0;
    check_arg(kernels::parse_na_mma_forward_blocks(value, blocks), "na",
              "TESSERA_NA_MMA_FORWARD_BLOCKS={}: expected 4 or auto", value ? value : "");
    return blocks;
  }();
  return chosen;
}

NaForward na_cuda_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                          const NaGeometry& geometry, const NaPieces& pieces, const Stream& stream,
                          std::optional<kernels::NaKernel> kernel) {
  require_cuda_operands({&q, &k, &v}, "na");
  const na_detail::Problem p = na_detail::make_problem(q, k, v, rpb, geometry, pieces, q.device());
  const kernels::NaCall call = na_detail::make_na_call(p, geometry);
  const Tensor qc = rows_of(q), kc = rows_of(k), vc = rows_of(v);
  const Tensor bias = rpb ? rpb->to_dtype(q.dtype()).contiguous() : Tensor();
  Shape lse_shape = q.shape();
  lse_shape.pop_back();
  NaForward result{Tensor::empty(q.shape(), q.dtype(), q.device()),
                   Tensor::empty(lse_shape, na_detail::lse_dtype(q.dtype()), q.device())};
  if (result.lse.numel() == 0) return result;
  const kernels::NaKernel chosen = checked_kernel(kernel, qc, kc, vc, geometry);
  kernels::NaForwardArgs args;
  args.q = qc.raw_data();
  args.k = kc.raw_data();
  args.v = vc.raw_data();
  args.rpb = rpb ? bias.raw_data() : nullptr;
  args.o = result.output.raw_data();
  args.lse = result.lse.raw_data();
  if (chosen == kernels::NaKernel::mma) args.mma_blocks = na_cuda_mma_forward_blocks();
  check_launch(kernels::launch_na_forward(chosen, call, element_type(q.dtype(), "na"), args,
                                          stream_handle(stream)),
               "na", q.device(), "neighborhood attention forward");
  return result;
}

NaGradients na_cuda_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                             const Tensor* output, const Tensor& lse, const Tensor& grad_output,
                             const Tensor* grad_lse, const NaGeometry& geometry,
                             const NaPieces& pieces, const Stream& stream,
                             std::optional<kernels::NaKernel> kernel) {
  require_cuda_operands({&q, &k, &v, &grad_output}, "na");
  const na_detail::Problem p = na_detail::make_problem(q, k, v, rpb, geometry, pieces, q.device());
  na_detail::check_backward_grads(q, grad_output, grad_lse);
  const DType stat_dtype = na_detail::lse_dtype(q.dtype());
  Shape lse_shape = q.shape();
  lse_shape.pop_back();
  TESSERA_CHECK_ARG(lse.shape() == lse_shape && lse.device() == q.device(), "na",
                    "lse {} does not belong to q {}", lse.str(), q.str());
  if (grad_lse)
    TESSERA_CHECK_ARG(grad_lse->device() == q.device(), "na", "gradient of lse {} is not on {}",
                      grad_lse->str(), q.device().str());
  if (output)
    TESSERA_CHECK_ARG(output->shape() == q.shape() && output->dtype() == q.dtype() &&
                          output->device() == q.device(),
                      "na", "output {} does not belong to q {}", output->str(), q.str());
  const kernels::NaCall call = na_detail::make_na_call(p, geometry);
  const Tensor qc = rows_of(q), kc = rows_of(k), vc = rows_of(v);
  const Tensor go = rows_of(grad_output);
  const Tensor stats = lse.to_dtype(stat_dtype).contiguous();
  const Tensor glse = grad_lse ? grad_lse->to_dtype(stat_dtype).contiguous() : Tensor();
  const Tensor bias = rpb ? rpb->to_dtype(q.dtype()).contiguous() : Tensor();
  const Tensor o = output ? output->contiguous() : Tensor();
  // delta' per (query, head): written by the query pass, read by the key and d rpb passes; the
  // stream-ordered allocator keeps it until the queued kernels are done.
  const Tensor delta = Tensor::empty(lse_shape, stat_dtype, q.device());
  NaGradients grads{Tensor::empty(q.shape(), q.dtype(), q.device()),
                    Tensor::empty(k.shape(), k.dtype(), q.device()),
                    Tensor::empty(v.shape(), v.dtype(), q.device()),
                    rpb ? Tensor::empty(rpb->shape(), q.dtype(), q.device()) : Tensor()};
  const kernels::NaKernel chosen = checked_kernel(kernel, qc, kc, vc, geometry);
  kernels::NaBackwardArgs args;
  args.q = qc.raw_data();
  args.k = kc.raw_data();
  args.v = vc.raw_data();
  args.rpb = rpb ? bias.raw_data() : nullptr;
  args.o = output ? o.raw_data() : nullptr;
  args.lse = stats.raw_data();
  args.go = go.raw_data();
  args.glse = grad_lse ? glse.raw_data() : nullptr;
  args.dq = grads.dq.raw_data();
  args.dk = grads.dk.raw_data();
  args.dv = grads.dv.raw_data();
  args.drpb = rpb ? grads.drpb.raw_data() : nullptr;
  args.delta = delta.raw_data();
  check_launch(kernels::launch_na_backward(chosen, call, element_type(q.dtype(), "na"), args,
                                           stream_handle(stream)),
               "na", q.device(), "neighborhood attention backward");
  if (rpb && rpb->dtype() != q.dtype()) grads.drpb = grads.drpb.to_dtype(rpb->dtype());
  return grads;
}

}  // namespace tessera::ops
