// The cuda bodies of softmax and log_softmax (see softmax_cuda.hpp): per-slot statistics on the
// device, all-gathered over the communicator on device buffers and combined in rank order there.
#include "ops/softmax/softmax_cuda.hpp"

#include "ops/cuda_support.hpp"
#include "ops/softmax/softmax_cuda.cuh"

namespace tessera::ops {

namespace {

kernels::SoftmaxSlots slots_of(const SoftmaxPiece& piece) {
  return {piece.outer, piece.length, piece.inner};
}

/// `values` [slots] (f64, on the device) combined over `comm` in place: the largest or the sum
/// in rank order, the same bits on every rank.
void combine(Comm* comm, Tensor& values, bool max, const Stream& stream, const char* op) {
  if (comm == nullptr || comm->size() == 1) return;
  const size_t count = static_cast<size_t>(values.numel());
  Tensor gathered = Tensor::empty({comm->size(), values.numel()}, DType::f64, values.device());
  comm->all_gather_v(values.raw_data(), count, gathered.raw_data(),
                     std::vector<size_t>(static_cast<size_t>(comm->size()), count), DType::f64);
  check_launch(kernels::launch_combine_rows(
                   static_cast<const double*>(gathered.raw_data()), comm->size(), values.numel(),
                   max, static_cast<double*>(values.raw_data()), stream_handle(stream)),
               op, values.device(), "combine");
}

}  // namespace

Tensor softmax_forward_cuda(const Tensor& x_in, const SoftmaxPiece& piece, Comm* comm, bool log,
                            const Stream& stream) {
  const char* op = log ? "log_softmax" : "softmax";
  require_cuda_operands({&x_in}, op);
  const Tensor x = x_in.contiguous();
  const kernels::ElementType type = element_type(x.dtype(), op);
  const int64_t slots = piece.outer * piece.inner;
  Tensor peak = Tensor::empty({slots}, DType::f64, x.device());
  Tensor total = Tensor::empty({slots}, DType::f64, x.device());
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  const cudaStream_t handle = stream_handle(stream);
  check_launch(kernels::launch_softmax_peak(type, slots_of(piece), x.raw_data(),
                                            static_cast<double*>(peak.raw_data()), handle),
               op, x.device(), "peak");
  combine(comm, peak, true, stream, op);
  check_launch(kernels::launch_softmax_total(type, slots_of(piece), x.raw_data(),
                                             static_cast<const double*>(peak.raw_data()),
                                             static_cast<double*>(total.raw_data()), handle),
               op, x.device(), "total");
  combine(comm, total, false, stream, op);
  if (log)
    check_launch(
        kernels::launch_softmax_log_totals(static_cast<double*>(total.raw_data()), slots, handle),
        op, x.device(), "log of the totals");
  check_launch(kernels::launch_softmax_output(
                   type, slots_of(piece), x.raw_data(), static_cast<const double*>(peak.raw_data()),
                   static_cast<const double*>(total.raw_data()), log, y.raw_data(), handle),
               op, x.device(), "output");
  return y;
}

Tensor softmax_backward_cuda(const Tensor& y_in, const Tensor& g_in, const SoftmaxPiece& piece,
                             Comm* comm, bool log, const Stream& stream) {
  const char* op = log ? "log_softmax" : "softmax";
  require_cuda_operands({&y_in, &g_in}, op);
  const Tensor y = y_in.contiguous();
  const Tensor g = g_in.to_dtype(y.dtype()).contiguous();
  const kernels::ElementType type = element_type(y.dtype(), op);
  const int64_t slots = piece.outer * piece.inner;
  Tensor total = Tensor::empty({slots}, DType::f64, y.device());
  Tensor dx = Tensor::empty(y.shape(), y.dtype(), y.device());
  const cudaStream_t handle = stream_handle(stream);
  check_launch(
      kernels::launch_softmax_grad_total(type, slots_of(piece), y.raw_data(), g.raw_data(), log,
                                         static_cast<double*>(total.raw_data()), handle),
      op, y.device(), "gradient total");
  combine(comm, total, false, stream, op);
  check_launch(kernels::launch_softmax_grad(type, slots_of(piece), y.raw_data(), g.raw_data(),
                                            static_cast<const double*>(total.raw_data()), log,
                                            dx.raw_data(), handle),
               op, y.device(), "gradient");
  return dx;
}

}  // namespace tessera::ops
