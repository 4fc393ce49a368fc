// Convolutions as implicit GEMMs: the im2col matrix X (N OH OW rows, one per output pixel j = n P + q;
// C KH KW columns, one per tap t = (c KH + u) KW + v) is never written, each block gathers the tile
// of it that it needs from x straight into shared memory. Two products use it:
//   forward      y (K, N P) = w (K, C KH KW) X^T,  a block a 64 x 64 tile of (k, j), over every tap;
//   filter grad  dw (K, C KH KW) = dy (K, N P) X, and db as one more column of X that is all ones,
//                a block a 64 x 64 tile of (k, t) over one slice of the rows j: its partial sums,
//                added slice by slice in order by a second kernel (conv_implicit.cu).
// The im2col path (conv2d.cu) writes X (19 us for lenet's conv2 at batch 256 on an H200), reads it
// back in a split-K cuBLAS GEMM (38 + 8 us); cuDNN's forward took 60 us for the same 0.5 G
// multiply-adds.
//
// Plain C++ outside nvcc: a block's work is written as phases over its threads (setup; a fetch of
// the first stage of kK reductions into registers; per stage a put of them into shared memory, the
// next stage's fetch, whose loads are in flight while the accumulate that follows runs; a store),
// which the kernel runs with __syncthreads between them and tests/test_tile_gemm.cpp runs on the host
// thread by thread, phase by phase, against convolutions in double: the host checks the index
// arithmetic the GPU runs.
//
// Sums: every output is one FMA chain over the reduction in order, from 0 (the forward pass's bias is
// added after, as on the other paths); the filter gradient's slices are then added in slice order.
// The same bits every run, within the tests' bounds for any tree (tests/test_ops_conv.cpp).
#pragma once

#include <cstdint>

#include "kernels/cuda/divider.h"
#include "kernels/math.h"
#include "kernels/ops.h"

namespace dp::cuda::tile {

constexpr int kM = 64, kN = 64, kK = 16, kThreads = 256;  // a block's tile, its reduction stage, its threads
constexpr int kRow = kM + 4;  // a stage's row in shared memory: 16-byte aligned, stores 2-way conflicted at most
constexpr int kNowhere = -(1 << 24);  // a row or tap coordinate outside every image
static_assert(kM == kN && kThreads == (kM / 4) * (kN / 4) && kThreads == kK * (kM / 4));
inline int64_t tiles(int64_t n) { return (n + kM - 1) / kM; }  // the blocks along a side of n

struct Smem {
  alignas(16) float a[kK][kRow];  // a stage of the left factor, (reduction, m)
  alignas(16) float b[kK][kRow];  // and of the right one, (reduction, n)
  // Coordinates fixed for the whole block: the forward pass's 64 output pixels (base, top, left),
  // the filter gradient's 64 taps (offset, u, v; `one` is 1 in db's column).
  int base[kN], top[kN], left[kN];
  float one[kN];
};

// A stage's values that thread tid fetched, at reduction kk = tid % kK: the left factor's at rows
// m = tid / kK + 16 r, the right one's at columns n likewise (r < 4). `put` stores them.
struct Staged {
  float a[4], b[4];
};
DP_HD void put(int tid, const Staged& v, Smem& s) {
  const int kk = tid % kK;
  for (int r = 0; r < 4; ++r) s.a[kk][tid / kK + 16 * r] = v.a[r], s.b[kk][tid / kK + 16 * r] = v.b[r];
}

// Thread tid's 4 x 4 outputs: rows m0 + i, columns n0 + j.
struct Acc {
  float v[4][4];
};
DP_HD int acc_m0(int tid) { return (tid / (kN / 4)) * 4; }
DP_HD int acc_n0(int tid) { return (tid % (kN / 4)) * 4; }

// acc += a stage's a^T b: four of a and four of b read per 16 FMAs (loops of constant trips, which nvcc
// unrolls).
DP_HD void accumulate(const Smem& s, int tid, Acc& acc) {
  const int m0 = acc_m0(tid), n0 = acc_n0(tid);
  for (int kk = 0; kk < kK; ++kk) {
    float a[4], b[4];
#if defined(__CUDA_ARCH__)
    const float4 av = *reinterpret_cast<const float4*>(&s.a[kk][m0]);
    const float4 bv = *reinterpret_cast<const float4*>(&s.b[kk][n0]);
    a[0] = av.x, a[1] = av.y, a[2] = av.z, a[3] = av.w, b[0] = bv.x, b[1] = bv.y, b[2] = bv.z, b[3] = bv.w;
#else
    for (int i = 0; i < 4; ++i) a[i] = s.a[kk][m0 + i], b[i] = s.b[kk][n0 + i];
#endif
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) acc.v[i][j] = fmaf(a[i], b[j], acc.v[i][j]);
  }
}

