// Stub of the cuDNN conv kernels for builds without CUDA or cuDNN: a conv on cuda tensors
// raises NotAvailable naming what is missing.
#include <string>

#include "core/errors.hpp"
#include "ops/conv/conv_cudnn.hpp"

namespace tessera::ops {
namespace {

[[noreturn]] void throw_not_built() {
  throw NotAvailable("conv",
                     "a conv on cuda tensors needs cuDNN, and Tessera was built without "
                     "it (CUDA and cuDNN are found at configure time)");
}

}  // namespace

ConvOperand conv_operand(const Tensor& tensor) {
  return {tensor.raw_data(), tensor.shape(), tensor.strides(), tensor.dtype(), tensor.device()};
}

bool conv_cudnn_available() {
  return false;
}

void conv_forward_cudnn(const ConvOperand&, const ConvOperand&, const ConvOperand*,
                        const ConvGeometry&, const ConvOperand&) {
  throw_not_built();
}

void conv_backward_data_cudnn(const ConvOperand&, const ConvOperand&, const ConvGeometry&,
                              const ConvOperand&) {
  throw_not_built();
}

void conv_backward_filter_cudnn(const ConvOperand&, const ConvOperand&, const ConvGeometry&,
                                const ConvOperand&) {
  throw_not_built();
}

void conv_backward_bias_cudnn(const ConvOperand&, const ConvOperand&) {
  throw_not_built();
}

size_t conv_cudnn_cached_algorithms() {
  return 0;
}

std::vector<std::string> conv_cudnn_algorithm_choices() {
  return {};
}

}  // namespace tessera::ops
