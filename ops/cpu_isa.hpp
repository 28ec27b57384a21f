// The x86-64 instruction set level the cpu elementwise, reduction, softmax, dropout and
// neighborhood-attention loops run with. Their bodies are compiled three times (x86-64-v4,
// x86-64-v3 and the build's baseline) through the TESSERA_TARGET_V4/V3 attributes, and each call
// picks one with cpu_isa_level().
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TESSERA_MULTI_ISA 1
#define TESSERA_TARGET_V4 __attribute__((target("arch=x86-64-v4,prefer-vector-width=512")))
#define TESSERA_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#else
#define TESSERA_MULTI_ISA 0
#define TESSERA_TARGET_V4
#define TESSERA_TARGET_V3
#endif

namespace tessera::ops {

/// 4 (x86-64-v4: AVX-512), 3 (x86-64-v3: AVX2 and FMA) or 0 (the build's baseline): the best this
/// cpu runs, or a lower one that TESSERA_CPU_ISA (avx512 | avx2 | generic) asks for. Throws
/// InvalidArgument for another value of TESSERA_CPU_ISA or a level this cpu lacks. Read once.
int cpu_isa_level();

/// cpu_isa_level() by name: "avx512", "avx2" or "generic" (benchmarks print it).
const char* cpu_isa_name();

/// This thread's CPU time in seconds (CLOCK_THREAD_CPUTIME_ID): what the FMA peak below and the
/// benchmarks' --cpu-time figures count, leaving out time spent waiting for a core.
double thread_cpu_seconds();

/// The fused multiply-add peak of one core at cpu_isa_level() in GFLOP/s (f32), measured: 12
/// independent chains of FMAs on registers of that level's width (512-bit for avx512, 256-bit for
/// avx2), best of 12 runs of 1.5-3 ms of this thread's CPU time (a virtual machine's core
/// sometimes runs at half speed for tens of milliseconds). 0 at the generic level (no FMA
/// is assumed there). Benchmarks give their GFLOP/s as a share of it.
double cpu_fma_peak_gflops();

}  // namespace tessera::ops
