// The fast CPU kernels: convolution (also fused with an activation and 2x2 average pooling),
// activations and 2x2 average pooling written for the vector units, with the same contracts as the
// reference templates in kernels/cpu/kernels.h, as an Ops backend per instruction set (fast_ops.h)
// that make_cpu_ops (cpu_ops.h) picks. Each instruction set is one translation unit, compiled with
// its flags: fast_avx2.cpp (-mavx2 -mfma) and fast_avx512.cpp (-mavx512f -mavx512dq -mavx2 -mfma),
// instantiating the kernels, which are templates on the vector type (fast_simd_*.h). Nothing may call
// into a unit unless isa_supported says the CPU runs it; builds off x86-64 have neither unit.
//
// Convolution works on chunks of L images (L = 16 for AVX-512, 8 for AVX2) in a blocked layout with
// the image as the innermost, vector dimension: (C, H, W, L). Every output position of every image is
// then one vector lane, so the three passes (forward, data gradient, weight gradient) are register-
// tiled loops of vector FMAs with no im2col buffer and no per-image GEMM: forward and the data
// gradient broadcast a weight against L images, the weight gradient multiplies an output-gradient
// vector by an input vector and sums the lanes at the end. The chunk is transposed in from and out to
// NCHW at the boundaries (16x16 / 8x8 register transposes). The workspace holds one chunk, so its
// size does not depend on the batch. A layer with few taps per output (a first layer: one channel,
// 3x3 or 5x5) spends more on those transposes than on arithmetic; it runs directly on NCHW instead,
// vectors along an output row (fast_direct.h).
//
// Files: fast_simd_avx2.h / fast_simd_avx512.h (the vector types), fast_eltwise.h (sigmoid,
// activations, pooling), fast_tiles.h (register tiles), fast_blocked.h and fast_direct.h (the two
// ways), fast_conv.h (workspace and the passes), fast_ops.h (the Ops backend).
#pragma once

#include <memory>

#include "kernels/ops.h"

// 1 where the fast units are built (x86-64 with GCC or Clang; CMake's `fast CPU kernels` block
// compiles them under the same condition); -DDP_FAST_X86=0 builds the portable fallback on x86 too.
#ifndef DP_FAST_X86
#if defined(__x86_64__) && defined(__GNUC__)
#define DP_FAST_X86 1
#else
#define DP_FAST_X86 0
#endif
#endif

#if DP_FAST_X86
// What each unit exports; call only where isa_supported(Isa::avx2 / Isa::avx512).
namespace dp::cpu::avx2 {
std::unique_ptr<Ops> make_ops();
bool conv2d_direct(const ConvShape& s);  // see cpu_ops.h
}  // namespace dp::cpu::avx2
namespace dp::cpu::avx512 {
std::unique_ptr<Ops> make_ops();
bool conv2d_direct(const ConvShape& s);
}  // namespace dp::cpu::avx512
#endif
