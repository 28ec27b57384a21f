// Counter-based benchmark inputs and the output check (see bench_inputs.hpp).
#include "apps/bench/bench_inputs.hpp"

#include <algorithm>
#include <cmath>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/parallel_for.hpp"
#include "ops/dropout/dropout_mask.hpp"

namespace tessera::bench {

namespace {

/// Boxes below this many elements are made on the calling thread: starting threads costs more.
constexpr int64_t kThreadedVolume = int64_t{1} << 20;

template <typename T>
constexpr bool is_half_v = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

}  // namespace

float input_value(uint64_t seed, uint64_t index) {
  const uint64_t bits = ops::kernels::splitmix64(ops::kernels::splitmix64(seed) ^ index);
  // The top 24 bits: a multiple of 2^-24 in [0, 1), exact in f32, minus one half.
  return static_cast<float>(static_cast<double>(bits >> 40) * 0x1.0p-24 - 0.5);
}

Tensor random_box(const Shape& global_shape, const Box& box, uint64_t seed, DType dtype) {
  const size_t ndim = global_shape.size();
  if (box.ndim() != ndim)
    throw InvalidArgument("bench",
                          fmt::format("box {} does not match a {}-d shape", box.str(), ndim));
  for (size_t d = 0; d < ndim; ++d)
    if (box.lo[d] < 0 || box.hi[d] > global_shape[d] || box.lo[d] > box.hi[d])
      throw InvalidArgument("bench", fmt::format("box {} is not inside shape {}", box.str(),
                                                 Box::of_shape(global_shape).str()));
  Tensor values = Tensor::empty(box.shape(), dtype);
  const int64_t volume = box.volume();
  if (volume == 0) return values;
  // Rows along the last dim are contiguous both in the box and in the global tensor.
  const int64_t row = ndim == 0 ? 1 : box.extent(ndim - 1);
  const int64_t rows = volume / row;
  std::vector<int64_t> global_stride(ndim, 1);
  for (size_t d = ndim; d-- > 1;) global_stride[d - 1] = global_stride[d] * global_shape[d];
  const int threads = volume >= kThreadedVolume ? compute_threads() : 1;
  dispatch_dtype(dtype, [&]<typename T>() {
    {
      T* out = values.data<T>();
      parallel_for(rows, threads, [&](int64_t begin, int64_t end, int) {
        // The box coordinates of row `begin` (all dims but the last), advanced like an odometer.
        std::vector<int64_t> coord(ndim > 0 ? ndim - 1 : 0);
        for (int64_t rest = begin, d = static_cast<int64_t>(coord.size()) - 1; d >= 0; --d) {
          coord[d] = rest % box.extent(d);
          rest /= box.extent(d);
        }
        for (int64_t r = begin; r < end; ++r) {
          int64_t first = ndim == 0 ? 0 : box.lo[ndim - 1];
          for (size_t d = 0; d < coord.size(); ++d)
            first += (box.lo[d] + coord[d]) * global_stride[d];
          T* row_out = out + r * row;
          for (int64_t j = 0; j < row; ++j) {
            const float value = input_value(seed, static_cast<uint64_t>(first + j));
            // As Tensor::to_dtype converts an f32 tensor.
            if constexpr (is_half_v<T>)
              row_out[j] = T(value);
            else
              row_out[j] = static_cast<T>(value);
          }
          for (int64_t d = static_cast<int64_t>(coord.size()) - 1; d >= 0; --d) {
            if (++coord[d] < box.extent(d)) break;
            coord[d] = 0;
          }
        }
      });
    }
  });
  return values;
}

Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype) {
  return random_box(shape, Box::of_shape(shape), seed, dtype);
}

Mismatch count_wrong(const Tensor& reference, const Tensor& output, double tolerance) {
  if (reference.dtype() != output.dtype() || reference.shape() != output.shape() ||
      !is_floating(reference.dtype()) || !reference.device().is_cpu() || !output.device().is_cpu())
    throw InvalidArgument("bench", fmt::format("output {} {} on {} beside reference {} {} on {}",
                                               dtype_name(output.dtype()), output.shape(),
                                               output.device().str(), dtype_name(reference.dtype()),
                                               reference.shape(), reference.device().str()));
  const int64_t count = reference.numel();
  const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  constexpr int64_t kChunk = int64_t{1} << 16;
  std::vector<Mismatch> per_slot(threads);
  dispatch_dtype(reference.dtype(), [&]<typename T>() {
    const T* expected = reference.data<T>();
    const T* actual = output.data<T>();
    const auto value = [](T element) {
      if constexpr (is_half_v<T>)
        return static_cast<double>(static_cast<float>(element));
      else
        return static_cast<double>(element);
    };
    parallel_for((count + kChunk - 1) / kChunk, threads, [&](int64_t begin, int64_t end, int slot) {
      Mismatch mine;
      for (int64_t i = begin * kChunk; i < std::min(count, end * kChunk); ++i) {
        const double r = value(expected[i]);
        const double error = std::fabs(value(actual[i]) - r) / (1 + std::fabs(r));
        // A NaN (which compares false) is wrong and the largest error.
        mine.wrong += !(error <= tolerance);
        mine.max_error = std::max(mine.max_error, std::isnan(error) ? INFINITY : error);
      }
      per_slot[slot].wrong += mine.wrong;
      per_slot[slot].max_error = std::max(per_slot[slot].max_error, mine.max_error);
    });
  });
  Mismatch total;
  for (const Mismatch& slot : per_slot) {
    total.wrong += slot.wrong;
    total.max_error = std::max(total.max_error, slot.max_error);
  }
  return total;
}

}  // namespace tessera::bench
