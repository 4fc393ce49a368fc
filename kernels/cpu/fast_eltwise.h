// Activations and 2x2 average pooling of the fast CPU kernels, written once over a vector type S
// (kernels/cpu/fast_simd_avx2.h, fast_simd_avx512.h) and instantiated in that instruction set's
// translation unit. Everything here is a template on S, so no code is shared between units built
// with different flags.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/ops.h"

namespace dp::cpu::fast {

// ---- activations ---------------------------------------------------------------------------------

// exp(-a) for a = |x| (Cephes' expf polynomial on [-ln2/2, ln2/2], 2^n by S::scale_pow2), then
// math::sigmoid's two branches as one division: x >= 0: 1 / (1 + e^-x);  x < 0: e^x / (1 + e^x).
// NaN passes through.
template <class S>
inline typename S::V sigmoid(typename S::V x) {
  using V = typename S::V;
  const V one = S::set1(1.0f), a = S::abs(x);
  const V u = S::max(S::sub(S::zero(), a), S::set1(S::kExpFloor));
  const V n = S::round(S::mul(u, S::set1(1.44269504088896341f)));
  V f = S::fnma(n, S::set1(0.693359375f), u);
  f = S::fnma(n, S::set1(-2.12194440e-4f), f);
  V p = S::set1(1.9875691500e-4f);
  p = S::fma(p, f, S::set1(1.3981999507e-3f));
  p = S::fma(p, f, S::set1(8.3334519073e-3f));
  p = S::fma(p, f, S::set1(4.1665795894e-2f));
  p = S::fma(p, f, S::set1(1.6666665459e-1f));
  p = S::fma(p, f, S::set1(5.0000001201e-1f));
  p = S::fma(p, S::mul(f, f), S::add(f, one));
  const V z = S::scale_pow2(p, n, a);  // e^-|x|
  const V y = S::div(S::select(S::negative(x), z, one), S::add(one, z));
  return S::select(S::unordered(x), x, y);
}

template <class S>
inline typename S::V activate(Activation a, typename S::V x) {
  return a == Activation::relu ? S::relu(x) : sigmoid<S>(x);
}

// math::relu_grad / sigmoid_grad from the output y: g * y * (1 - y), in that order.
template <class S>
inline typename S::V act_grad(Activation a, typename S::V y, typename S::V g) {
  return a == Activation::relu ? S::relu_grad(y, g) : S::mul(S::mul(g, y), S::sub(S::set1(1.0f), y));
}

// Elementwise over n floats, a tail of fewer than L through masked loads and stores.
template <class S, class F>
inline void each(int64_t n, F f) {
  int64_t i = 0;
  for (; i + S::L <= n; i += S::L) f(i, S::L);
  if (i < n) f(i, int(n - i));
}

template <class S>
void activation_forward(Activation a, int64_t n, const float* x /* (n) */, float* y /* (n) */) {
  if (a == Activation::relu)
    each<S>(n, [&](int64_t i, int m) { S::store_n(y + i, S::relu(S::load_n(x + i, m)), m); });
  else
    each<S>(n, [&](int64_t i, int m) { S::store_n(y + i, sigmoid<S>(S::load_n(x + i, m)), m); });
}

template <class S>
void activation_backward(Activation a, int64_t n, const float* y /* (n) */, const float* dy /* (n) */,
                         float* dx /* (n) */) {
  if (a == Activation::relu)
    each<S>(n,
            [&](int64_t i, int m) { S::store_n(dx + i, S::relu_grad(S::load_n(y + i, m), S::load_n(dy + i, m)), m); });
  else
    each<S>(n, [&](int64_t i, int m) {
      S::store_n(dx + i, act_grad<S>(Activation::sigmoid, S::load_n(y + i, m), S::load_n(dy + i, m)), m);
    });
}

// ---- 2x2 average pooling -------------------------------------------------------------------------
// The reference's order of operations: ((x00 + x01) + x10) + x11, times 1/4 (exact).

template <class S>
void avgpool2_forward(const PoolShape& s, const float* x /* (N, C, H, W) */, float* y /* (N, C, OH, OW) */) {
  using V = typename S::V;
  constexpr int L = S::L;
  const int oh = s.out_h(), ow = s.out_w();
  const V quarter = S::set1(0.25f);
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p) {
    const float* xp = x + p * s.h * s.w;  // (H, W)
    float* yp = y + p * oh * ow;          // (OH, OW)
    for (int i = 0; i < oh; ++i) {
      const float* r0 = xp + 2 * i * s.w;
      const float* r1 = r0 + s.w;
      float* yr = yp + i * ow;
      for (int j = 0; j < ow; j += L) {  // L outputs from 2L inputs of each row
        const int m = std::min(L, ow - j), lo = std::min(L, 2 * m), hi = 2 * m - lo;
        V e0, o0, e1, o1;
        S::deinterleave(S::load_n(r0 + 2 * j, lo), S::load_n(r0 + 2 * j + L, hi), e0, o0);
        S::deinterleave(S::load_n(r1 + 2 * j, lo), S::load_n(r1 + 2 * j + L, hi), e1, o1);
        const V sum = S::add(S::add(S::add(e0, o0), e1), o1);
        S::store_n(yr + j, S::mul(sum, quarter), m);
      }
    }
  }
}

