// The fast float path (kernels/cpu/fast.h): the vector types for AVX-512 and AVX2+FMA, the bodies in
// fast_conv.inc and fast_eltwise.inc compiled once for each inside a `#pragma GCC target` region, and
// the run-time choice. The binary runs on any x86-64 (a CPU without AVX2 gets the reference kernels)
// and builds elsewhere with the reference kernels only.
#include "kernels/cpu/fast.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "kernels/cpu/kernels.h"

#ifndef DP_FAST_X86  // -DDP_FAST_X86=0 builds the portable fallback on x86 too
#if defined(__x86_64__) && defined(__GNUC__)
#define DP_FAST_X86 1
#else
#define DP_FAST_X86 0
#endif
#endif
#if DP_FAST_X86
#include <immintrin.h>
#endif

// GCC 12's AVX-512 headers initialise _mm512_undefined_ps() from itself, which -Wmaybe-uninitialized
// reports at every inlined shuffle (GCC bug 105593, fixed in 13): silence that one false positive.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Fully unrolls the loop that follows (the register tiles in fast_conv.inc).
#define DP_UNROLL _Pragma("GCC unroll 32")

namespace dp::cpu::fast {

// Each Simd names the register tiles (rows x columns of vector accumulators) of the tile kernels in
// fast_conv.inc: a kernel holds rows*cols accumulators plus one row or column of operands and one
// broadcast, which must fit the register file (32 zmm / 16 ymm) without spilling. kRows/kCols serve
// the blocked forward and data gradient, kWgrad* the weight gradients, kDirect* the direct forward.

#if DP_FAST_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx2,fma")
namespace avx512 {

struct Simd {
  static constexpr int L = 16;
  using V = __m512;
  // rows x cols accumulators + cols operands + 1 broadcast: 8x3+3+1 = 28, 6x4+4+1 = 29, 5x5+5+1 = 31,
  // 4x6+6+1 = 31 of the 32 zmm registers. The direct forward's rows x (up to 2) vectors: at most 27.
  static constexpr std::array<int, 4> kRows{8, 6, 5, 4}, kCols{3, 4, 5, 6};
  static constexpr std::array<int, 4> kDirectRows{12, 10, 8, 6}, kDirectCols{2, 2, 2, 2};
  // The weight gradient's: 5x5 (LeNet's conv2, 50 output channels), 4x6 (LeNet-5's, 16: the output
  // gradients of 4 channels stay in L1, 99 GFLOP/s against 55 for 8x3, measured), 6x4, 8x3.
  static constexpr std::array<int, 4> kWgradRows{5, 4, 6, 8}, kWgradCols{5, 6, 4, 3};

  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __mmask16 first(int m) { return __mmask16((1u << m) - 1u); }
  // The first m lanes; the others read as zero and are never touched in memory.
  static V load_n(const float* p, int m) { return _mm512_maskz_loadu_ps(first(m), p); }
  static void store_n(float* p, V v, int m) { _mm512_mask_storeu_ps(p, first(m), v); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  // math::relu, x > 0 ? x : 0: max returns its second operand, +0, for x <= 0, -0 and NaN alike.
  static V relu(V x) { return _mm512_max_ps(x, zero()); }
  // math::relu_grad, y > 0 ? dy : 0 (an ordered compare: NaN is not > 0).
  static V relu_grad(V y, V dy) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(y, zero(), _CMP_GT_OQ), dy); }
  // (a0 a1 a2 ... a15, b0 ... b15) -> even (a0 a2 ... b14), odd (a1 a3 ... b15)
  static void deinterleave(V a, V b, V& even, V& odd) {
    const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    even = _mm512_permutex2var_ps(a, e, b);
    odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(e, _mm512_set1_epi32(1)), b);
  }
  // v -> lo (v0 v0 v1 v1 ... v7 v7), hi (v8 v8 ... v15 v15)
  static void duplicate(V v, V& lo, V& hi) {
    const __m512i i = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    lo = _mm512_permutexvar_ps(i, v);
    hi = _mm512_permutexvar_ps(_mm512_add_epi32(i, _mm512_set1_epi32(8)), v);
  }
  static float hsum(V v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    __m128 s = _mm512_castps512_ps128(v);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // r[i][j] <-> r[j][i], 16 x 16.
  static void transpose(V* r) {
    V t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int g = 0; g < 16; g += 8)
      for (int i = 0; i < 4; ++i) {
        t[g + i] = _mm512_shuffle_f32x4(r[g + i], r[g + i + 4], 0x88);
        t[g + i + 4] = _mm512_shuffle_f32x4(r[g + i], r[g + i + 4], 0xDD);
      }
    for (int i = 0; i < 8; ++i) {
      r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
  }

  // exp(-a) for a >= 0 (Cephes' expf polynomial on [-ln2/2, ln2/2]; scalef builds 2^n and rounds
  // into the subnormals as expf does), then math::sigmoid's two branches as one division:
  // x >= 0: 1 / (1 + e^-x);  x < 0: e^x / (1 + e^x). NaN passes through.
  static V sigmoid(V x) {
    const V one = set1(1.0f);
    const V u = _mm512_max_ps(_mm512_sub_ps(zero(), _mm512_abs_ps(x)), set1(-104.0f));  // e^-104 < the least subnormal
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(u, set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V f = _mm512_fnmadd_ps(n, set1(0.693359375f), u);
    f = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), f);
    V p = set1(1.9875691500e-4f);
    p = fma(p, f, set1(1.3981999507e-3f));
    p = fma(p, f, set1(8.3334519073e-3f));
    p = fma(p, f, set1(4.1665795894e-2f));
    p = fma(p, f, set1(1.6666665459e-1f));
    p = fma(p, f, set1(5.0000001201e-1f));
    p = fma(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, one));
    const V z = _mm512_scalef_ps(p, n);  // e^-|x|
    const __mmask16 negative = _mm512_cmp_ps_mask(x, zero(), _CMP_LT_OQ);
    const V y = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, z), _mm512_add_ps(one, z));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
  }
};

