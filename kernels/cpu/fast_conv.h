// The fast convolution (see kernels/cpu/fast.h for the method): the workspace, the blocked way's
// forward and backward over chunks of L images, and the choice between the blocked way
// (fast_blocked.h) and the direct one (fast_direct.h). With a Fusion, the forward also applies the
// activation and the 2x2 average pooling to each chunk while it is in cache, and the backward starts
// from the pooled output's gradient. Templates on the vector type S.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "kernels/cpu/fast_blocked.h"
#include "kernels/cpu/fast_direct.h"

namespace dp::cpu::fast {

// The workspace's regions (see fast_blocked.h for the buffers of a chunk).
struct Workspace {
  float* xb;   // (C, HP, WP, L); the direct way: a block's padded images, (L, C, HP, WP)
  float* yb;   // (K, P, L); the direct way's backward: a block's output gradients, (L, K, OH, OW)
  float* pb;   // (K, Q, L)
  float* dxp;  // (C, HP, WP, L)
  float* wk;   // (K / R, taps, R), K padded to whole tiles
  float* wd;   // (C / R, KH*KW, K, R), C padded to whole tiles
};

// Floats of each region of Workspace, in its order, each rounded up to whole vectors.
template <class S>
std::array<int64_t, 6> regions(const ConvShape& s) {
  auto whole = [](int64_t n) { return (n + S::L - 1) / S::L * S::L; };
  int most_rows = 0;  // the tallest tile: K and C are padded to whole tiles
  for (int r : S::kRows) most_rows = std::max(most_rows, r);
  for (int r : S::kFwdRows) most_rows = std::max(most_rows, r);
  for (int r : S::kDirectRows) most_rows = std::max(most_rows, r);
  const int64_t xb = whole(int64_t(s.c) * (s.h + 2 * s.pad) * (s.w + 2 * s.pad) * S::L);
  // The direct way's wide output gradients (fast_direct.h): rows as wide as the padded input's, and
  // the slack its rows' whole-vector stores spill into.
  const int64_t wide = S::kDirectWideGradient ? int64_t(s.k) * s.out_h() * (s.w + 2 * s.pad) * S::L + S::L : 0;
  return {xb,
          whole(std::max(int64_t(s.k) * s.col_cols() * S::L, wide)),
          whole(int64_t(s.k) * (s.out_h() / 2) * (s.out_w() / 2) * S::L),
          xb,
          whole((int64_t(s.k) + most_rows) * s.col_rows()),
          whole((int64_t(s.c) + most_rows) * s.kh * s.kw * s.k)};
}

// Floats of workspace conv_forward and conv_backward need for shape s; independent of s.n.
template <class S>
int64_t workspace_floats(const ConvShape& s) {
  int64_t total = 0;
  for (int64_t r : regions<S>(s)) total += r;
  return total;
}

template <class S>
Workspace carve(const ConvShape& s, float* ws) {
  const std::array<int64_t, 6> r = regions<S>(s);
  Workspace w{};
  float** region[] = {&w.xb, &w.yb, &w.pb, &w.dxp, &w.wk, &w.wd};
  for (int i = 0; i < 6; ++i) {
    *region[i] = ws;
    ws += r[i];
  }
  return w;
}

template <class S>
void forward_blocked(const ConvShape& s, const float* x, const float* w, const float* b, float* y, const Fusion* f,
                     const Workspace& ws) {
  constexpr int L = S::L;
  using K = Fwd<S>;
  const typename K::Args a{.d = dims_of<S>(s), .xb = ws.xb, .wk = ws.wk, .bias = b, .yb = ws.yb};
  const int opt = pick_rows<K>(s.k), oh = s.out_h(), ow = s.out_w();
  pack_forward_weights<S>(w, s.k, a.d.taps, K::kRows[opt], ws.wk);
  const int64_t in_image = int64_t(s.c) * s.h * s.w, out_image = int64_t(s.k) * a.d.p,
                pool_image = int64_t(s.k) * (oh / 2) * (ow / 2);
  for (int n0 = 0; n0 < s.n; n0 += L) {
    const int nv = std::min(L, s.n - n0);
    pack<S>(x + n0 * in_image, nv, s.c, s.h, s.w, s.pad, ws.xb);
    tiles<K>(a, opt, s.k, a.d.p);
    if (f) {
      activation_forward<S>(f->act, int64_t(s.k) * a.d.p * L, ws.yb, ws.yb);
      pool_blocked<S>(ws.yb, s.k, oh, ow, ws.pb);
      unpack<S>(ws.pb, nv, s.k, oh / 2, ow / 2, 0, f->y_pool + n0 * pool_image);
    }
    unpack<S>(ws.yb, nv, s.k, oh, ow, 0, y + n0 * out_image);
  }
}

// wd (C / R, KH*KW, K, R) from w (K, C, KH, KW), R = rows; rows past C zero. The data gradient's weights.
template <class S>
void pack_data_weights(const ConvShape& s, const float* w, int rows, float* wd) {
  const int window = s.kh * s.kw;
  for (int c0 = 0; c0 < s.c; c0 += rows)
    for (int t = 0; t < window; ++t)
      for (int k = 0; k < s.k; ++k)
        for (int r = 0; r < rows; ++r)
          wd[int64_t(c0) * window * s.k + (int64_t(t) * s.k + k) * rows + r] =
              c0 + r < s.c ? w[(int64_t(k) * s.c + c0 + r) * window + t] : 0.0f;
}

// Images n0 .. n0+nv-1's output gradient into yb (K, P, L): dy's, or with f built from dy_pool and
// y_act at the positions the pooling reads only (see unpool_act_blocked and backward_dims).
template <class S>
void output_gradient_blocked(const ConvShape& s, const float* dy, const Fusion* f, int n0, int nv,
                             const Workspace& ws) {
  const int oh = s.out_h(), ow = s.out_w();
  const int64_t out_image = int64_t(s.k) * oh * ow, pool_image = int64_t(s.k) * (oh / 2) * (ow / 2);
  if (!f) return pack<S>(dy + n0 * out_image, nv, s.k, oh, ow, 0, ws.yb);
  pack<S>(f->y_act + n0 * out_image, nv, s.k, oh, ow, 0, ws.yb);
  pack<S>(f->dy_pool + n0 * pool_image, nv, s.k, oh / 2, ow / 2, 0, ws.pb);
  unpool_act_blocked<S>(f->act, s.k, oh, ow, ws.pb, ws.yb);
}

// The backward tiles' dims: with f, the output positions are those the pooling reads, (OH/2 * 2,
// OW/2 * 2), the others' gradient being zero. The tiles find a position's window corner from d.ow
// alone, so the narrower output indexes the same input.
template <class S>
Dims backward_dims(const ConvShape& s, const Fusion* f) {
  Dims d = dims_of<S>(s);
  if (f) {
    d.ow = s.out_w() / 2 * 2;
    d.p = s.out_h() / 2 * 2 * d.ow;
  }
  return d;
}

// The data gradient's tiles, as tiles<Dgrad<S>> over all OH * OW output positions would run them,
// for the d.p positions of backward_dims: each column block of the full output drops its positions
// past the pooling's windows (they stay in order, so the rest is a run of the compacted ones). A
// pixel of dx then gets the same nonzero terms in the same order (block, then tap) as without f.
template <class S>
void data_gradient_tiles(const ConvShape& s, const typename Dgrad<S>::Args& a, int option) {
  const int rows = Dgrad<S>::kRows[option], cols = Dgrad<S>::kCols[option], ow = s.out_w(), p = int(s.col_cols());
  const int kept_h = a.d.p / a.d.ow;
  auto kept_before = [&](int q) {  // the kept positions before full position q
    const int oy = q / ow, ox = q % ow;
    return oy < kept_h ? oy * a.d.ow + std::min(ox, a.d.ow) : a.d.p;
  };
  for (int r0 = 0; r0 < s.c; r0 += rows)
    for (int q0 = 0; q0 < p; q0 += cols) {
      const int first = kept_before(q0), n = kept_before(std::min(q0 + cols, p)) - first;
      if (n > 0) tile<Dgrad<S>>(option, n)(a, r0, first);
    }
}

// dw and db are accumulated; dx (or null) is written.
template <class S>
void backward_blocked(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                      float* db, const Fusion* f, const Workspace& ws) {
  constexpr int L = S::L;
  const Dims d = backward_dims<S>(s, f);
  if (d.p == 0) {  // a fused output of one row or column: no gradient reaches the convolution
    if (dx) fill_zero<S>(dx, int64_t(s.n) * s.c * s.h * s.w);
    return;
  }
  const typename Wgrad<S>::Args wa{.d = d, .xb = ws.xb, .dyb = ws.yb, .dw = dw};
  const typename Dgrad<S>::Args da{.d = d, .dyb = ws.yb, .wd = ws.wd, .dxp = ws.dxp};
  const int kopt = pick_rows<Wgrad<S>>(s.k), copt = pick_rows<Dgrad<S>>(s.c);
  if (dx) pack_data_weights<S>(s, w, Dgrad<S>::kRows[copt], ws.wd);
  const int64_t in_image = int64_t(s.c) * s.h * s.w;
  for (int n0 = 0; n0 < s.n; n0 += L) {
    const int nv = std::min(L, s.n - n0);
    pack<S>(x + n0 * in_image, nv, s.c, s.h, s.w, s.pad, ws.xb);
    output_gradient_blocked<S>(s, dy, f, n0, nv, ws);
    tiles<Wgrad<S>>(wa, kopt, s.k, d.taps);
    for (int k = 0; k < s.k; ++k) {
      typename S::V acc = S::zero();
      const float* dk = ws.yb + int64_t(k) * d.p * L;
      for (int p = 0; p < d.p; ++p) acc = S::add(acc, S::load(dk + int64_t(p) * L));
      db[k] += S::hsum(acc);
    }
    if (dx) {
      fill_zero<S>(ws.dxp, int64_t(s.c) * d.hp * d.wp * L);
      if (f)
        data_gradient_tiles<S>(s, da, copt);
      else
        tiles<Dgrad<S>>(da, copt, s.c, d.p);
      unpack<S>(ws.dxp, nv, s.c, s.h, s.w, s.pad, dx + n0 * in_image);
    }
  }
}

// As dp::cpu::conv2d_forward in float, and with f the activation and pooling after it (y then holds
// the activation's output). ws: workspace_floats<S>(s) floats.
template <class S>
void conv_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y, float* ws,
                  const Fusion* f) {
  if (s.n <= 0 || s.k <= 0 || s.col_cols() <= 0) return;
  const Workspace regions = carve<S>(s, ws);
  if (direct_pays<S>(s))
    forward_direct<S>(s, x, w, b, y, f, regions.xb, regions.wk);
  else
    forward_blocked<S>(s, x, w, b, y, f, regions);
}

// As dp::cpu::conv2d_backward in float, and with f from the pooled output's gradient instead of dy
// (then null).
template <class S>
void conv_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw, float* db,
                   float* ws, const Fusion* f) {
  fill_zero<S>(dw, int64_t(s.k) * s.col_rows());
  fill_zero<S>(db, s.k);
  if (s.n <= 0 || s.k <= 0 || s.col_cols() <= 0) {
    if (dx) fill_zero<S>(dx, int64_t(s.n) * s.c * s.h * s.w);
    return;
  }
  const Workspace regions = carve<S>(s, ws);
  if (!dx && direct_pays<S>(s))  // a first layer: no data gradient, no transposes
    backward_direct<S>(s, x, dy, dw, db, f, regions.xb, regions.yb);
  else
    backward_blocked<S>(s, x, w, dy, dx, dw, db, f, regions);
}

}  // namespace dp::cpu::fast
