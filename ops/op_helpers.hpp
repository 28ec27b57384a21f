// Helpers shared by the built-in ops' rules and kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>

#include "core/compute_threads.hpp"
#include "core/op_registry.hpp"
#include "core/parallel_for.hpp"
#include "core/shard_tensor.hpp"

namespace tessera::ops {

/// `spec` with every Partial placement replaced by Replicate (the layout a non-linear op needs).
ShardSpec without_partial(const ShardSpec& spec);

/// Layout of a gradient of a parameter of `param_shape` computed locally from activations laid
/// out as `activation`: Partial(sum) along mesh dims that shard the activation (every rank
/// saw different elements), Replicate along the others.
ShardSpec partial_over_sharding(const ShardSpec& activation, const Shape& param_shape);

/// The layout of a weight's (or bias's) gradient for a parameter laid out as `param` by a rule
/// that may shard it (tensor parallelism): its Shard placements kept, Partial(sum) over the other
/// mesh dims that shard the activation `x`, Replicate elsewhere.
ShardSpec param_grad_layout(const ShardSpec& x, const ShardSpec& param);

/// Outputs owned by each part of a split of a strided op's input (conv, pooling): output o goes to
/// the part owning input clamp(o*stride, 0, length-1); `input_extents` are the parts' extents.
std::vector<int64_t> strided_output_extents(const std::vector<int64_t>& input_extents,
                                            int64_t length, int64_t outputs, int64_t stride);

/// Outputs owned by each part of a split of an op's input when output o goes to the part owning
/// input clamp(source(o), 0, length-1) (interpolate); `source` must be non-decreasing in o.
std::vector<int64_t> source_output_extents(const std::vector<int64_t>& input_extents,
                                           int64_t length, int64_t outputs,
                                           const std::function<int64_t(int64_t)>& source);

/// Outputs owned by each part of a split of an upsampling op's input (transposed conv): output o
/// goes to the part owning input clamp(floor((o + offset) / stride), 0, length-1).
std::vector<int64_t> upsampled_output_extents(const std::vector<int64_t>& input_extents,
                                              int64_t length, int64_t outputs, int64_t stride,
                                              int64_t offset);

/// The local step of a single-input halo op's backward: the gradient of the haloed piece
/// `x_haloed` (global box `haloed_box`) from the local output gradient `g_local`.
using HaloedBackward =
    std::function<Tensor(const Tensor& g_local, const Tensor& x_haloed, const Box& haloed_box)>;

/// The backward of a single-input op whose kernel read a haloed piece of x (pooling,
/// interpolate, pad): the output gradient moved to the output's layout, `local` run on the
/// haloed piece, and the gradient that landed on halo cells sent back to its owners and added
/// there (halo_adjoint). Returns {dx} in x's layout.
std::vector<std::optional<ShardTensor>> single_input_halo_backward(
    const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads,
    const HaloedBackward& local);

/// Applies `fn(double) -> double` to every element of a floating cpu tensor (any strides);
/// returns a contiguous tensor of the same dtype. f16/bf16 compute in float. Runs on the compute
/// threads (chunks of kElementChunk elements): `fn` must not depend on the visiting order. A
/// shape-only input (estimate mode) gives a shape-only result without calling `fn`.
template <typename Fn>
Tensor map_elements(const Tensor& input, Fn&& fn);

/// Same as map_elements with two same-shape inputs: fn(a, b) (on the compute threads too).
template <typename Fn>
Tensor zip_elements(const Tensor& a, const Tensor& b, Fn&& fn);

/// Throws InvalidArgument unless `tensor` is a floating cpu tensor.
void require_floating_cpu(const Tensor& tensor, const std::string& op);

/// Elements per chunk of the parallel elementwise loops (a chunk is one thread's unit of work).
inline constexpr int64_t kElementChunk = 1 << 15;

template <typename Fn>
Tensor map_elements(const Tensor& input, Fn&& fn) {
  // Estimate mode: a shape-only input gives a shape-only result; no element is visited.
  if (input.is_shape_only()) return Tensor::empty(input.shape(), input.dtype());
  const Tensor source = input.contiguous();
  Tensor result = Tensor::empty(source.shape(), source.dtype());
  const int64_t count = source.numel();
  dispatch_dtype(source.dtype(), [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> ||
                  std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      using Compute = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const T* in = static_cast<const T*>(source.raw_data());
      T* out = static_cast<T*>(result.raw_data());
      const int64_t chunks = (count + kElementChunk - 1) / kElementChunk;
      parallel_for(chunks, compute_threads(), [&](int64_t begin, int64_t end, int) {
        for (int64_t i = begin * kElementChunk; i < std::min(count, end * kElementChunk); ++i)
          out[i] = T(static_cast<Compute>(fn(static_cast<Compute>(in[i]))));
      });
    } else {
      throw InvalidArgument("ops",
                            fmt::format("elementwise op on a {} tensor (floating dtypes only)",
                                        dtype_name(source.dtype())));
    }
  });
  return result;
}

template <typename Fn>
Tensor zip_elements(const Tensor& a, const Tensor& b, Fn&& fn) {
  TESSERA_CHECK_ARG(a.shape() == b.shape() && a.dtype() == b.dtype(), "ops",
                    "elementwise {} and {}", a.str(), b.str());
  // Estimate mode: shape-only inputs give a shape-only result; no element is visited.
  if (a.is_shape_only() || b.is_shape_only()) return Tensor::empty(a.shape(), a.dtype());
  const Tensor left = a.contiguous(), right = b.contiguous();
  Tensor result = Tensor::empty(left.shape(), left.dtype());
  const int64_t count = left.numel();
  dispatch_dtype(left.dtype(), [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> ||
                  std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      using Compute = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const T* x = static_cast<const T*>(left.raw_data());
      const T* y = static_cast<const T*>(right.raw_data());
      T* out = static_cast<T*>(result.raw_data());
      const int64_t chunks = (count + kElementChunk - 1) / kElementChunk;
      parallel_for(chunks, compute_threads(), [&](int64_t begin, int64_t end, int) {
        for (int64_t i = begin * kElementChunk; i < std::min(count, end * kElementChunk); ++i)
          out[i] =
              T(static_cast<Compute>(fn(static_cast<Compute>(x[i]), static_cast<Compute>(y[i]))));
      });
    } else {
      throw InvalidArgument("ops",
                            fmt::format("elementwise op on a {} tensor (floating dtypes only)",
                                        dtype_name(left.dtype())));
    }
  });
  return result;
}

}  // namespace tessera::ops
