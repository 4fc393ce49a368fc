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
// threads hold a column each of, every image its own at most (n >= 1).
inline int residues(const ConvShape& s) { return std::clamp(kGroupThreads / (s.out_h() * s.out_w()), 1, s.n); }

// Thread g of a group's `threads` adds, into acc[c - ch0][t], dy[n, c, q] x[n, ., qy + u - pad, qx + v
// - pad] for every tap t of C KH KW (and into acc[.][kMax] dy alone, the bias), for the channels c of
// ch0 .. ch0 + kGroup - 1 below K, over the rows j = n P + q it takes: the columns c = g, g + threads,
// ... of the P R (pixel q = c % P, residue r = c / P), and of each the images n = r, r + R, ... in
// order. Which taps lie inside the image is worked out once a column; an image then costs a load a tap
// and one of dy a channel, no division. dy is (N, K, P), or with kRows its rows (K, N P). kMax (C KH
// KW or more) bounds the unrolled loops, whose sums stay in registers.
template <int kMax, int kGroup, bool kRows>
DP_HD void accumulate(const ConvShape& s, const Taps& taps, Divider pixels, Divider ow, int residues, int ch0, int g,
                      int threads, const float* x, const float* dy, float (&acc)[kGroup][kMax + 1]) {
  const int p = pixels.divisor(), rows = s.n * p, image = s.c * s.h * s.w;
  for (int c = g; c < p * residues; c += threads) {
    int r = 0, q = 0, qy = 0, qx = 0;
    pixels.divmod(c, r, q);
    ow.divmod(q, qy, qx);
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
        const float d = kRows ? dy[ch * rows + n * p + q] : dy[(n * s.k + ch) * p + q];
        DP_UNROLL
        for (int t = 0; t < kMax; ++t) acc[k][t] = fmaf(d, xv[t], acc[k][t]);
        acc[k][kMax] += d;
      }
    }
  }
}

}  // namespace dp::cuda::direct
