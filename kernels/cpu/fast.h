// The fast float path of the CPU backend: convolution, activations and 2x2 average pooling written
// for the vector units (AVX-512 or AVX2+FMA, chosen at run time), with the same contracts as the
// reference templates in kernels/cpu/kernels.h. The reference stays the oracle: CpuOps calls these in
// float, tests/test_fast_kernels.cpp checks them against the reference on random and odd shapes.
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
// vectors along an output row (conv2d_direct).
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace dp::cpu::fast {

enum class Isa { reference, avx2, avx512 };

// The best this CPU runs, unless the environment variable DP_CPU_KERNELS names a lower one
// ("reference", "avx2", "avx512"): the switch the before/after measurements and the tests use.
Isa detect_isa();
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);

// True when shape s takes the direct way (NCHW, vectors along output rows: layers with few taps per
// output, e.g. a 1-channel first layer) rather than the blocked one; for tests and profiles.
bool conv2d_direct(Isa isa, const ConvShape& s);

// Floats of scratch conv2d_forward and conv2d_backward need for shape s; independent of s.n.
int64_t conv2d_workspace_size(Isa isa, const ConvShape& s);

// As dp::cpu::conv2d_forward / conv2d_backward in float; isa must not be Isa::reference.
void conv2d_forward(Isa isa, const ConvShape& s,
                    const float* x,     // (N, C, H, W)
                    const float* w,     // (K, C, KH, KW)
                    const float* b,     // (K)
                    float* y,           // (N, K, OH, OW)
                    float* workspace);  // (conv2d_workspace_size(isa, s))
void conv2d_backward(Isa isa, const ConvShape& s,
                     const float* x,     // (N, C, H, W)
                     const float* w,     // (K, C, KH, KW)
                     const float* dy,    // (N, K, OH, OW)
                     float* dx,          // (N, C, H, W) or null
                     float* dw,          // (K, C, KH, KW), overwritten
                     float* db,          // (K), overwritten
                     float* workspace);  // (conv2d_workspace_size(isa, s))

// conv2d, the activation and 2x2 average pooling in one pass over each chunk, as
// Ops::conv2d_act_pool_forward / backward with k = 2; the same bits as the three ops one after another.
void conv2d_act_pool_forward(Isa isa, const ConvShape& s, Activation a,
                             const float* x,     // (N, C, H, W)
                             const float* w,     // (K, C, KH, KW)
                             const float* b,     // (K)
                             float* y_act,       // (N, K, OH, OW)
                             float* y_pool,      // (N, K, OH/2, OW/2)
                             float* workspace);  // (conv2d_workspace_size(isa, s))
void conv2d_act_pool_backward(Isa isa, const ConvShape& s, Activation a,
                              const float* x,        // (N, C, H, W)
                              const float* w,        // (K, C, KH, KW)
                              const float* y_act,    // (N, K, OH, OW)
                              const float* dy_pool,  // (N, K, OH/2, OW/2)
                              float* dx,             // (N, C, H, W) or null
                              float* dw,             // (K, C, KH, KW), overwritten
                              float* db,             // (K), overwritten
                              float* workspace);     // (conv2d_workspace_size(isa, s))

void activation_forward(Isa isa, Activation a, int64_t n, const float* x /* (n) */, float* y /* (n) */);
void activation_backward(Isa isa, Activation a, int64_t n, const float* y /* (n) */, const float* dy /* (n) */,
                         float* dx /* (n) */);

// Any window: k == 2 has its own loop, other windows use the reference.
void avgpool_forward(Isa isa, const PoolShape& s, const float* x /* (N, C, H, W) */, float* y /* (N, C, OH, OW) */);
void avgpool_backward(Isa isa, const PoolShape& s, const float* dy /* (N, C, OH, OW) */,
                      float* dx /* (N, C, H, W), overwritten */);

}  // namespace dp::cpu::fast