template <class S>
void avgpool2_backward(const PoolShape& s, const float* dy /* (N, C, OH, OW) */,
                       float* dx /* (N, C, H, W), overwritten */) {
  using V = typename S::V;
  constexpr int L = S::L;
  const int oh = s.out_h(), ow = s.out_w();
  const V quarter = S::set1(0.25f);
  for (int64_t p = 0; p < int64_t(s.n) * s.c; ++p) {
    const float* dyp = dy + p * oh * ow;  // (OH, OW)
    float* dxp = dx + p * s.h * s.w;      // (H, W)
    for (int i = 0; i < oh; ++i) {
      float* r0 = dxp + 2 * i * s.w;
      float* r1 = r0 + s.w;
      const float* dr = dyp + i * ow;
      for (int j = 0; j < ow; j += L) {
        const int m = std::min(L, ow - j), lo = std::min(L, 2 * m), hi = 2 * m - lo;
        V a, b;
        S::duplicate(S::mul(S::load_n(dr + j, m), quarter), a, b);
        S::store_n(r0 + 2 * j, a, lo);
        S::store_n(r1 + 2 * j, a, lo);
        if (hi > 0) {
          S::store_n(r0 + 2 * j + L, b, hi);
          S::store_n(r1 + 2 * j + L, b, hi);
        }
      }
      for (int j = 2 * ow; j < s.w; ++j) r0[j] = r1[j] = 0.0f;  // past the last window
    }
    for (int64_t i = 2 * oh * s.w; i < int64_t(s.h) * s.w; ++i) dxp[i] = 0.0f;  // rows past the last window
  }
}

// ---- the fused activation and pooling -------------------------------------------------------------

// Ops::conv2d_act_pool_forward / backward's extra buffers (NCHW, like everything passed in): the
// forward writes y_pool, the backward reads y_act and dy_pool.
struct Fusion {
  Activation act = Activation::relu;
  float* y_pool = nullptr;         // (N, K, OH/2, OW/2)
  const float* y_act = nullptr;    // (N, K, OH, OW)
  const float* dy_pool = nullptr;  // (N, K, OH/2, OW/2)
};

// The convolution's output gradient of one image, dy (K, OH, OW), from y_act (K, OH, OW) and dy_pool
// (K, OH/2, OW/2): the pooling's backward, then the activation's, as the separate ops compute them.
// With dy_row > OW, dy is (K, OH, dy_row) instead, zero past OW; its rows are then written as whole
// vectors, a row's last spilling zeros into the next row before that row is written, so dy needs L - 1
// floats of slack at its end.
template <class S>
void unpool_act(Activation a, int k, int oh, int ow, const float* y_act, const float* dy_pool, float* dy, int dy_row) {
  constexpr int L = S::L;
  const int oh2 = oh / 2, ow2 = ow / 2;
  const typename S::V quarter = S::set1(0.25f);
  const bool wide = dy_row > ow;
  for (int kk = 0; kk < k; ++kk)
    for (int oy = 0; oy < oh; oy += 2) {  // a pooled row's gradient serves two rows
      const float* prow = dy_pool + (int64_t(kk) * oh2 + oy / 2) * ow2;
      const float* yrow = y_act + (int64_t(kk) * oh + oy) * ow;
      float* drow = dy + (int64_t(kk) * oh + oy) * dy_row;
      const int pair = std::min(2, oh - oy);
      typename S::V second_first = S::zero();   // where wide, stored after the first row's spill into it
      for (int ox = 0; ox < dy_row; ox += L) {  // L outputs from L/2 pooled gradients, each twice
        const int m = std::min(L, ow - ox), half = std::min(L / 2, ow2 - ox / 2);
        typename S::V g = S::zero(), unused;
        if (oy < 2 * oh2 && half > 0) S::duplicate(S::mul(S::load_n(prow + ox / 2, half), quarter), g, unused);
        for (int r = 0; r < pair; ++r) {
          // Past OW both factors load as zero, and the activation's gradient of zeros is zero.
          const typename S::V d = m > 0 ? act_grad<S>(a, S::load_n(yrow + r * ow + ox, m), g) : S::zero();
          if (!wide)
            S::store_n(drow + r * dy_row + ox, d, m);
          else if (r == 1 && ox == 0)
            second_first = d;
          else
            S::store(drow + r * dy_row + ox, d);
        }
      }
      if (wide && pair == 2) S::store(drow + dy_row, second_first);
    }
}

}  // namespace dp::cpu::fast
