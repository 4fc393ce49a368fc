// The blocked way of the fast convolution (kernels/cpu/fast.h): a chunk of L images transposed to
// (C, HP, WP, L), one image per lane, and the three tile kernels that run on it (forward, data
// gradient, weight gradient), plus the transposes in and out of NCHW. Templates on the vector type S.
//
// Buffers of a chunk (HP = H + 2 pad, WP = W + 2 pad, P = OH * OW):
//   xb   (C, HP, WP, L)   input, zero border of `pad`
//   yb   (K, P, L)        output (forward) / output gradient (backward)
//   pb   (K, Q, L)        fused: pooled output / its gradient, Q = (OH / 2) * (OW / 2)
//   dxp  (C, HP, WP, L)   input gradient with the border, whose interior is unpacked to dx
// and the weights repacked so a register tile reads them in order:
//   wk   (K / R, C*KH*KW, R)        forward: R output channels per tap
//   wd   (C / R, KH*KW, K, R)       data gradient: R input channels per (tap, output channel)
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/fast_eltwise.h"
#include "kernels/cpu/fast_tiles.h"

namespace dp::cpu::fast {

// Forward: R output channels x C output positions; the sum runs over the C*KH*KW taps.
template <class S>
struct Fwd {
  struct Args {
    Dims d;
    const float* xb;    // (C, HP, WP, L)
    const float* wk;    // (K / R, taps, R)
    const float* bias;  // (K)
    float* yb;          // (K, P, L)
  };
  static constexpr auto kRows = S::kFwdRows, kCols = S::kFwdCols;
  static constexpr int kPaddingShare = S::kPaddingShare;
  static constexpr bool kColsOuter = S::kFwdPositionsOuter;
  template <int R, int C>
  static void run(const Args& a, int k0, int p0) {
    using V = typename S::V;
    constexpr int L = S::L;
    const Dims& d = a.d;
    const float* xq[C];  // the corner of each position's window in xb
    DP_UNROLL for (int q = 0; q < C; ++q) {
      const int p = p0 + q;
      xq[q] = a.xb + (int64_t(p / d.ow) * d.wp + p % d.ow) * L;
    }
    V acc[R][C];
    DP_UNROLL for (int r = 0; r < R; ++r) DP_UNROLL for (int q = 0; q < C; ++q) acc[r][q] = S::zero();
    const float* wt = a.wk + int64_t(k0) * d.taps;  // this block's (taps, R)
    for (int c = 0; c < d.c; ++c)
      for (int i = 0; i < d.kh; ++i) {
        const int64_t row = (int64_t(c) * d.hp + i) * d.wp * L;
        for (int j = 0; j < d.kw; ++j, wt += R) {
          const int64_t tap = row + int64_t(j) * L;
          if constexpr (R < C) {  // R weights, then one input vector at a time: R*C + R + 1 registers
            V wv[R];
            DP_UNROLL for (int r = 0; r < R; ++r) wv[r] = S::set1(wt[r]);
            DP_UNROLL for (int q = 0; q < C; ++q) {
              const V xv = S::load(xq[q] + tap);
              DP_UNROLL for (int r = 0; r < R; ++r) acc[r][q] = S::fma(wv[r], xv, acc[r][q]);
            }
          } else {  // C input vectors, then one weight at a time: R*C + C + 1
            V xv[C];
            DP_UNROLL for (int q = 0; q < C; ++q) xv[q] = S::load(xq[q] + tap);
            DP_UNROLL for (int r = 0; r < R; ++r) {
              const V wv = S::set1(wt[r]);
              DP_UNROLL for (int q = 0; q < C; ++q) acc[r][q] = S::fma(wv, xv[q], acc[r][q]);
            }
          }
        }
      }
    const int rv = std::min(R, d.k - k0);
    DP_UNROLL for (int r = 0; r < R; ++r) {  // a constant trip count: acc stays in registers
      if (r >= rv) break;
      const V bv = S::set1(a.bias[k0 + r]);
      float* out = a.yb + (int64_t(k0 + r) * d.p + p0) * L;
      DP_UNROLL for (int q = 0; q < C; ++q) S::store(out + q * L, S::add(acc[r][q], bv));
    }
  }
};

// Data gradient: R input channels x C output positions, per tap a sum over the K output channels,
// added into dxp where that tap of those positions reads (the adjoint of the forward's reads).
template <class S>
struct Dgrad {
  struct Args {
    Dims d;
    const float* dyb;  // (K, P, L)
    const float* wd;   // (C / R, KH*KW, K, R)
    float* dxp;        // (C, HP, WP, L), accumulated
  };
  static constexpr auto kRows = S::kRows, kCols = S::kCols;
  static constexpr int kPaddingShare = S::kPaddingShare;
  template <int R, int C>
  static void run(const Args& a, int c0, int p0) {
    using V = typename S::V;
    constexpr int L = S::L;
    const Dims& d = a.d;
    const int64_t cstride = int64_t(d.hp) * d.wp * L, kstride = int64_t(d.p) * L;
    float* dq[C];
    DP_UNROLL for (int q = 0; q < C; ++q) {
      const int p = p0 + q;
      dq[q] = a.dxp + c0 * cstride + (int64_t(p / d.ow) * d.wp + p % d.ow) * L;
    }
    const int rv = std::min(R, d.c - c0);
    const float* wt = a.wd + int64_t(c0) * d.kh * d.kw * d.k;  // this block's (KH*KW, K, R)
    for (int i = 0; i < d.kh; ++i)
      for (int j = 0; j < d.kw; ++j) {
        V acc[R][C];
        DP_UNROLL for (int r = 0; r < R; ++r) DP_UNROLL for (int q = 0; q < C; ++q) acc[r][q] = S::zero();
        const float* dyk = a.dyb + int64_t(p0) * L;
        for (int k = 0; k < d.k; ++k, dyk += kstride, wt += R) {
          if constexpr (R < C) {  // as Fwd's: the order that needs fewer registers
            V wv[R];
            DP_UNROLL for (int r = 0; r < R; ++r) wv[r] = S::set1(wt[r]);
            DP_UNROLL for (int q = 0; q < C; ++q) {
              const V dv = S::load(dyk + q * L);
              DP_UNROLL for (int r = 0; r < R; ++r) acc[r][q] = S::fma(wv[r], dv, acc[r][q]);
            }
          } else {
            V dv[C];
            DP_UNROLL for (int q = 0; q < C; ++q) dv[q] = S::load(dyk + q * L);
            DP_UNROLL for (int r = 0; r < R; ++r) {
              const V wv = S::set1(wt[r]);
              DP_UNROLL for (int q = 0; q < C; ++q) acc[r][q] = S::fma(wv, dv[q], acc[r][q]);
            }
          }
        }
        const int64_t tap = (int64_t(i) * d.wp + j) * L;
        DP_UNROLL for (int r = 0; r < R; ++r) {
          if (r >= rv) break;
          DP_UNROLL for (int q = 0; q < C; ++q) {
            float* dst = dq[q] + r * cstride + tap;
            S::store(dst, S::add(S::load(dst), acc[r][q]));
          }
        }
      }
  }
};

// Weight gradient: R output channels x C taps, summed over the positions and the lanes. With R <= C
// the R output-gradient vectors of a position are loaded first and each tap's input vector is used R
// times (R*C + R + 1 registers), else the other way round (R*C + C + 1).
template <class S>
struct Wgrad {
  struct Args {
    Dims d;
    const float* xb;   // (C, HP, WP, L)
    const float* dyb;  // (K, P, L)
    float* dw;         // (K, taps), accumulated
  };
  static constexpr auto kRows = S::kWgradRows, kCols = S::kWgradCols;
  static constexpr int kPaddingShare = S::kPaddingShare;
  template <int R, int C>
  static void run(const Args& a, int k0, int t0) {
    using V = typename S::V;
    constexpr int L = S::L;
    const Dims& d = a.d;
    const int rv = std::min(R, d.k - k0);
    // Each tap's offset from a position's window corner, stepped from the first tap's (c, i, j): one
    // division a tile, not three a tap (those were ~15% of the tile).
    int64_t tofs[C];
    {
      const int window = d.kh * d.kw;
      int c = t0 / window, i = t0 % window / d.kw, j = t0 % d.kw;
      DP_UNROLL for (int t = 0; t < C; ++t) {
        tofs[t] = ((int64_t(c) * d.hp + i) * d.wp + j) * L;
        if (++j == d.kw) {
          j = 0;
          if (++i == d.kh) i = 0, ++c;
        }
      }
    }
    const float* dyr[R];  // rows past K repeat the last one; their sums are dropped
    DP_UNROLL for (int r = 0; r < R; ++r) dyr[r] = a.dyb + int64_t(k0 + std::min(r, rv - 1)) * d.p * L;
    V acc[R][C];
    DP_UNROLL for (int r = 0; r < R; ++r) DP_UNROLL for (int t = 0; t < C; ++t) acc[r][t] = S::zero();
    const int oh = d.p / d.ow;
    int64_t pos = 0;
    for (int oy = 0; oy < oh; ++oy) {
      const float* xrow = a.xb + int64_t(oy) * d.wp * L;
      for (int ox = 0; ox < d.ow; ++ox, pos += L) {
        const float* xp = xrow + ox * L;
        if constexpr (R <= C) {
          V dv[R];
          DP_UNROLL for (int r = 0; r < R; ++r) dv[r] = S::load(dyr[r] + pos);
          DP_UNROLL for (int t = 0; t < C; ++t) {
            const V xv = S::load(xp + tofs[t]);
            DP_UNROLL for (int r = 0; r < R; ++r) acc[r][t] = S::fma(dv[r], xv, acc[r][t]);
          }
        } else {
          V xv[C];
          DP_UNROLL for (int t = 0; t < C; ++t) xv[t] = S::load(xp + tofs[t]);
          DP_UNROLL for (int r = 0; r < R; ++r) {
            const V dv = S::load(dyr[r] + pos);
            DP_UNROLL for (int t = 0; t < C; ++t) acc[r][t] = S::fma(dv, xv[t], acc[r][t]);
          }
        }
      }
    }
    add_sums<S>(d, acc, k0, t0, rv, a.dw);
  }
};

// ---- layout transforms ---------------------------------------------------------------------------

// (nv images, planes, H, W) -> (planes, H + 2 pad, W + 2 pad, L): lanes >= nv and the border zero.
template <class S>
void pack(const float* x, int nv, int planes, int h, int w, int pad, float* xb) {
  constexpr int L = S::L;
  const int hp = h + 2 * pad, wp = w + 2 * pad;
  const int64_t area = int64_t(h) * w, image = planes * area;
  if (pad > 0) fill_zero<S>(xb, int64_t(planes) * hp * wp * L);
  typename S::V r[L];
  for (int c = 0; c < planes; ++c) {
    float* dst = xb + int64_t(c) * hp * wp * L;
    for (int64_t s0 = 0; s0 < area; s0 += L) {
      const int m = int(std::min<int64_t>(L, area - s0));
      for (int lane = 0; lane < L; ++lane)
        r[lane] = lane < nv ? S::load_n(x + lane * image + c * area + s0, m) : S::zero();
      S::transpose(r);
      int y = int(s0 / w), xx = int(s0 % w);
      for (int t = 0; t < m; ++t) {
        S::store(dst + ((int64_t(y) + pad) * wp + xx + pad) * L, r[t]);
        if (++xx == w) xx = 0, ++y;
      }
    }
  }
}

// The inverse for the interior: (planes, H + 2 pad, W + 2 pad, L) -> (nv images, planes, H, W).
template <class S>
void unpack(const float* xb, int nv, int planes, int h, int w, int pad, float* x) {
  constexpr int L = S::L;
  const int hp = h + 2 * pad, wp = w + 2 * pad;
  const int64_t area = int64_t(h) * w, image = planes * area;
  typename S::V r[L];
  for (int c = 0; c < planes; ++c) {
    const float* src = xb + int64_t(c) * hp * wp * L;
    for (int64_t s0 = 0; s0 < area; s0 += L) {
      const int m = int(std::min<int64_t>(L, area - s0));
      int y = int(s0 / w), xx = int(s0 % w);
      for (int t = 0; t < L; ++t) {
        r[t] = t < m ? S::load(src + ((int64_t(y) + pad) * wp + xx + pad) * L) : S::zero();
        if (++xx == w) xx = 0, ++y;
      }
      S::transpose(r);
      for (int lane = 0; lane < nv; ++lane) S::store_n(x + lane * image + c * area + s0, r[lane], m);
    }
  }
}

// ---- the fused activation and pooling -------------------------------------------------------------

// pb (K, OH/2, OW/2, L) = the 2x2 average pooling of yb (K, OH, OW, L), as avgpool2_forward adds.
template <class S>
void pool_blocked(const float* yb, int k, int oh, int ow, float* pb) {
  constexpr int L = S::L;
  const int oh2 = oh / 2, ow2 = ow / 2;
  const typename S::V quarter = S::set1(0.25f);
  for (int kk = 0; kk < k; ++kk)
    for (int i = 0; i < oh2; ++i)
      for (int j = 0; j < ow2; ++j) {
        const float* y0 = yb + ((int64_t(kk) * oh + 2 * i) * ow + 2 * j) * L;
        const float* y1 = y0 + int64_t(ow) * L;
        const typename S::V sum = S::add(S::add(S::add(S::load(y0), S::load(y0 + L)), S::load(y1)), S::load(y1 + L));
        S::store(pb + ((int64_t(kk) * oh2 + i) * ow2 + j) * L, S::mul(sum, quarter));
      }
}

// In place on yb, from the activation's output (packed, (K, OH, OW, L)) to the convolution's output
// gradient at the positions the pooling reads, compacted to (K, OH2 * 2, OW2 * 2, L): the pooling's
// backward of pb (K, OH2, OW2, L), then the activation's, as the separate ops compute them. The row
// and column past the last window (odd OH, OW) get a zero gradient, so the tiles skip them (LeNet's
// conv2: 64 of 81 positions) and, for finite inputs, give the bits of the sums that add those zeros.
// Each write lands at or before the read it comes from, and after every read before it.
template <class S>
void unpool_act_blocked(Activation a, int k, int oh, int ow, const float* pb, float* yb) {
  constexpr int L = S::L;
  const int oh2 = oh / 2, ow2 = ow / 2;
  const typename S::V quarter = S::set1(0.25f);
  float* out = yb;
  for (int kk = 0; kk < k; ++kk)
    for (int oy = 0; oy < 2 * oh2; ++oy)
      for (int ox = 0; ox < 2 * ow2; ++ox, out += L) {
        const float* y = yb + ((int64_t(kk) * oh + oy) * ow + ox) * L;
        const typename S::V g = S::mul(S::load(pb + ((int64_t(kk) * oh2 + oy / 2) * ow2 + ox / 2) * L), quarter);
        S::store(out, act_grad<S>(a, S::load(y), g));
      }
}

}  // namespace dp::cpu::fast
