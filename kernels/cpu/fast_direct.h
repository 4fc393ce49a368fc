// The direct way of the fast convolution (kernels/cpu/fast.h): NCHW as it is, vectors along an
// output row, for layers with few taps per output (a first layer: C = 1, 3x3 or 5x5), where the
// transposes of the blocked way would cost more than the arithmetic. Its backward computes no dx, so
// it serves the first layer only; with dx the blocked way runs. Templates on the vector type S.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/fast_eltwise.h"
#include "kernels/cpu/fast_tiles.h"

namespace dp::cpu::fast {

// A block of nb images in NCHW: a copy with a zero border of `pad`, or the input itself.
struct DirectImages {
  const float* x;  // (nb, C, rows, row)
  int64_t image;   // floats per image
  int64_t plane;   // floats per channel plane
  int row;         // floats per row
  int nb;
};

// Forward of one output row of one image: R output channels x NV vectors along the row. The last
// vector is partial (masked loads that never read past the row's end, masked stores), or where
// S::kDirectOverlap and the row has L or more outputs, a whole vector ending at the row's end that
// overlaps the one before: its shared outputs are computed twice, to the same bits.
template <class S>
struct DirectFwd {
  struct Args {
    Dims d;
    DirectImages x;     // x.x: the image, (C, rows, row)
    const float* wk;    // (K / R, taps, R)
    const float* bias;  // (K)
    bool activate;      // fused: the activation act is applied before a row is stored
    Activation act;
    float* y;  // the image's output, (K, OH, OW)
  };
  static constexpr auto kRows = S::kDirectRows, kCols = S::kDirectCols;
  static constexpr int kPaddingShare = S::kPaddingShare;
  template <int R, int NV>
  static void run(const Args& a, int k0, int oy) {
    using V = typename S::V;
    constexpr int L = S::L;
    const Dims& d = a.d;
    const bool overlap = S::kDirectOverlap && d.ow >= L;
    const int last = overlap ? L : d.ow - (NV - 1) * L;     // lanes of the last vector
    const int last_at = overlap ? d.ow - L : (NV - 1) * L;  // and where it starts
    const int rv = std::min(R, d.k - k0);
    V acc[R][NV];
    DP_UNROLL for (int r = 0; r < R; ++r) DP_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] =
        S::set1(r < rv ? a.bias[k0 + r] : 0.0f);
    const float* wt = a.wk + int64_t(k0) * d.taps;  // this block's (taps, R)
    for (int c = 0; c < d.c; ++c)
      for (int i = 0; i < d.kh; ++i) {
        const float* row = a.x.x + c * a.x.plane + int64_t(oy + i) * a.x.row;
        for (int j = 0; j < d.kw; ++j, wt += R) {
          if constexpr (S::kDirectHoldWeights) {
            // R broadcasts held, one vector of x at a time: R + 1 operands (the 16 ymm registers).
            V wv[R];
            DP_UNROLL for (int r = 0; r < R; ++r) wv[r] = S::set1(wt[r]);
            DP_UNROLL for (int v = 0; v < NV; ++v) {
              const V xv = v + 1 < NV ? S::load(row + j + v * L) : S::load_n(row + j + last_at, last);
              DP_UNROLL for (int r = 0; r < R; ++r) acc[r][v] = S::fma(wv[r], xv, acc[r][v]);
            }
          } else {
            // NV vectors of x held, one broadcast at a time: NV + 1 operands.
            V xv[NV];
            DP_UNROLL for (int v = 0; v + 1 < NV; ++v) xv[v] = S::load(row + j + v * L);
            xv[NV - 1] = S::load_n(row + j + last_at, last);
            DP_UNROLL for (int r = 0; r < R; ++r) {
              const V wv = S::set1(wt[r]);
              DP_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = S::fma(wv, xv[v], acc[r][v]);
            }
          }
        }
      }
    if (a.activate) {
      DP_UNROLL for (int r = 0; r < R; ++r) DP_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] =
          activate<S>(a.act, acc[r][v]);
    }
    DP_UNROLL for (int r = 0; r < R; ++r) {
      if (r >= rv) break;
      float* out = a.y + int64_t(k0 + r) * d.p + int64_t(oy) * d.ow;
      DP_UNROLL for (int v = 0; v + 1 < NV; ++v) S::store(out + v * L, acc[r][v]);
      S::store_n(out + last_at, acc[r][NV - 1], last);
    }
  }
};

