// Elementwise arithmetic the core needs, through the device's backend.
#include "core/tensor_arith.hpp"

#include <fmt/ranges.h>

namespace tessera {

void add_into(Tensor dst, const Tensor& src) {
  TESSERA_CHECK_ARG(dst.shape() == src.shape() && dst.dtype() == src.dtype(), "add", "{} += {}",
                    dst.str(), src.str());
  TESSERA_CHECK_ARG(dst.device() == src.device(), "add", "add_into of a {} tensor into a {} tensor",
                    src.device().str(), dst.device().str());
  if (dst.numel() == 0) return;
  if (dst.is_shape_only()) return;  // estimate mode: no data to add
  backend_for(dst.device())
      .accumulate(strided_ref(dst), strided_ref(src), dst.dtype(), ReduceOp::sum,
                  compute_stream_for(dst.device()));
}

}  // namespace tessera
