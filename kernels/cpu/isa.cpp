// The run-time choice of the CPU kernels' instruction set (kernels/cpu/isa.h).
#include "kernels/cpu/isa.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/cpu/fast.h"
#include "kernels/error.h"

namespace dp::cpu {

bool isa_supported(Isa isa) {
#if DP_FAST_X86
  switch (isa) {
    case Isa::reference:
      return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  }
  return false;
#else
  return isa == Isa::reference;
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::reference:
      return "reference";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  return "?";
}

Isa detect_isa() {
  Isa best = isa_supported(Isa::avx512) ? Isa::avx512 : isa_supported(Isa::avx2) ? Isa::avx2 : Isa::reference;
  const char* want = std::getenv("DP_CPU_KERNELS");
  if (!want || !*want) return best;
  for (Isa i : {Isa::reference, Isa::avx2, Isa::avx512})
    if (std::strcmp(want, isa_name(i)) == 0) return int(i) < int(best) ? i : best;  // at most what the CPU runs
  throw UsageError(std::string("DP_CPU_KERNELS: '") + want +
                   "' is not a kernel set; use reference, avx2 or avx512 (or unset it for the best this CPU runs)");
}

}  // namespace dp::cpu
