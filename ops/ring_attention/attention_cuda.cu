// Device code of attention's block step: one warp per query row. Forward: the warp's lanes score
// 32 keys at a time (lane j: key tile + j), take the tile's max and sum with shuffles, rescale
// the row's state once per tile and add p v, each lane owning every 32nd output element.
// Backward: the same tiles give p and ds per key; dq's elements are split over the lanes, and
// lane j adds key j's dk and dv atomically (several query rows share a key). Accumulation in the
// computation type (double for f64, float otherwise).
#include <cmath>
#include <cstdint>

#include "ops/cuda_elements.cuh"
#include "ops/ring_attention/attention_cuda.cuh"

namespace tessera::ops::kernels {

namespace {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename A>
__device__ A warp_max(A value) {
  for (int offset = 16; offset > 0; offset /= 2)
    value = max(value, __shfl_xor_sync(kFullMask, value, offset));
  return value;
}

template <typename A>
__device__ A warp_sum(A value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

template <typename A>
__device__ A negative_infinity() {
  return -INFINITY;
}

__device__ void add_to(float* target, float value) {
  atomicAdd(target, value);
}
__device__ void add_to(double* target, double value) {
  atomicAdd(target, value);
}

/// The (batch, local query, head) of query row `row` of [batch, queries, heads].
struct RowIndex {
  int64_t batch, query, head;
};
__device__ RowIndex row_index(const AttentionBlock& block, int64_t row) {
  return {row / (block.queries * block.heads), (row / block.heads) % block.queries,
          row % block.heads};
}

/// The first element of key `key` (of a tensor with `width` elements per head) for `at`.
__device__ int64_t key_offset(const AttentionBlock& block, const RowIndex& at, int64_t key,
                              int64_t width) {
  return ((at.batch * block.keys + key) * block.heads + at.head) * width;
}

template <typename T>
__global__ void attention_forward_kernel(AttentionBlock block, const T* q, const T* k, const T* v,
                                         Compute<T>* peak, Compute<T>* total, Compute<T>* acc) {
  using A = Compute<T>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t rows = block.batch * block.queries * block.heads;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(kAttentionWarps) + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kAttentionWarps) {
    const RowIndex at = row_index(block, row);
    const int64_t query = global_position(block.query_runs, at.query);
    const T* qi = q + row * block.d;
    A* out = acc + row * block.dv;
    A running = peak[row], sum = total[row];
    for (int64_t tile = 0; tile < block.keys; tile += 32) {
      const int64_t key = tile + lane;
      A score = negative_infinity<A>();
      if (key < block.keys && key_visible(block, query, key)) {
        const T* kj = k + key_offset(block, at, key, block.d);
        A dot = 0;
        for (int64_t e = 0; e < block.d; ++e) dot += to_compute(qi[e]) * to_compute(kj[e]);
        score = static_cast<A>(block.scale) * dot;
      }
      const A tile_max = warp_max(score);
      if (tile_max == negative_infinity<A>()) continue;  // the same on every lane
      const A updated = max(running, tile_max);
      const A carry = exp(running - updated);  // 0 before the first visible key
      const A p = score == negative_infinity<A>() ? A(0) : exp(score - updated);
      sum = sum * carry + warp_sum(p);
      for (int64_t first = 0; first < block.dv; first += 32) {
        const int64_t e = first + lane;
        A value = e < block.dv ? out[e] * carry : A(0);
        for (int t = 0; t < 32; ++t) {
          const A pt = __shfl_sync(kFullMask, p, t);
          if (pt != A(0) && e < block.dv)
            value += pt * to_compute(v[key_offset(block, at, tile + t, block.dv) + e]);
        }
        if (e < block.dv) out[e] = value;
      }
      running = updated;
    }
    if (lane == 0) {
      peak[row] = running;
      total[row] = sum;
    }
  }
}

template <typename T>
__global__ void attention_finish_kernel(int64_t rows, int64_t dv, const Compute<T>* peak,
                                        const Compute<T>* total, const Compute<T>* acc, T* o,
                                        T* lse) {
  using A = Compute<T>;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // A row that sees no key is 0 (PyTorch's empty sum) with lse -inf.
    const A sum = total[row];
    for (int64_t e = 0; e < dv; ++e)
      o[row * dv + e] = from_compute<T>(sum > A(0) ? acc[row * dv + e] / sum : A(0));
    lse[row] = from_compute<T>(peak[row] + log(sum));
  }
}

template <typename T>
__global__ void attention_prepare_kernel(int64_t rows, int64_t dv, const T* o, const T* go,
                                         const T* lse, const T* glse, Compute<T>* delta,
                                         Compute<T>* lse_acc) {
  using A = Compute<T>;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A dot = 0;
    for (int64_t e = 0; e < dv; ++e)
      dot += to_compute(go[row * dv + e]) * to_compute(o[row * dv + e]);
    delta[row] = dot - (glse != nullptr ? to_compute(glse[row]) : A(0));
    lse_acc[row] = to_compute(lse[row]);
  }
}

