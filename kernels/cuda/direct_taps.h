// The taps of conv_direct.cu's kernels and a thread's part of their weight gradient, in plain C++
// outside nvcc: the kernel runs `accumulate` on its threads and adds up their sums (warp shuffles, the
// block's warps, the slices); tests/test_direct_taps.cpp runs it on the host for every thread of a
// grid, against convolutions in double, so the host checks the index arithmetic a GPU runs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/divider.h"
#include "kernels/math.h"
#include "kernels/ops.h"

#if defined(__CUDA_ARCH__)  // the device pass: the host compiler knows no such pragma
#define DP_UNROLL _Pragma("unroll")
#else
#define DP_UNROLL
#endif

namespace dp::cuda::direct {

constexpr int kTaps = 32;  // C KH KW at most (CudaOps::kDirectTaps)
// The weight gradient's grid: kSlices blocks of kBlock threads (cuda::kThreads) for each group of
// kGroupOf<kMax> channels (CudaOps::kDirectSlices; conv_direct.cu holds them equal).
constexpr int kSlices = 64, kBlock = 256, kGroupThreads = kSlices * kBlock;
template <int kMax>
constexpr int kGroupOf = kMax <= 9    ? 4
                         : kMax <= 16 ? 2
                                      : 1;  // within the registers kMax leaves

// The smallest of the instantiated tap bounds (kMax) that holds C KH KW taps, as a call of f.
template <class F>
void with_tap_bound(int crs, F&& f) {
  if (crs <= 9)  // 1 x 3 x 3
    f.template operator()<9>();
  else if (crs <= 16)
    f.template operator()<16>();
  else if (crs <= 25)  // 1 x 5 x 5
    f.template operator()<25>();
  else
    f.template operator()<kTaps>();
}

// Tap t = (c KH + u) KW + v of the filter: its offset in an image, (c H + u) W + v, and u, v. The
// slots past C KH KW hold a row u far above any image, so that they are never inside one.
struct Taps {
  int offset[kTaps], u[kTaps], v[kTaps];
};
constexpr int kNowhere = -(1 << 24);

// Thread `tid` of a block of `threads` fills its share of the slots.
DP_HD void fill_taps(const ConvShape& s, Taps& taps, int tid, int threads) {
  const int khw = s.kh * s.kw;
  for (int t = tid; t < kTaps; t += threads) {
    const int ch = t / khw, u = (t - ch * khw) / s.kw, v = t - ch * khw - u * s.kw;
    const bool tap = t < s.c * khw;
    taps.offset[t] = tap ? (ch * s.h + u) * s.w + v : 0, taps.u[t] = tap ? u : kNowhere, taps.v[t] = tap ? v : 0;
  }
}

// The images' residues R of the weight gradient's columns (pixel q, residue r): as many as a group's
// threads hold a column each of, every image its own at most (1 for n = 0, which the callers return
// before: std::clamp's bounds must stay ordered).
inline int residues(const ConvShape& s) {
  return std::clamp(kGroupThreads / (s.out_h() * s.out_w()), 1, std::max(s.n, 1));
}

// Where accumulate's dy[n, ch, q] comes from, for a column (output pixel q at qy, qx): `column` once a
// column, `at` once an image and channel.
struct DyColumn {
  int q, cell;  // the pixel; and its pooling window, -1 if none (DyActPool)
};
// dy itself, (N, K, P).
struct DyPlanes {
  const float* dy;
  int k, p;
  DP_HD DyColumn column(int q, int, int) const { return {q, 0}; }
  DP_HD float at(DyColumn c, int ch, int n) const { return dy[(n * k + ch) * p + c.q]; }
};
// dy's rows, (K, N P): the fused op's layout (conv_act_pool.cu); the same values.
struct DyRows {
  const float* dyt;
  int rows, p;  // N P, P
  DP_HD DyColumn column(int q, int, int) const { return {q, 0}; }
  DP_HD float at(DyColumn c, int ch, int n) const { return dyt[ch * rows + n * p + c.q]; }
};
// The fused op's backward (conv2d, activation A, window x window average pooling) where nothing else
// wants dy's rows (no dx: a first layer): dy worked out here from the pooled layer's gradient dy_pool
// (N, K, PH, PW) and the activation's output y_act (N, K, P), with conv_act_pool.cu's
// act_pool_backward_rows_kernel's operations in its order: the values it would have written.
template <Activation A>
struct DyActPool {
  const float *y_act, *dy_pool;
  int k, p, window, ph, pw;
  float inv;  // 1 / window^2
  DP_HD DyColumn column(int q, int qy, int qx) const {
    const int wi = qy / window, wj = qx / window;
    return {q, wi < ph && wj < pw ? wi * pw + wj : -1};
  }
  DP_HD float at(DyColumn c, int ch, int n) const {
    const int plane = n * k + ch;
    return math::act_pool_grad<A>(y_act[plane * p + c.q], c.cell >= 0 ? dy_pool + plane * ph * pw + c.cell : nullptr,
                                  inv);
  }
};

// Thread g of a group's `threads` adds, into acc[c - ch0][t], dy[n, c, q] x[n, ., qy + u - pad, qx + v
// - pad] for every tap t of C KH KW (and into acc[.][kMax] dy alone, the bias), for the channels c of
// ch0 .. ch0 + kGroup - 1 below K, over the rows j = n P + q it takes: the columns c = g, g + threads,
// ... of the P R (pixel q = c % P, residue r = c / P), and of each the images n = r, r + R, ... in
// order. Which taps lie inside the image is worked out once a column; an image then costs a load a tap
// and dy a channel (Dy: DyPlanes, DyRows, DyActPool), no division. kMax (C KH KW or more) bounds the
// unrolled loops, whose sums stay in registers.
template <int kMax, int kGroup, class Dy>
DP_HD void accumulate(const ConvShape& s, const Taps& taps, Divider pixels, Divider ow, int residues, int ch0, int g,
                      int threads, const float* x, const Dy& dy, float (&acc)[kGroup][kMax + 1]) {
  const int p = pixels.divisor(), image = s.c * s.h * s.w;
  for (int c = g; c < p * residues; c += threads) {
    int r = 0, q = 0, qy = 0, qx = 0;
    pixels.divmod(c, r, q);
    ow.divmod(q, qy, qx);
    const DyColumn column = dy.column(q, qy, qx);
    const int top = qy - s.pad, left = qx - s.pad;
    uint32_t inside = 0u;  // bit t: tap t lies inside the image
    DP_UNROLL
    for (int t = 0; t < kMax; ++t) {
      const int yy = top + taps.u[t], xx = left + taps.v[t];
      inside |= uint32_t(yy >= 0 && yy < s.h && xx >= 0 && xx < s.w) << t;
    }
    for (int n = r; n < s.n; n += residues) {
      const int corner = n * image + top * s.w + left;  // tap t at corner + its offset, where inside
      float xv[kMax];
      DP_UNROLL
      for (int t = 0; t < kMax; ++t) xv[t] = inside >> t & 1u ? x[corner + taps.offset[t]] : 0.0f;
      DP_UNROLL
      for (int k = 0; k < kGroup; ++k) {
        const int ch = ch0 + k;
        if (ch >= s.k) break;
        const float d = dy.at(column, ch, n);
        DP_UNROLL
        for (int t = 0; t < kMax; ++t) acc[k][t] = fmaf(d, xv[t], acc[k][t]);
        acc[k][kMax] = math::add_rn(acc[k][kMax], d);  // d may be a product (DyActPool)
      }
    }
  }
}

// The fused op's forward pass (conv2d, activation A, 2 x 2 average pooling) for a shape of at most
// kMax taps whose output the windows tile (OH and OW even): thread j takes window j = n PH PW + cell of
// every channel. It loads its four pixels' taps into registers once, then for each channel ch computes
// each pixel's convolution (one FMA chain over the taps in order from 0, as direct_forward_kernel), adds
// the bias, activates it into y_act (N, K, OH, OW), and sums the window in row order times 1/4 into
// y_pool (N, K, PH, PW), as conv_act_pool.cu's bias_act_pool_kernel: the bits of the two kernels, with
// neither the convolution's output written nor read back. w (K, C KH KW) and b (K): the kernel's
// shared copies.
constexpr int kWindow = 2, kWindowTaps = 16;  // the registers: four pixels' taps, up to 64
template <int kMax, Activation A>
DP_HD void forward_window(const ConvShape& s, const Taps& taps, Divider cells, Divider pw, int j, const float* x,
                          const float* w, const float* b, float* y_act, float* y_pool) {
  const int ow = s.w + 2 * s.pad - s.kw + 1, p = (s.h + 2 * s.pad - s.kh + 1) * ow;  // out_w, out_h: host code
  const int crs = s.c * s.kh * s.kw, cell_count = cells.divisor();
  int img = 0, cell = 0, wi = 0, wj = 0;
  cells.divmod(j, img, cell);
  pw.divmod(cell, wi, wj);
  float xv[kWindow * kWindow][kMax];  // pixel (wi 2 + a, wj 2 + c) at a 2 + c
  DP_UNROLL
  for (int e = 0; e < kWindow * kWindow; ++e) {
    const int top = wi * kWindow + e / kWindow - s.pad, left = wj * kWindow + e % kWindow - s.pad;
    const int base = img * s.c * s.h * s.w + top * s.w + left;
    DP_UNROLL
    for (int t = 0; t < kMax; ++t) {
      const int yy = top + taps.u[t], xx = left + taps.v[t];
      xv[e][t] = yy >= 0 && yy < s.h && xx >= 0 && xx < s.w ? x[base + taps.offset[t]] : 0.0f;
    }
  }
  const int corner = (wi * ow + wj) * kWindow;  // the window's first pixel in its plane
  for (int ch = 0; ch < s.k; ++ch) {
    const float* wk = w + ch * crs;
    float* out = y_act + (img * s.k + ch) * p + corner;
    float pool = 0.0f;
    DP_UNROLL
    for (int e = 0; e < kWindow * kWindow; ++e) {
      float acc = 0.0f;
      DP_UNROLL
      for (int t = 0; t < kMax; ++t)
        if (t < crs) acc = fmaf(wk[t], xv[e][t], acc);
      const float v = math::activate<A>(acc + b[ch]);
      out[e / kWindow * ow + e % kWindow] = v;
      pool = math::add_rn(pool, v);
    }
    y_pool[(img * s.k + ch) * cell_count + cell] = pool * (1.0f / float(kWindow * kWindow));
  }
}

}  // namespace dp::cuda::direct

#undef DP_UNROLL
