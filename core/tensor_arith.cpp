// Host elementwise arithmetic.
#include "core/tensor_arith.hpp"

#include <fmt/ranges.h>

namespace tessera {

void add_into(Tensor dst, const Tensor& src) {
  check_arg(dst.shape() == src.shape() && dst.dtype() == src.dtype(), "add", "{} += {}", dst.str(),
            src.str());
  check_arg(dst.device().is_cpu() && src.device().is_cpu(), "add",
            "add_into on {} and {} tensors (cpu only)", dst.device().str(), src.device().str());
  if (dst.numel() == 0) return;
  // Walk both tensors with an odometer over the dims; innermost dim in a tight loop.
  const int ndim = dst.ndim();
  const Shape& shape = dst.shape();
  dispatch_dtype(dst.dtype(), [&]<typename T>() {
    T* out = static_cast<T*>(dst.raw_data());
    const T* in = static_cast<const T*>(src.raw_data());
    auto add = [](T& a, const T b) {
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
        a = T(static_cast<float>(a) + static_cast<float>(b));
      else
        a = static_cast<T>(a + b);
    };
    if (ndim == 0) return add(out[0], in[0]);
    const int64_t inner = shape[ndim - 1];
    const int64_t out_step = dst.strides()[ndim - 1], in_step = src.strides()[ndim - 1];
    std::vector<int64_t> index(ndim, 0);
    const int64_t rows = dst.numel() / inner;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t out_offset = 0, in_offset = 0;
      for (int d = 0; d < ndim - 1; ++d) {
        out_offset += index[d] * dst.strides()[d];
        in_offset += index[d] * src.strides()[d];
      }
      for (int64_t i = 0; i < inner; ++i)
        add(out[out_offset + i * out_step], in[in_offset + i * in_step]);
      for (int d = ndim - 2; d >= 0; --d) {
        if (++index[d] < shape[d]) break;
        index[d] = 0;
      }
    }
  });
}

}  // namespace tessera