#include "kernels/cpu/fast_eltwise.inc"  // first: L, V and the elementwise kernels the convolution uses
// (a separate include block, so it is not sorted after the next one)
#include "kernels/cpu/fast_conv.inc"

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

struct Simd {
  static constexpr int L = 8;
  using V = __m256;
  // Of the 16 ymm registers: 4x2+2+1 = 11, 3x3+3+1 = 13, 2x4+4+1 = 13, 1x7+7+1 = 15; direct: 3x2+2+1 = 9,
  // 2x4+4+1 = 13, 1x4+4+1 = 9.
  static constexpr std::array<int, 4> kRows{4, 3, 2, 1}, kCols{2, 3, 4, 7};
  static constexpr std::array<int, 4> kDirectRows{3, 2, 1, 1}, kDirectCols{2, 4, 4, 4};
  static constexpr std::array<int, 4> kWgradRows{4, 3, 2, 1}, kWgradCols{2, 3, 4, 7};

  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m256i first(int m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load_n(const float* p, int m) { return _mm256_maskload_ps(p, first(m)); }
  static void store_n(float* p, V v, int m) { _mm256_maskstore_ps(p, first(m), v); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V relu(V x) { return _mm256_max_ps(x, zero()); }
  static V relu_grad(V y, V dy) { return _mm256_and_ps(_mm256_cmp_ps(y, zero(), _CMP_GT_OQ), dy); }
  static void deinterleave(V a, V b, V& even, V& odd) {
    // within 128-bit lanes (a0 a2 b0 b2 | a4 a6 b4 b6), then the 64-bit pairs reordered 0 2 1 3
    even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
  }
  static void duplicate(V v, V& lo, V& hi) {
    const V l = _mm256_unpacklo_ps(v, v), h = _mm256_unpackhi_ps(v, v);  // (v0 v0 v1 v1 | v4 v4 v5 v5), ...
    lo = _mm256_permute2f128_ps(l, h, 0x20);
    hi = _mm256_permute2f128_ps(l, h, 0x31);
  }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  static void transpose(V* r) {
    V t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
      r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
  }

  // As the AVX-512 version, with 2^n from the exponent bits, so n must stay >= -126: e^-|x| is
  // flushed to 0 for |x| > 87.5, where it is below 2^-126 and expf would return a subnormal.
  static V sigmoid(V x) {
    const V one = set1(1.0f);
    const V a = _mm256_andnot_ps(set1(-0.0f), x);
    const V u = _mm256_max_ps(_mm256_sub_ps(zero(), a), set1(-87.5f));
    const V n =
        _mm256_round_ps(_mm256_mul_ps(u, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V f = _mm256_fnmadd_ps(n, set1(0.693359375f), u);
    f = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), f);
    V p = set1(1.9875691500e-4f);
    p = fma(p, f, set1(1.3981999507e-3f));
    p = fma(p, f, set1(8.3334519073e-3f));
    p = fma(p, f, set1(4.1665795894e-2f));
    p = fma(p, f, set1(1.6666665459e-1f));
    p = fma(p, f, set1(5.0000001201e-1f));
    p = fma(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, one));
    const V scale =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    V z = _mm256_mul_ps(p, scale);
    z = _mm256_andnot_ps(_mm256_cmp_ps(a, set1(87.5f), _CMP_GT_OQ), z);
    const V negative = _mm256_cmp_ps(x, zero(), _CMP_LT_OQ);
    const V y = _mm256_div_ps(_mm256_blendv_ps(one, z, negative), _mm256_add_ps(one, z));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
};

#include "kernels/cpu/fast_eltwise.inc"  // first: L, V and the elementwise kernels the convolution uses
// (a separate include block, so it is not sorted after the next one)
#include "kernels/cpu/fast_conv.inc"

}  // namespace avx2
#pragma GCC pop_options

#define DP_DISPATCH(isa, call) (isa == Isa::avx512 ? avx512::call : avx2::call)
#else
// No vector path in this build: isa_supported() is true for Isa::reference only, and CpuOps never
// calls the kernels below with it.
namespace none {
[[noreturn]] inline void unavailable() { throw std::logic_error("dp::cpu::fast: no vector kernels in this build"); }
inline bool direct_pays(const ConvShape&) { unavailable(); }
struct Layout {
  int64_t total() const { unavailable(); }
};
inline Layout layout(const ConvShape&) { unavailable(); }
inline void conv2d_forward(const ConvShape&, const float*, const float*, const float*, float*, float*) {
  unavailable();
}
inline void conv2d_backward(const ConvShape&, const float*, const float*, const float*, float*, float*, float*,
                            float*) {
  unavailable();
}
inline void conv2d_act_pool_forward(const ConvShape&, Activation, const float*, const float*, const float*, float*,
                                    float*, float*) {
  unavailable();
}
inline void conv2d_act_pool_backward(const ConvShape&, Activation, const float*, const float*, const float*,
                                     const float*, float*, float*, float*, float*) {
  unavailable();
}
inline void activation_forward(Activation, int64_t, const float*, float*) { unavailable(); }
inline void activation_backward(Activation, int64_t, const float*, const float*, float*) { unavailable(); }
inline void avgpool2_forward(const PoolShape&, const float*, float*) { unavailable(); }
inline void avgpool2_backward(const PoolShape&, const float*, float*) { unavailable(); }
}  // namespace none
#define DP_DISPATCH(isa, call) ((void)isa, none::call)
#endif

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
  if (const char* want = std::getenv("DP_CPU_KERNELS")) {
    for (Isa i : {Isa::reference, Isa::avx2, Isa::avx512})
      if (std::strcmp(want, isa_name(i)) == 0 && int(i) < int(best)) best = i;
  }
  return best;
}

