// The AVX-512 vector type of the fast CPU kernels (kernels/cpu/fast.h): 16 float lanes in a zmm
// register, the operations the kernels are written in, and the register-tile shapes. Only
// kernels/cpu/fast_avx512.cpp includes it, compiled with -mavx512f -mavx512dq -mavx2 -mfma.
#pragma once

#if !defined(__AVX512F__) || !defined(__AVX512DQ__) || !defined(__FMA__)
#error "kernels/cpu/fast_simd_avx512.h needs -mavx512f -mavx512dq -mfma (kernels/cpu/fast_avx512.cpp only)"
#endif

#include <immintrin.h>

#include <array>

namespace dp::cpu::avx512 {

struct Simd {
  static constexpr const char* kName = "avx512";  // isa_name(Isa::avx512)
  static constexpr int L = 16;
  using V = __m512;
  using Mask = __mmask16;

  // Register tiles (rows x columns of vector accumulators) of the kernels in kernels/cpu/fast_tiles.h:
  // rows x cols accumulators + cols operands + 1 broadcast must fit the 32 zmm registers: 8x3+3+1 = 28,
  // 6x4+4+1 = 29, 5x5+5+1 = 31, 4x6+6+1 = 31. The direct forward's rows x (up to 2) vectors: at most 27.
  static constexpr std::array<int, 4> kRows{8, 6, 5, 4}, kCols{3, 4, 5, 6};
  static constexpr std::array<int, 4> kFwdRows = kRows, kFwdCols = kCols;  // the forward's: the same
  static constexpr bool kFwdPositionsOuter = false;                        // see fast_simd_avx2.h
  static constexpr std::array<int, 4> kDirectRows{12, 10, 8, 6}, kDirectCols{2, 2, 2, 2};
  static constexpr bool kDirectHoldWeights = false, kDirectOverlap = false,  // see fast_simd_avx2.h
      kDirectWideGradient = false;
  // The weight gradient's: 5x5 (LeNet's conv2, 50 output channels), 4x6 (LeNet-5's, 16: the output
  // gradients of 4 channels stay in L1, 99 GFLOP/s against 55 for 8x3, measured), 6x4, 8x3.
  static constexpr std::array<int, 4> kWgradRows{5, 4, 6, 8}, kWgradCols{5, 6, 4, 3};
  static constexpr int kPaddingShare = 0;  // pick_rows: the least padding first (see fast_simd_avx2.h)

  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static Mask first(int m) { return Mask((1u << m) - 1u); }
  // The first m lanes; the others read as zero and are never touched in memory.
  static V load_n(const float* p, int m) { return _mm512_maskz_loadu_ps(first(m), p); }
  static void store_n(float* p, V v, int m) { _mm512_mask_storeu_ps(p, first(m), v); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V abs(V a) { return _mm512_abs_ps(a); }
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static Mask negative(V a) { return _mm512_cmp_ps_mask(a, zero(), _CMP_LT_OQ); }
  static Mask unordered(V a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static V select(Mask m, V if_set, V if_clear) { return _mm512_mask_blend_ps(m, if_clear, if_set); }
  // math::relu, x > 0 ? x : 0: max returns its second operand, +0, for x <= 0, -0 and NaN alike.
  static V relu(V x) { return _mm512_max_ps(x, zero()); }
  // math::relu_grad, y > 0 ? dy : 0 (an ordered compare: NaN is not > 0).
  static V relu_grad(V y, V dy) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(y, zero(), _CMP_GT_OQ), dy); }

  // For the sigmoid (kernels/cpu/fast_eltwise.h): p 2^n, n an integer >= kExpFloor * log2(e) - 1.
  // scalef rounds into the subnormals as expf does, so the floor only has to keep e^-|x| below the
  // least subnormal (e^-104), and a = |x| is not needed.
  static constexpr float kExpFloor = -104.0f;
  static V scale_pow2(V p, V n, V /*a*/) { return _mm512_scalef_ps(p, n); }

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
};

}  // namespace dp::cpu::avx512