// What the products gather: x at tap (offset, u, v) of the output pixel (base, top, left), zero
// outside the image (padding) and where either coordinate is kNowhere. x is (N, C, H, W), or with
// `rows` (C, N, H, W): dy's rows, as the fused op hands them to the data gradient.
struct Gather {
  ConvShape s;
  Divider pixels, ow, khw, kw;  // by OH OW, OW, KH KW, KW
  const float* x;
  int image = 0, channel = 0;  // x's strides

  static Gather of(const ConvShape& s, const float* x, bool rows = false) {
    const int plane = s.h * s.w;
    Gather g{s, Divider(s.out_h() * s.out_w()), Divider(s.out_w()), Divider(s.kh * s.kw), Divider(s.kw), x};
    g.image = rows ? plane : s.c * plane, g.channel = rows ? s.n * plane : plane;
    return g;
  }
  // Output pixel j = img OH OW + q: its image base in x and its window's top-left corner (kNowhere
  // past the rows).
  DP_HD void pixel(int j, int rows, int& base, int& top, int& left, int& img, int& q) const {
    if (j >= rows) {
      base = img = q = 0, top = left = kNowhere;
      return;
    }
    int qy = 0, qx = 0;
    pixels.divmod(j, img, q);
    ow.divmod(q, qy, qx);
    top = qy - s.pad, left = qx - s.pad, base = img * image + top * s.w + left;
  }
  // Tap t's offset in an image and (u, v); kNowhere past the taps.
  DP_HD void tap(int t, int& offset, int& u, int& v) const {
    if (t >= s.c * s.kh * s.kw) {
      offset = 0, u = v = kNowhere;
      return;
    }
    int ch = 0, rest = 0;
    khw.divmod(t, ch, rest);
    kw.divmod(rest, u, v);
    offset = ch * channel + u * s.w + v;
  }
  DP_HD float at(int base, int top, int left, int offset, int u, int v) const {
    const int yy = top + u, xx = left + v;
    return yy >= 0 && yy < s.h && xx >= 0 && xx < s.w ? x[base + offset] : 0.0f;
  }
};

// y (N, K, OH, OW) = x * w without the bias. Block (bx, by): pixels j = 64 bx ..., channels k = 64 by
// .... Rows m are channels, columns n pixels, the reduction the taps.
struct Forward {
  Gather g;
  const float* w;
  float* y;
  int j0 = 0, k0 = 0;

  DP_HD int rows() const { return g.s.n * g.pixels.divisor(); }
  DP_HD int taps() const { return g.s.c * g.s.kh * g.s.kw; }
  DP_HD void place(int bx, int by, int /*bz*/) { j0 = bx * kN, k0 = by * kM; }
  DP_HD int stages() const { return (taps() + kK - 1) / kK; }
  DP_HD void setup(int tid, Smem& s) const {
    int img = 0, q = 0;
    if (tid < kN) g.pixel(j0 + tid, rows(), s.base[tid], s.top[tid], s.left[tid], img, q);
  }
  // Thread tid fetches tap t = 16 stage + tid % 16: w's for four channels, x's for four pixels.
  DP_HD void fetch(int stage, int tid, const Smem& s, Staged& v) const {
    const int t = stage * kK + tid % kK, crs = taps();
    int offset = 0, u = 0, vv = 0;
    g.tap(t, offset, u, vv);
    for (int r = 0; r < 4; ++r) {
      const int e = tid / kK + 16 * r, k = k0 + e;
      v.a[r] = k < g.s.k && t < crs ? w[k * crs + t] : 0.0f;
      v.b[r] = g.at(s.base[e], s.top[e], s.left[e], offset, u, vv);
    }
  }
  DP_HD void store(int tid, const Acc& acc, int /*slice*/) const {
    const int p = g.pixels.divisor(), m0 = acc_m0(tid), n0 = acc_n0(tid);
    for (int j = 0; j < 4; ++j) {
      const int row = j0 + n0 + j;
      if (row >= rows()) break;
      int img = 0, q = 0;
      g.pixels.divmod(row, img, q);
      for (int i = 0; i < 4; ++i)
        if (k0 + m0 + i < g.s.k) y[(img * g.s.k + k0 + m0 + i) * p + q] = acc.v[i][j];
    }
  }
};