template <typename T>
__global__ void attention_backward_kernel(AttentionBlock block, const T* q, const T* k, const T* v,
                                          const T* go, const Compute<T>* lse,
                                          const Compute<T>* delta, Compute<T>* dq, Compute<T>* dk,
                                          Compute<T>* dv) {
  using A = Compute<T>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t rows = block.batch * block.queries * block.heads;
  const A scale = static_cast<A>(block.scale);
  for (int64_t row = blockIdx.x * static_cast<int64_t>(kAttentionWarps) + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kAttentionWarps) {
    if (lse[row] == negative_infinity<A>()) continue;  // the row saw no key
    const RowIndex at = row_index(block, row);
    const int64_t query = global_position(block.query_runs, at.query);
    const T* qi = q + row * block.d;
    const T* goi = go + row * block.dv;
    for (int64_t tile = 0; tile < block.keys; tile += 32) {
      const int64_t key = tile + lane;
      A p = 0, ds = 0;
      if (key < block.keys && key_visible(block, query, key)) {
        const T* kj = k + key_offset(block, at, key, block.d);
        const T* vj = v + key_offset(block, at, key, block.dv);
        A score = 0, dp = 0;
        for (int64_t e = 0; e < block.d; ++e) score += to_compute(qi[e]) * to_compute(kj[e]);
        for (int64_t e = 0; e < block.dv; ++e) dp += to_compute(goi[e]) * to_compute(vj[e]);
        p = exp(scale * score - lse[row]);
        ds = p * (dp - delta[row]);
        A* dkj = dk + key_offset(block, at, key, block.d);
        A* dvj = dv + key_offset(block, at, key, block.dv);
        for (int64_t e = 0; e < block.d; ++e) add_to(dkj + e, scale * ds * to_compute(qi[e]));
        for (int64_t e = 0; e < block.dv; ++e) add_to(dvj + e, p * to_compute(goi[e]));
      }
      for (int64_t first = 0; first < block.d; first += 32) {
        const int64_t e = first + lane;
        A value = 0;
        for (int t = 0; t < 32; ++t) {
          const A dst = __shfl_sync(kFullMask, ds, t);
          if (dst != A(0) && e < block.d)
            value += dst * to_compute(k[key_offset(block, at, tile + t, block.d) + e]);
        }
        if (e < block.d) dq[row * block.d + e] += scale * value;
      }
    }
  }
}

unsigned grid_for(int64_t count) {
  const long long blocks = (count + kBlockThreads - 1) / kBlockThreads;
  return static_cast<unsigned>(blocks < kMaxGridBlocks ? blocks : kMaxGridBlocks);
}

template <typename Fn>
cudaError_t dispatch(ElementType type, Fn&& fn) {
  switch (type) {
    case ElementType::f32: return fn(float{});
    case ElementType::f64: return fn(double{});
    case ElementType::f16: return fn(__half{});
    case ElementType::bf16: return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_attention_forward_block(const AttentionBlock& block, ElementType type,
                                           const void* q, const void* k, const void* v, void* peak,
                                           void* total, void* acc, cudaStream_t stream) {
  const AttentionLaunch launch = attention_launch(block.batch * block.queries * block.heads);
  if (launch.blocks == 0 || block.keys == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    using A = Compute<T>;
    attention_forward_kernel<T><<<launch.blocks, launch.threads, 0, stream>>>(
        block, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<A*>(peak), static_cast<A*>(total), static_cast<A*>(acc));
    return cudaGetLastError();
  });
}

cudaError_t launch_attention_finish(int64_t rows, int64_t dv, ElementType type, const void* peak,
                                    const void* total, const void* acc, void* o, void* lse,
                                    cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    using A = Compute<T>;
    attention_finish_kernel<T><<<grid_for(rows), kBlockThreads, 0, stream>>>(
        rows, dv, static_cast<const A*>(peak), static_cast<const A*>(total),
        static_cast<const A*>(acc), static_cast<T*>(o), static_cast<T*>(lse));
    return cudaGetLastError();
  });
}

cudaError_t launch_attention_backward_prepare(int64_t rows, int64_t dv, ElementType type,
                                              const void* o, const void* go, const void* lse,
                                              const void* glse, void* delta, void* lse_acc,
                                              cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    using A = Compute<T>;
    attention_prepare_kernel<T><<<grid_for(rows), kBlockThreads, 0, stream>>>(
        rows, dv, static_cast<const T*>(o), static_cast<const T*>(go), static_cast<const T*>(lse),
        static_cast<const T*>(glse), static_cast<A*>(delta), static_cast<A*>(lse_acc));
    return cudaGetLastError();
  });
}

cudaError_t launch_attention_backward_block(const AttentionBlock& block, ElementType type,
                                            const void* q, const void* k, const void* v,
                                            const void* go, const void* lse_acc, const void* delta,
                                            void* dq, void* dk, void* dv, cudaStream_t stream) {
  const AttentionLaunch launch = attention_launch(block.batch * block.queries * block.heads);
  if (launch.blocks == 0 || block.keys == 0) return cudaSuccess;
  return dispatch(type, [&](auto zero) {
    using T = decltype(zero);
    using A = Compute<T>;
    attention_backward_kernel<T><<<launch.blocks, launch.threads, 0, stream>>>(
        block, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<const T*>(go), static_cast<const A*>(lse_acc), static_cast<const A*>(delta),
        static_cast<A*>(dq), static_cast<A*>(dk), static_cast<A*>(dv));
    return cudaGetLastError();
  });
}

}  // namespace tessera::ops::kernels
