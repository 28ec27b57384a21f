// cpu_isa_level (see cpu_isa.hpp).
#include "ops/cpu_isa.hpp"

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <string>

#include "core/errors.hpp"

namespace tessera::ops {

namespace {

int best_level() {
#if TESSERA_MULTI_ISA
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                  __builtin_cpu_supports("avx512cd");
  return v4 ? 4 : v3 ? 3 : 0;
#else
  return 0;
#endif
}

#if TESSERA_MULTI_ISA
/// Seconds of this thread's CPU time for `iterations` x 12 multiply-adds on registers V: 12
/// chains, FMA latency (4 cycles) times 2 FMA ports with room to spare. The empty asm keeps every
/// chain live and in a register, so the loop is nothing but the FMAs (contracted from a * m + c,
/// as in the kernels). Inlined into a caller of the instruction set's target.
template <typename V>
[[gnu::always_inline]] inline double fma_chains(long iterations, float* sink) {
  V a0 = V{} + 0.1f, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
    a9 = a0, a10 = a0, a11 = a0;
  const V m = V{} + 0.9999f, c = V{} + 0.0001f;
  const double start = thread_cpu_seconds();
  for (long i = 0; i < iterations; ++i) {
    a0 = a0 * m + c, a1 = a1 * m + c, a2 = a2 * m + c, a3 = a3 * m + c;
    a4 = a4 * m + c, a5 = a5 * m + c, a6 = a6 * m + c, a7 = a7 * m + c;
    a8 = a8 * m + c, a9 = a9 * m + c, a10 = a10 * m + c, a11 = a11 * m + c;
    __asm__(""
            : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),
              "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
  }
  const double seconds = thread_cpu_seconds() - start;
  *sink = (((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) + ((a8 + a9) + (a10 + a11)))[0];
  return seconds;
}

typedef float Floats8 __attribute__((vector_size(32)));
typedef float Floats16 __attribute__((vector_size(64)));

TESSERA_TARGET_V3 double fma_loop_256(long iterations, float* sink) {
  return fma_chains<Floats8>(iterations, sink);
}

TESSERA_TARGET_V4 double fma_loop_512(long iterations, float* sink) {
  return fma_chains<Floats16>(iterations, sink);
}
#endif

}  // namespace

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double cpu_fma_peak_gflops() {
#if TESSERA_MULTI_ISA
  const int level = cpu_isa_level();
  if (level < 3) return 0;
  const int lanes = level == 4 ? 16 : 8;
  constexpr long iterations = 1000000;  // 6 M cycles at 2 FMAs a cycle: 1.5-3 ms at 2-4 GHz
  float sink = 0;
  double best = 0;
  for (int run = 0; run < 12; ++run) {
    const double seconds =
        level == 4 ? fma_loop_512(iterations, &sink) : fma_loop_256(iterations, &sink);
    if (seconds > 0) best = std::max(best, iterations * 12.0 * lanes * 2 / seconds * 1e-9);
  }
  [[maybe_unused]] volatile float result = sink;  // the chains' sums are used
  return best;
#else
  return 0;
#endif
}

int cpu_isa_level() {
  static const int level = [] {
    const int best = best_level();
    const char* asked = std::getenv("TESSERA_CPU_ISA");
    if (asked == nullptr || *asked == '\0') return best;
    const std::string name(asked);
    const int wanted = name == "avx512" ? 4 : name == "avx2" ? 3 : name == "generic" ? 0 : -1;
    check_arg(wanted >= 0, "ops", "TESSERA_CPU_ISA={}: expected avx512, avx2 or generic", name);
    check_arg(wanted <= best, "ops",
              "TESSERA_CPU_ISA={}: this cpu (or build) runs the kernels with {} at best", name,
              best == 4   ? "avx512"
              : best == 3 ? "avx2"
                          : "generic");
    return wanted;
  }();
  return level;
}

const char* cpu_isa_name() {
  const int level = cpu_isa_level();
  return level == 4 ? "avx512" : level == 3 ? "avx2" : "generic";
}

}  // namespace tessera::ops
