// Fast cpu kernels of neighborhood attention (NATTEN semantics), beside the exact reference of
// na_reference.hpp: same arguments, same outputs and checks, computed in f32 for f32/f16/bf16
// inputs and in f64 for f64, with a streaming softmax per query, vector loops over D and the
// queries (forward) or keys (backward) spread over threads. The sharded op `na` runs these; the
// reference stays the oracle the tests compare them with.
#pragma once

#include "ops/attention/na_reference.hpp"

namespace tessera::ops {

/// The forward kernels: query tiles (any dtype and D: up to 8 queries that are neighbours along
/// one axis share each k/v row they read, see na_cpu.cpp), and lane tiles (f32 with AVX2 or
/// AVX-512, D of 32, 64 or 128: 8 neighbours on the innermost axis as the lanes of one register).
/// automatic picks per call: lanes where they apply and the innermost axis fills them (at least
/// 3/4 of the lanes on average; with AVX-512 two query rows share a 16-lane register); a kernel
/// asked for runs where it applies (tests and benchmarks compare them), the query tiles otherwise.
enum class NaCpuForward { automatic, query_tiles, lanes };

/// The rank's own keys and values in a sharded call whose k/v tile the halo exchange filled only
/// around them (OpDef::owned_in_place): the owned pieces ([batch, spatial..., heads, D], as the
/// tile but for their spatial extents) and the tile index of their first element on each
/// spatial axis. The tile's cells they cover are not read.
struct NaOwnedKeys {
  Tensor k, v;
  std::vector<int64_t> offset;
};

/// Forward like na_forward on up to `threads` threads (0: compute_threads()). o and lse agree
/// with na_forward to rounding in the compute precision (f32: ~1e-6 relative). With `owned`, the
/// key rows the owned pieces hold are read from them (na_cpu_forward_reads_owned must hold).
NaForward na_cpu_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                         const NaGeometry& geometry, const NaPieces& pieces, int threads = 0,
                         NaCpuForward kernel = NaCpuForward::automatic,
                         const NaOwnedKeys* owned = nullptr);

/// Whether na_cpu_forward can read `owned` in place on these arguments: f32, the lane tiles run
/// (with `kernel` asked for), and the owned pieces span the tile's innermost spatial axis (the
/// lane tiles read whole key rows). Throws InvalidArgument when `owned` does not fit the tile.
bool na_cpu_forward_reads_owned(const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor* rpb, const NaGeometry& geometry,
                                const NaPieces& pieces, const NaOwnedKeys& owned,
                                NaCpuForward kernel = NaCpuForward::automatic);

/// The kernel na_cpu_forward runs on these arguments when `kernel` is asked for: query_tiles or
/// lanes (benchmarks print it, tests check which one they cover).
NaCpuForward na_cpu_forward_kernel(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor* rpb, const NaGeometry& geometry,
                                   const NaPieces& pieces,
                                   NaCpuForward kernel = NaCpuForward::automatic);

/// Backward like na_backward on up to `threads` threads (0: compute_threads()): a pass over the
/// queries (dq, the softmax statistics, d rpb in per-thread partial sums) and a pass over the
/// keys of the tile that gathers, for each key, the queries whose window holds it (dk, dv), so
/// that no two threads write the same row.
NaGradients na_cpu_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                            const Tensor& grad_output, const Tensor* grad_lse,
                            const NaGeometry& geometry, const NaPieces& pieces, int threads = 0);

}  // namespace tessera::ops
