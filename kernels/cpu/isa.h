// The instruction sets the CPU backend has kernels for, and the run-time choice among them. The
// reference kernels (kernels/cpu/kernels.h) run everywhere; the fast ones need AVX2+FMA or AVX-512.
#pragma once

namespace dp::cpu {

enum class Isa { reference, avx2, avx512 };

// The best this CPU runs, unless the environment variable DP_CPU_KERNELS names a lower one
// ("reference", "avx2", "avx512"): the switch the before/after measurements and the tests use.
Isa detect_isa();
// False for an instruction set this CPU lacks, and for every fast one in a build without them (not x86-64).
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);

}  // namespace dp::cpu