bool conv2d_direct(Isa isa, const ConvShape& s) { return isa != Isa::reference && DP_DISPATCH(isa, direct_pays(s)); }

int64_t conv2d_workspace_size(Isa isa, const ConvShape& s) {
  return isa == Isa::reference ? 0 : DP_DISPATCH(isa, layout(s).total());
}

void conv2d_forward(Isa isa, const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                    float* workspace) {
  DP_DISPATCH(isa, conv2d_forward(s, x, w, b, y, workspace));
}

void conv2d_backward(Isa isa, const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                     float* db, float* workspace) {
  DP_DISPATCH(isa, conv2d_backward(s, x, w, dy, dx, dw, db, workspace));
}

void conv2d_act_pool_forward(Isa isa, const ConvShape& s, Activation a, const float* x, const float* w, const float* b,
                             float* y_act, float* y_pool, float* workspace) {
  DP_DISPATCH(isa, conv2d_act_pool_forward(s, a, x, w, b, y_act, y_pool, workspace));
}

void conv2d_act_pool_backward(Isa isa, const ConvShape& s, Activation a, const float* x, const float* w,
                              const float* y_act, const float* dy_pool, float* dx, float* dw, float* db,
                              float* workspace) {
  DP_DISPATCH(isa, conv2d_act_pool_backward(s, a, x, w, y_act, dy_pool, dx, dw, db, workspace));
}

void activation_forward(Isa isa, Activation a, int64_t n, const float* x, float* y) {
  DP_DISPATCH(isa, activation_forward(a, n, x, y));
}

void activation_backward(Isa isa, Activation a, int64_t n, const float* y, const float* dy, float* dx) {
  DP_DISPATCH(isa, activation_backward(a, n, y, dy, dx));
}

void avgpool_forward(Isa isa, const PoolShape& s, const float* x, float* y) {
  if (s.k != 2) return cpu::avgpool_forward(s, x, y);
  DP_DISPATCH(isa, avgpool2_forward(s, x, y));
}

void avgpool_backward(Isa isa, const PoolShape& s, const float* dy, float* dx) {
  if (s.k != 2) return cpu::avgpool_backward(s, dy, dx);
  DP_DISPATCH(isa, avgpool2_backward(s, dy, dx));
}

}  // namespace dp::cpu::fast
