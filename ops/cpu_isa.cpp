// cpu_isa_level (see cpu_isa.hpp).
#include "ops/cpu_isa.hpp"

#include <cstdlib>
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

}  // namespace

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