// Weight gradient: R output channels x C taps, summed over the block's images and the vectors along
// each of `rows` rows of `span` outputs (masked lanes past a row read as zero in both factors). dy's
// rows are (OH, OW), or where S::kDirectWideGradient (backward_direct builds them so), as wide as
// x's rows, zero past OW: then the whole plane is one row, (OH - 1) * row + OW long, and only its last
// vector is partial. (LeNet's 26 outputs a row fill 26 of 32 lanes; a plane of 26-of-28 fills 93%.)
template <class S>
struct DirectWgrad {
  struct Args {
    Dims d;
    DirectImages x;
    const float* dy;  // (nb, K, OH, dy_row)
    int dy_row;       // floats per row of dy: OW, or x.row (wide)
    int rows, span;   // rows summed over, and outputs a row: OH, OW or (wide) 1, (OH - 1) * x.row + OW
    float* dw;        // (K, taps), accumulated
  };
  static constexpr auto kRows = S::kWgradRows, kCols = S::kWgradCols;
  static constexpr int kPaddingShare = S::kPaddingShare;
  template <int R, int C>
  static void run(const Args& a, int k0, int t0) {
    using V = typename S::V;
    constexpr int L = S::L;
    const Dims& d = a.d;
    const int rv = std::min(R, d.k - k0);
    int64_t tofs[C];
    DP_UNROLL for (int t = 0; t < C; ++t) {
      const int tap = t0 + t, c = tap / (d.kh * d.kw), i = tap / d.kw % d.kh, j = tap % d.kw;
      tofs[t] = c * a.x.plane + int64_t(i) * a.x.row + j;
    }
    const int64_t plane = int64_t(d.p / d.ow) * a.dy_row;  // floats of a channel of dy
    int64_t krow[R];
    DP_UNROLL for (int r = 0; r < R; ++r) krow[r] = (k0 + std::min(r, rv - 1)) * plane;
    V acc[R][C];
    DP_UNROLL for (int r = 0; r < R; ++r) DP_UNROLL for (int t = 0; t < C; ++t) acc[r][t] = S::zero();
    // acc += the products of the m lanes at xp and dp
    auto step = [&](const float* xp, const float* dp, int m) __attribute__((always_inline)) {
      V xv[C];
      DP_UNROLL for (int t = 0; t < C; ++t) xv[t] = S::load_n(xp + tofs[t], m);
      DP_UNROLL for (int r = 0; r < R; ++r) {
        const V dv = S::load_n(dp + krow[r], m);
        DP_UNROLL for (int t = 0; t < C; ++t) acc[r][t] = S::fma(dv, xv[t], acc[r][t]);
      }
    };
    const int whole = a.span / L, tail = a.span - whole * L;
    for (int n = 0; n < a.x.nb; ++n) {
      const float* xn = a.x.x + n * a.x.image;
      const float* dyn = a.dy + n * d.k * plane;
      for (int y = 0; y < a.rows; ++y) {
        const float* xp = xn + int64_t(y) * a.x.row;
        const float* dp = dyn + int64_t(y) * a.dy_row;
        for (int v = 0; v < whole; ++v, xp += L, dp += L) step(xp, dp, L);
        if (tail) step(xp, dp, tail);
      }
    }
    add_sums<S>(d, acc, k0, t0, rv, a.dw);
  }
};

// The direct way pays where the transposes of the blocked way outweigh the arithmetic (few taps per
// output: a 1-channel first layer has 9 or 25) and a row fills most of its vectors.
template <class S>
bool direct_pays(const ConvShape& s) {
  const int nv = (s.out_w() + S::L - 1) / S::L;
  return s.col_rows() <= 32 && 4 * s.out_w() >= 3 * nv * S::L && pick_rows<DirectFwd<S>>(s.k, nv) >= 0;
}

// Images n0 .. n0+nb-1 of x (N, C, H, W): x itself, or (pad > 0) copied with their border into buf
// (nb, C, HP, WP).
template <class S>
DirectImages direct_images(const ConvShape& s, const float* x, int n0, int nb, float* buf) {
  const int64_t plane = int64_t(s.h) * s.w;
  if (s.pad == 0) return {.x = x + n0 * s.c * plane, .image = s.c * plane, .plane = plane, .row = s.w, .nb = nb};
  const int hp = s.h + 2 * s.pad, wp = s.w + 2 * s.pad;
  const DirectImages b{.x = buf, .image = s.c * int64_t(hp) * wp, .plane = int64_t(hp) * wp, .row = wp, .nb = nb};
  fill_zero<S>(buf, nb * b.image);
  for (int n = 0; n < nb; ++n)
    for (int c = 0; c < s.c; ++c)
      for (int y = 0; y < s.h; ++y)
        copy_floats<S>(x + (int64_t(n0 + n) * s.c + c) * plane + int64_t(y) * s.w, s.w,
                       buf + n * b.image + c * b.plane + int64_t(y + s.pad) * wp + s.pad);
  return b;
}