// dx (N, C, H, W) of a convolution s with KH = KW is the forward pass of another: over dy (its
// images N, its channels K, OH x OW), padded by KH - 1 - pad, with the weights flipped and transposed,
// wt (C, K, KH, KW)[c, k, u, v] = w[k, c, KH - 1 - u, KW - 1 - v] (flip_weights). Each element of dx
// is then one FMA chain over (k, u, v), the taps past dy's border multiplying zeros.
inline ConvShape data_grad_shape(const ConvShape& s) {
  return {
      .n = s.n, .c = s.k, .h = s.out_h(), .w = s.out_w(), .k = s.c, .kh = s.kh, .kw = s.kw, .pad = s.kh - 1 - s.pad};
}
DP_HD void flip_weight(int64_t e, const ConvShape& s, const float* w, float* wt) {  // e indexes wt
  const int64_t khw = int64_t(s.kh) * s.kw, tap = e % khw, kc = e / khw, k = kc % s.k, c = kc / s.k;
  const int64_t u = tap / s.kw, v = tap % s.kw;
  wt[e] = w[(k * s.c + c) * khw + (s.kh - 1 - u) * s.kw + (s.kw - 1 - v)];
}
struct DataGrad : Forward {};  // a kernel of its own name in a profile

// The filter gradient's partials (slices, K, C KH KW + 1): block (bx, by, bz) sums, over slice bz of
// the rows j, dy[k, j] X[j, t] for taps t = 64 bx ... (t = C KH KW: the bias, X's column of ones) and
// channels k = 64 by .... Rows m are channels, columns n taps, the reduction the pixels. dy is
// (N, K, OH, OW), or with `dy_rows` its rows (K, N P), as the fused op writes them.
struct FilterGrad {
  Gather g;
  const float* dy;
  bool dy_rows = false;
  int slices = 1;
  float* partial;
  int t0 = 0, k0 = 0, begin = 0, end = 0;

  DP_HD int rows() const { return g.s.n * g.pixels.divisor(); }
  DP_HD int columns() const { return g.s.c * g.s.kh * g.s.kw + 1; }
  DP_HD void place(int bx, int by, int bz) {
    t0 = bx * kN, k0 = by * kM;
    begin = int(int64_t(rows()) * bz / slices), end = int(int64_t(rows()) * (bz + 1) / slices);
  }
  DP_HD int stages() const { return (end - begin + kK - 1) / kK; }
  DP_HD void setup(int tid, Smem& s) const {
    if (tid >= kN) return;
    const int t = t0 + tid;
    g.tap(t, s.base[tid], s.top[tid], s.left[tid]);  // offset, u, v
    s.one[tid] = t == columns() - 1 ? 1.0f : 0.0f;
  }
  // Thread tid fetches row j = begin + 16 stage + tid % 16: dy's for four channels, X's for four taps.
  DP_HD void fetch(int stage, int tid, const Smem& s, Staged& v) const {
    const int j = begin + stage * kK + tid % kK, p = g.pixels.divisor();
    int base = 0, top = kNowhere, left = kNowhere, img = 0, q = 0;
    if (j < end) g.pixel(j, rows(), base, top, left, img, q);
    for (int r = 0; r < 4; ++r) {
      const int e = tid / kK + 16 * r, k = k0 + e;
      v.a[r] = j < end && k < g.s.k ? dy[dy_rows ? k * rows() + j : (img * g.s.k + k) * p + q] : 0.0f;
      const float tap = g.at(base, top, left, s.base[e], s.top[e], s.left[e]);
      v.b[r] = j < end ? (s.one[e] != 0.0f ? 1.0f : tap) : 0.0f;
    }
  }
  DP_HD void store(int tid, const Acc& acc, int slice) const {
    const int m0 = acc_m0(tid), n0 = acc_n0(tid), cols = columns();
    for (int i = 0; i < 4; ++i) {
      const int k = k0 + m0 + i;
      if (k >= g.s.k) break;
      for (int j = 0; j < 4; ++j)
        if (t0 + n0 + j < cols) partial[(int64_t(slice) * g.s.k + k) * cols + t0 + n0 + j] = acc.v[i][j];
    }
  }
};

// dw (K, C KH KW) and db (K) from the partials: element e = k (C KH KW + 1) + t adds its slices in order.
DP_HD void filter_total(int64_t e, int channels, int cols, int slices, const float* partial, float* dw, float* db) {
  const int64_t per_slice = int64_t(channels) * cols;
  float v = 0.0f;
  for (int slice = 0; slice < slices; ++slice) v += partial[slice * per_slice + e];
  const int ch = int(e / cols), t = int(e % cols);
  if (t == cols - 1)
    db[ch] = v;
  else
    dw[int64_t(ch) * (cols - 1) + t] = v;
}

}  // namespace dp::cuda::tile
