// Parallel loops of the cpu kernels over contiguous element ranges, each body compiled for the
// three instruction set levels of cpu_isa.hpp: parallel_ranges(count, body) splits [0, count) into
// chunks of kElementChunk elements on the compute threads and runs body(lo, hi) on each through
// the variant cpu_isa_level() picks. A body must be a lambda marked TESSERA_LOOP_BODY (always
// inlined, so that it is compiled, and vectorised, with its caller's instruction set) whose
// per-element work is branch-free; the result must not depend on how the range is chunked.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/compute_threads.hpp"
#include "core/parallel_for.hpp"
#include "ops/cpu_isa.hpp"

#if defined(__GNUC__)
#define TESSERA_LOOP_BODY __attribute__((always_inline))
#else
#define TESSERA_LOOP_BODY
#endif

namespace tessera::ops {

namespace loops_detail {
template <typename Body>
TESSERA_TARGET_V4 void run_v4(const Body& body, int64_t lo, int64_t hi) {
  body(lo, hi);
}
template <typename Body>
TESSERA_TARGET_V3 void run_v3(const Body& body, int64_t lo, int64_t hi) {
  body(lo, hi);
}
template <typename Body>
void run_generic(const Body& body, int64_t lo, int64_t hi) {
  body(lo, hi);
}
}  // namespace loops_detail

/// body(lo, hi) on [lo, hi) with the instruction set of cpu_isa_level(), on the calling thread.
template <typename Body>
void run_with_isa(const Body& body, int64_t lo, int64_t hi) {
#if TESSERA_MULTI_ISA
  const int level = cpu_isa_level();
  if (level == 4) return loops_detail::run_v4(body, lo, hi);
  if (level == 3) return loops_detail::run_v3(body, lo, hi);
#endif
  loops_detail::run_generic(body, lo, hi);
}

/// body(lo, hi) for a loop bound by memory traffic (a few operations per element it reads or
/// writes): the x86-64-v3 body (256-bit vectors) also where AVX-512 exists. Such loops of
/// 512-bit loads and stores ran slower than 256-bit ones on the Zen 4 and Intel machines measured
/// (docs/benchmarks.md, "256-bit vectors for the streaming loops"); bodies with many operations
/// per element (exp, erf, the norms' sums) keep the AVX-512 body.
template <typename Body>
void run_streaming(const Body& body, int64_t lo, int64_t hi) {
#if TESSERA_MULTI_ISA
  if (cpu_isa_level() >= 3) return loops_detail::run_v3(body, lo, hi);
#endif
  loops_detail::run_generic(body, lo, hi);
}

/// body(lo, hi) over chunks of `chunk` indices covering [0, count), on the compute threads;
/// through run_streaming where Streaming, run_with_isa otherwise.
template <bool Streaming = false, typename Body>
void parallel_ranges(int64_t count, const Body& body, int64_t chunk = int64_t{1} << 15) {
  if (count <= 0) return;
  const int64_t chunks = (count + chunk - 1) / chunk;
  parallel_for(chunks, compute_threads(), [&](int64_t begin, int64_t end, int) {
    if constexpr (Streaming)
      run_streaming(body, begin * chunk, std::min(count, end * chunk));
    else
      run_with_isa(body, begin * chunk, std::min(count, end * chunk));
  });
}

}  // namespace tessera::ops
