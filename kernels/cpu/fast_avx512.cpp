// The fast CPU kernels for AVX-512 (kernels/cpu/fast.h), compiled with -mavx512f -mavx512dq -mavx2 -mfma.

// GCC 12's AVX-512 headers initialise _mm512_undefined_ps() from itself, which -Wmaybe-uninitialized
// reports at every inlined shuffle (GCC bug 105593, fixed in 13): silence that one false positive.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernels/cpu/fast.h"
#if DP_FAST_X86  // elsewhere this unit is empty
#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/fast_simd_avx512.h"

namespace dp::cpu::avx512 {

std::unique_ptr<Ops> make_ops() { return std::make_unique<fast::FastOps<Simd>>(); }
bool conv2d_direct(const ConvShape& s) { return fast::direct_pays<Simd>(s); }

}  // namespace dp::cpu::avx512
#endif
