// Stub of the oneDNN conv kernels for builds without oneDNN: the dispatcher never calls them
// (conv_onednn_available() is false), so each one only guards against a wrong call.
#include <string>

#include "core/errors.hpp"
#include "ops/conv/conv_kernels.hpp"
#include "ops/conv/conv_onednn.hpp"

namespace tessera::ops {
namespace {

[[noreturn]] void throw_not_built() {
  throw NotAvailable("conv", "backend onednn requested but Tessera was built without oneDNN");
}

}  // namespace

bool conv_onednn_available() {
  return false;
}

void conv_forward_onednn(const ConvProblem&, const Tensor&, const Tensor&, const Tensor*, Tensor&) {
  throw_not_built();
}

void conv_backward_data_onednn(const ConvProblem&, const Tensor&, const Tensor&, Tensor&) {
  throw_not_built();
}

void conv_backward_weight_onednn(const ConvProblem&, const Tensor&, const Tensor&, Tensor&) {
  throw_not_built();
}

}  // namespace tessera::ops
