// make_cpu_ops: the one place that picks the CPU backend's implementation (kernels/cpu/cpu_ops.h).
#include "kernels/cpu/cpu_ops.h"

#include <stdexcept>
#include <string>

#include "kernels/cpu/fast.h"
#include "kernels/cpu/reference_ops.h"

namespace dp {

std::unique_ptr<Ops> make_cpu_ops(cpu::Isa isa) {
  if (!cpu::isa_supported(isa))
    throw std::invalid_argument(std::string("CPU kernels: this CPU or build does not run ") + cpu::isa_name(isa));
  switch (isa) {
#if DP_FAST_X86
    case cpu::Isa::avx2:
      return cpu::avx2::make_ops();
    case cpu::Isa::avx512:
      return cpu::avx512::make_ops();
#endif
    default:
      return std::make_unique<cpu::ReferenceOps>();
  }
}

bool cpu::conv2d_direct(Isa isa, [[maybe_unused]] const ConvShape& s) {  // unused without fast units
  if (!isa_supported(isa)) throw std::invalid_argument(std::string("CPU kernels: no ") + isa_name(isa));
  switch (isa) {
#if DP_FAST_X86
    case Isa::avx2:
      return avx2::conv2d_direct(s);
    case Isa::avx512:
      return avx512::conv2d_direct(s);
#endif
    default:
      return false;
  }
}

}  // namespace dp
