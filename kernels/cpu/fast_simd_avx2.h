// The AVX2+FMA vector type of the fast CPU kernels (kernels/cpu/fast.h): 8 float lanes in a ymm
// register, the operations the kernels are written in, and the register-tile shapes. Only
// kernels/cpu/fast_avx2.cpp includes it, compiled with -mavx2 -mfma.
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__)
#error "kernels/cpu/fast_simd_avx2.h needs -mavx2 -mfma (kernels/cpu/fast_avx2.cpp only)"
#endif

#include <immintrin.h>

#include <array>

namespace dp::cpu::avx2 {

struct Simd {
  static constexpr const char* kName = "avx2";  // isa_name(Isa::avx2)
  static constexpr int L = 8;
  using V = __m256;
  using Mask = __m256;  // all ones or all zeros per lane

  // Register tiles (see kernels/cpu/fast_simd_avx512.h) of the 16 ymm registers. A tile of R rows x C
  // columns needs R*C accumulators + min(R, C) operands + 1 (fast_blocked.h loads the smaller side
  // first), so 12 accumulators fit: 4x3, 3x4, 2x6, 6x2 (15-16 registers). The 8 of the former 2x4 and
  // 4x2 were too few to hide the FMA latency (2 per cycle, 4-5 cycles). Measured with dp_train on a
  // 2-core EPYC (Zen, AVX2), lenet 1 device, against the tiles {4x2, 3x3, 2x4, 1x7} for all three
  // passes: these 1.06x. Data gradient: 4x3 for LeNet's conv2 (20 input channels), 3x4 for LeNet-5's.
  static constexpr std::array<int, 4> kRows{4, 3, 2, 6}, kCols{3, 4, 6, 2};
  // Forward: 4x3 for LeNet's 50 output channels (2 padding rows, see kPaddingShare) and LeNet-5's 16;
  // 5x2 for counts 4x3 would pad more (10 accumulators, and the window of 2 positions stays in L1
  // while every row block runs over it). Position blocks outer: 1.06x over output channels outer.
  static constexpr std::array<int, 4> kFwdRows{5, 4, 6, 3}, kFwdCols{2, 3, 2, 4};
  static constexpr bool kFwdPositionsOuter = true;
  // Direct forward (a first layer's rows of up to 4 vectors), the R broadcasts held and one vector of
  // x at a time (kDirectHoldWeights): 3x4+3+1 = 16, 5x2+5+1 = 16, 2x4+2+1 = 11, 1x4+1+1 = 6. The 8
  // accumulators of the former 2x4 (x held) left the FMAs waiting on their latency.
  static constexpr std::array<int, 4> kDirectRows{3, 5, 2, 1}, kDirectCols{4, 2, 4, 4};
  static constexpr bool kDirectHoldWeights = true;
  // A row's last vector overlaps the one before rather than being masked (see DirectFwd).
  static constexpr bool kDirectOverlap = true;
  // The fused first layer's weight gradient over output gradients as wide as the input's rows (see
  // DirectWgrad): one partial vector a plane instead of one a row.
  static constexpr bool kDirectWideGradient = true;
  // Weight gradient: 3x4 (LeNet's conv1 and conv2, LeNet-5's conv1), 4x3 (LeNet-5's conv2), 5x2 as
  // the forward's. 3x4 is listed before 4x3 (the same accumulators: pick_rows takes the first on a
  // tie) for add_hsums4 on a row's four taps: LeNet's conv2 backward 0.92x of 4x3's (dp_bench ops,
  // AVX2 on a Xeon with AVX-512, 5 alternating runs).
  static constexpr std::array<int, 4> kWgradRows{5, 3, 4, 6}, kWgradCols{2, 4, 3, 2};
  // pick_rows (fast_tiles.h) counts padding of at most 1/kPaddingShare of the rows as none, so LeNet's
  // 50 output channels run in 12-accumulator tiles (the forward's 4x3 with 2 padding rows, the weight
  // gradient's 3x4 with 1) rather than 5x2: 12 accumulators hide the FMA latency that 10 do not.
  // Measured with 4x3 for both, before the weight gradient moved to 3x4, on the 2-core EPYC (per-op
  // harness, conv2 at 16 images, best of 4 alternating runs): forward 838 -> 782 us, backward (weight +
  // data gradient) 2208 -> 1586 us; dp_train lenet, 1 device on 1 core: 1.04-1.14x in 4 alternating pairs.
  static constexpr int kPaddingShare = 16;

  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m256i first(int m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // The first m lanes; the others read as zero and are never touched in memory. A whole vector takes
  // the plain load and store: on AMD's Zen the masked store is microcoded, ~10x a store (unpool_act,
  // the first layer's rows and the pooling store whole vectors most of the time).
  static V load_n(const float* p, int m) { return m >= L ? load(p) : _mm256_maskload_ps(p, first(m)); }
  static void store_n(float* p, V v, int m) {
    if (m >= L)
      store(p, v);
    else
      _mm256_maskstore_ps(p, first(m), v);
  }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V abs(V a) { return _mm256_andnot_ps(set1(-0.0f), a); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static Mask negative(V a) { return _mm256_cmp_ps(a, zero(), _CMP_LT_OQ); }
  static Mask unordered(V a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
  static V select(Mask m, V if_set, V if_clear) { return _mm256_blendv_ps(if_clear, if_set, m); }
  static V relu(V x) { return _mm256_max_ps(x, zero()); }
  static V relu_grad(V y, V dy) { return _mm256_and_ps(_mm256_cmp_ps(y, zero(), _CMP_GT_OQ), dy); }

  // For the sigmoid (kernels/cpu/fast_eltwise.h): p 2^n with 2^n built from the exponent bits, so n
  // must stay >= -126: e^-|x| is flushed to 0 for a = |x| > 87.5, where it is below 2^-126 and expf
  // would return a subnormal.
  static constexpr float kExpFloor = -87.5f;
  static V scale_pow2(V p, V n, V a) {
    const V scale =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    return _mm256_andnot_ps(_mm256_cmp_ps(a, set1(-kExpFloor), _CMP_GT_OQ), _mm256_mul_ps(p, scale));
  }

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
  // p[i] += hsum(v[i]) for i < 4 with the same bits (each sum in hsum's order) and one 4-float add
  // instead of four scalar ones: a third of the operations (add_sums, fast_tiles.h).
  static void add_hsums4(float* p, V a, V b, V c, V d) {
    auto fold = [](V v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); };
    const __m128 sa = fold(a), sb = fold(b), sc = fold(c), sd = fold(d);
    const __m128 ab = _mm_add_ps(_mm_movelh_ps(sa, sb), _mm_movehl_ps(sb, sa)),  // (a0+a2, a1+a3, b0+b2, b1+b3)
        cd = _mm_add_ps(_mm_movelh_ps(sc, sd), _mm_movehl_ps(sd, sc));
    const __m128 sums = _mm_add_ps(_mm_shuffle_ps(ab, cd, 0x88), _mm_shuffle_ps(ab, cd, 0xDD));
    _mm_storeu_ps(p, _mm_add_ps(_mm_loadu_ps(p), sums));
  }

  // r[i][j] <-> r[j][i], 8 x 8.
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
};

}  // namespace dp::cpu::avx2
