// The fast CPU kernels for AVX2+FMA (kernels/cpu/fast.h), compiled with -mavx2 -mfma.
#include "kernels/cpu/fast.h"
#if DP_FAST_X86  // elsewhere this unit is empty
#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/fast_simd_avx2.h"

namespace dp::cpu::avx2 {

std::unique_ptr<Ops> make_ops() { return std::make_unique<fast::FastOps<Simd>>(); }
bool conv2d_direct(const ConvShape& s) { return fast::direct_pays<Simd>(s); }

}  // namespace dp::cpu::avx2
#endif