// conv2d_forward the direct way, and with f the activation (in the tile, before a row is stored) and
// the 2x2 pooling after it, each image's while it is in cache. images: (L, C, HP, WP) floats of
// scratch, wk: the packed weights' ((K + the tallest tile), taps).
template <class S>
void forward_direct(const ConvShape& s, const float* x, const float* w, const float* b, float* y, const Fusion* f,
                    float* images, float* wk) {
  constexpr int L = S::L;
  using K = DirectFwd<S>;
  const Dims d = dims_of<S>(s);
  const int nv = (d.ow + L - 1) / L, opt = pick_rows<K>(s.k, nv), R = K::kRows[opt];
  pack_forward_weights<S>(w, s.k, d.taps, R, wk);
  const TileFn<K> row = tile<K>(opt, nv);
  const PoolShape pool{.n = 1, .c = s.k, .h = s.out_h(), .w = s.out_w(), .k = 2};
  const int64_t out_image = int64_t(s.k) * d.p, pool_image = int64_t(s.k) * pool.out_h() * pool.out_w();
  for (int n0 = 0; n0 < s.n; n0 += L) {
    const DirectImages block = direct_images<S>(s, x, n0, std::min(L, s.n - n0), images);
    for (int n = 0; n < block.nb; ++n) {
      typename K::Args a{.d = d,
                         .x = block,
                         .wk = wk,
                         .bias = b,
                         .activate = f != nullptr,
                         .act = f ? f->act : Activation::relu,
                         .y = y + (n0 + n) * out_image};
      a.x.x += n * block.image;
      for (int oy = 0; oy < s.out_h(); ++oy)
        for (int k0 = 0; k0 < s.k; k0 += R) row(a, k0, oy);
      if (f) avgpool2_forward<S>(pool, a.y, f->y_pool + (n0 + n) * pool_image);
    }
  }
}

// conv2d_backward the direct way, without dx (a first layer): no transposes. With f, each block's
// output gradients are first built in dy_block (L, K, OH, OW) from the pooled output's gradient; where
// S::kDirectWideGradient, dy_block is (L, K, OH, WP) (see DirectWgrad), from dy without f. images: as forward_direct's.
// dw and db are accumulated.
template <class S>
void backward_direct(const ConvShape& s, const float* x, const float* dy, float* dw, float* db, const Fusion* f,
                     float* images, float* dy_block) {
  constexpr int L = S::L;
  using K = DirectWgrad<S>;
  const Dims d = dims_of<S>(s);
  const int opt = pick_rows<K>(s.k), oh = s.out_h(), ow = s.out_w();
  const int dy_row = S::kDirectWideGradient ? s.w + 2 * s.pad : ow;
  const int64_t out_image = int64_t(s.k) * d.p, pool_image = int64_t(s.k) * (oh / 2) * (ow / 2),
                block_image = int64_t(s.k) * oh * dy_row;
  for (int n0 = 0; n0 < s.n; n0 += L) {
    const DirectImages images_block = direct_images<S>(s, x, n0, std::min(L, s.n - n0), images);
    const bool wide = dy_row > ow;  // then dy_row == images_block.row
    const typename K::Args a{.d = d,
                             .x = images_block,
                             .dy = f || wide ? dy_block : dy + n0 * out_image,
                             .dy_row = dy_row,
                             .rows = wide ? 1 : oh,
                             .span = wide ? (oh - 1) * dy_row + ow : ow,
                             .dw = dw};
    if (f)
      for (int n = 0; n < a.x.nb; ++n)
        unpool_act<S>(f->act, s.k, oh, ow, f->y_act + (n0 + n) * out_image, f->dy_pool + (n0 + n) * pool_image,
                      dy_block + n * block_image, dy_row);
    else if (wide)  // dy's rows widened, as the fused way builds them: the same sums, to the bit
      for (int n = 0; n < a.x.nb; ++n)
        for (int r = 0; r < s.k * oh; ++r)  // in order: a row's last vector spills zeros into the next
          for (int ox = 0; ox < dy_row; ox += L)
            S::store(dy_block + n * block_image + int64_t(r) * dy_row + ox,
                     ox < ow ? S::load_n(dy + (n0 + n) * out_image + int64_t(r) * ow + ox, std::min(L, ow - ox))
                             : S::zero());
    tiles<K>(a, opt, s.k, d.taps);
    for (int n = 0; n < a.x.nb; ++n)
      for (int k = 0; k < s.k; ++k) {
        const float* dk = a.dy + n * block_image + k * int64_t(oh) * dy_row;
        if (wide) {  // zero past OW; 4 sums, not to wait on the adds' latency
          const int p_end = oh * dy_row;
          typename S::V acc[4] = {S::zero(), S::zero(), S::zero(), S::zero()};
          int p = 0;
          for (; p + 4 * L <= p_end; p += 4 * L)
            DP_UNROLL for (int u = 0; u < 4; ++u) acc[u] = S::add(acc[u], S::load(dk + p + u * L));
          for (; p < p_end; p += L) acc[0] = S::add(acc[0], S::load_n(dk + p, std::min(L, p_end - p)));
          db[k] += S::hsum(S::add(S::add(acc[0], acc[1]), S::add(acc[2], acc[3])));
          continue;
        }
        typename S::V acc = S::zero();
        for (int p = 0; p < d.p; p += L) acc = S::add(acc, S::load_n(dk + p, std::min(L, d.p - p)));
        db[k] += S::hsum(acc);
      }
  }
}

}  // namespace dp::cpu::fast
