// The register-tiled forward of neighborhood attention (f16/bf16, head dim 32, 64 or 128; NATTEN
// semantics, see docs/neighborhood-attention.md).
//
// One block of 4 warps per tile of 64 queries (1-d 64, 2-d 8x8, 3-d 4x4x4, as the fused kernel);
// each warp owns 16 query rows. The union of the tile's windows (its key box) is streamed through
// shared memory 64 keys at a time, two chunks in flight (cp.async: the next chunk's K, V and key
// coordinates load while this one is computed). Per chunk and warp:
//  - S = Q K^T on mma.sync m16n8k16 (f32 accumulation): Q's fragments stay in registers for the
//    whole tile, K's come from shared memory through ldmatrix;
//  - the window mask (and the bias) applied to S in registers, in the log2 domain; the online
//    softmax's row maximum reduced over the 4 lanes that hold a row;
//  - P rounded to the element type straight from S's accumulators (an m16n8 accumulator pair is
//    an m16k16 A fragment), and O += P V with V's fragments through ldmatrix.trans.
// O and each row's running maximum and sum never leave registers; S and P never reach shared
// memory. At the end o = O / l and lse = m + log l (natural log) are written for the tile's
// queries inside the piece. The backward (fused or plain) reads this lse as it reads the fused
// forward's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ops/attention/na_cuda.cuh"
#include "ops/attention/na_mma_backward.cuh"
#include "ops/attention/na_mma_forward.cuh"

namespace tessera::ops::kernels {

namespace {

using namespace mma_detail;

/// f(std::integral_constant<int, D>, std::bool_constant<bias>) for the call's head dim D (32,
/// 64 or 128) and whether it has a bias: the kernels' instantiations.
template <typename F>
cudaError_t by_dim_and_bias(const NaCall& call, F&& f) {
  auto with_bias = [&](auto dim) {
    return call.has_rpb ? f(dim, std::true_type{}) : f(dim, std::false_type{});
  };
  switch (call.dim) {
    case 32: return with_bias(std::integral_constant<int, 32>{});
    case 64: return with_bias(std::integral_constant<int, 64>{});
    case 128: return with_bias(std::integral_constant<int, 128>{});
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int D, bool kBias, int kBlocks>
cudaError_t launch_dim(const NaCall& call, const NaForwardArgs& args, cudaStream_t stream) {
  NaTileShape tile{};
  na_fused_tile_shape(call.spatial, tile.extent);
  const int64_t tiles = na_tile_count(call, tile, false);
  if (tiles == 0 || call.batch * call.heads == 0) return cudaSuccess;
  const MaskTables tables = mask_tables(call, tile);
  const size_t bytes = MmaLayout<D>::bytes + tables.bytes;
  const cudaError_t status =
      cudaFuncSetAttribute(mma_forward<T, D, kBias, kBlocks>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(call.batch * call.heads));
  mma_forward<T, D, kBias, kBlocks><<<grid, kMmaWarps * kWarp, bytes, stream>>>(
      call, tile, tables, static_cast<const T*>(args.q), static_cast<const T*>(args.k),
      static_cast<const T*>(args.v), static_cast<const T*>(args.rpb), static_cast<T*>(args.o),
      static_cast<float*>(args.lse));
  return cudaGetLastError();
}

template <typename T, int D, bool kBias>
cudaError_t launch_backward_dim(const NaCall& call, const NaBackwardArgs& args,
                                cudaStream_t stream) {
  NaTileShape tile{};
  na_fused_tile_shape(call.spatial, tile.extent);
  const int64_t query_tiles = na_tile_count(call, tile, false),
                key_tiles = na_tile_count(call, tile, true);
  if (call.batch * call.heads == 0) return cudaSuccess;
  const MaskTables tables = mask_tables(call, tile);
  const size_t bytes = MmaBackwardLayout<D>::bytes + tables.bytes;
  for (const void* kernel : {reinterpret_cast<const void*>(mma_backward_query<T, D, kBias>),
                             reinterpret_cast<const void*>(mma_backward_key<T, D, kBias>)}) {
    const cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (status != cudaSuccess) return status;
  }
  const MmaBackward<T> g{static_cast<const T*>(args.q),
                         static_cast<const T*>(args.k),
                         static_cast<const T*>(args.v),
                         static_cast<const T*>(args.rpb),
                         static_cast<const T*>(args.go),
                         static_cast<const float*>(args.lse),
                         static_cast<const float*>(args.delta),
                         static_cast<T*>(args.dq),
                         static_cast<T*>(args.dk),
                         static_cast<T*>(args.dv)};
  const unsigned pairs = static_cast<unsigned>(call.batch * call.heads);
  if (query_tiles > 0)
    mma_backward_query<T, D, kBias>
        <<<dim3(static_cast<unsigned>(query_tiles), pairs), kMmaWarps * kWarp, bytes, stream>>>(
            call, tile, tables, g);
  if (key_tiles > 0)
    mma_backward_key<T, D, kBias>
        <<<dim3(static_cast<unsigned>(key_tiles), pairs), kMmaWarps * kWarp, bytes, stream>>>(
            call, tile, tables, g);
  return cudaGetLastError();
}

/// The forward for element type T: the kernel built for 4 blocks per SM when `args` asks for it
/// and the head dim is 32 or 64 (at 128 the shared memory allows 2 blocks whatever the registers).
template <typename T>
cudaError_t launch_forward(const NaCall& call, const NaForwardArgs& args, cudaStream_t stream) {
  return by_dim_and_bias(call, [&](auto dim, auto bias) {
    if constexpr (dim.value <= 64)
      if (args.mma_blocks == 4) return launch_dim<T, dim.value, bias.value, 4>(call, args, stream);
    return launch_dim<T, dim.value, bias.value, 1>(call, args, stream);
  });
}

}  // namespace

size_t na_mma_shared_bytes(const NaCall& call, bool backward) {
  NaTileShape tile{};
  na_fused_tile_shape(call.spatial, tile.extent);
  const size_t tables = mask_tables(call, tile).bytes;
  switch (call.dim) {
    case 32: return tables + (backward ? MmaBackwardLayout<32>::bytes : MmaLayout<32>::bytes);
    case 64: return tables + (backward ? MmaBackwardLayout<64>::bytes : MmaLayout<64>::bytes);
    default: return tables + (backward ? MmaBackwardLayout<128>::bytes : MmaLayout<128>::bytes);
  }
}

cudaError_t launch_na_backward_mma(const NaCall& call, ElementType type, const NaBackwardArgs& args,
                                   cudaStream_t stream) {
  switch (type) {
    case ElementType::f16:
      return by_dim_and_bias(call, [&](auto dim, auto bias) {
        return launch_backward_dim<__half, dim.value, bias.value>(call, args, stream);
      });
    case ElementType::bf16:
      return by_dim_and_bias(call, [&](auto dim, auto bias) {
        return launch_backward_dim<__nv_bfloat16, dim.value, bias.value>(call, args, stream);
      });
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_na_forward_mma(const NaCall& call, ElementType type, const NaForwardArgs& args,
                                  cudaStream_t stream) {
  switch (type) {
    case ElementType::f16: return launch_forward<__half>(call, args, stream);
    case ElementType::bf16: return launch_forward<__nv_bfloat16>(call, args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace tessera::ops::kernels
