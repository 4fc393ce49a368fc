// Convolutions with few taps per output (C KH KW at most CudaOps::kDirectTaps: the first layer of
// LeNet, 1 x 3 x 3, and of LeNet-5, 1 x 5 x 5), computed directly. The general path (cuDNN's implicit
// GEMM forward, im2col and a cuBLAS GEMM for dw, conv2d.cu) spends on such a shape most of its time
// on a 9-deep sum: on an H200, LeNet's conv1 at batch 256 took 22 us forward and 84 us for dw and db
// (im2col, a split-K GEMM and its reduction, the bias' two kernels), for 31 million multiply-adds
// each way. The data gradient of these shapes stays on conv2d.cu's path (a first layer needs none).
//
// Both kernels load an output pixel's taps of x once, into registers, and use them for several
// output channels: the forward pass for all of them (the weights in shared memory), the weight
// gradient for kGroup of them, a thread keeping its pixel from image to image. (One thread per output
// and tap loop, re-reading x for each channel, was bound by its instructions: 36 us forward, 35 for dw.)
//
// Sums: each output of the forward pass is one FMA chain over its taps in (c, u, v) order, from 0
// (the bias is added after, as on cuDNN's path); dw and db are fixed trees (per thread in row order,
// then the warp's shuffles, the block's warps in order, the slices by a warp's shuffles): the same
// bits every run, within the tests' bounds for any tree (tests/test_ops_conv.cpp).
#include <algorithm>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/divider.h"
#include "kernels/cuda/launch.h"

namespace dp {
namespace {

constexpr int kTaps = CudaOps::kDirectTaps;
constexpr int kWarps = cuda::kThreads / 32;

// Tap t = (c KH + u) KW + v of the filter: its offset in an image, (c H + u) W + v, and u, v. The
// slots past C KH KW hold a row u far above any image, so that they are never inside one.
struct Taps {
  int offset[kTaps], u[kTaps], v[kTaps];
};
constexpr int kNowhere = -(1 << 24);
__device__ void fill_taps(const ConvShape& s, Taps& taps) {
  const int khw = s.kh * s.kw;
  for (int t = int(threadIdx.x); t < kTaps; t += int(blockDim.x)) {
    const int ch = t / khw, u = (t - ch * khw) / s.kw, v = t - ch * khw - u * s.kw;
    const bool tap = t < s.c * khw;
    taps.offset[t] = tap ? (ch * s.h + u) * s.w + v : 0, taps.u[t] = tap ? u : kNowhere, taps.v[t] = tap ? v : 0;
  }
}

// xv[t] = x at tap t of output pixel j = n P + q (zero outside the image, and past the taps).
template <int kMax>
__device__ void load_taps(const ConvShape& s, const Taps& taps, cuda::Divider pixels, cuda::Divider ow, int j,
                          const float* x, float (&xv)[kMax], int& img, int& q) {
  int qy = 0, qx = 0;
  pixels.divmod(j, img, q);
  ow.divmod(q, qy, qx);
  const int top = qy - s.pad, left = qx - s.pad, base = img * s.c * s.h * s.w + top * s.w + left;
#pragma unroll
  for (int t = 0; t < kMax; ++t) {
    const int yy = top + taps.u[t], xx = left + taps.v[t];
    xv[t] = yy >= 0 && yy < s.h && xx >= 0 && xx < s.w ? x[base + taps.offset[t]] : 0.0f;
  }
}

// y (N, K, OH, OW) = x * w without the bias. Thread j: output pixel j = n P + q, every channel.
template <int kMax>
__global__ void __launch_bounds__(cuda::kThreads)
    direct_forward_kernel(int rows, ConvShape s, cuda::Divider pixels, cuda::Divider ow, const float* x, const float* w,
                          float* y) {
  extern __shared__ float weights[];  // (K, C KH KW)
  __shared__ Taps taps;
  fill_taps(s, taps);
  const int crs = s.c * s.kh * s.kw;
  for (int e = int(threadIdx.x); e < s.k * crs; e += int(blockDim.x)) weights[e] = w[e];
  __syncthreads();
  const int j = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  if (j >= rows) return;
  float xv[kMax];
  int img = 0, q = 0;
  load_taps<kMax>(s, taps, pixels, ow, j, x, xv, img, q);
  const int p = pixels.divisor();
  float* out = y + img * s.k * p + q;
  for (int ch = 0; ch < s.k; ++ch) {
    const float* wk = weights + ch * crs;
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < kMax; ++t)
      if (t < crs) acc = fmaf(wk[t], xv[t], acc);
    out[ch * p] = acc;
  }
}

// partial (K, slices, kTaps + 1): grid (K / kGroup rounded up, slices). Block (group, slice) sums, over
// the rows j = n P + q its threads take, dy[n, ch, q] x[n, c, qy + u - pad, qx + v - pad] for every tap
// (slot t) and dy alone (slot kTaps, the bias), for the group's channels ch. With kRows dy is given as
// its rows, dyt (K, N P) (the fused op's layout, conv_act_pool.cu): the same values, the same bits.
// kMax (C KH KW or more) bounds the unrolled loops, whose sums stay in registers.
// A thread keeps an output pixel and walks the images: of the P R columns (pixel q, residue r), R =
// `residues`, thread g of the group's T = slices x blockDim takes columns c = g, g + T, ... (q = c % P,
// r = c / P), and of each column the images n = r, r + R, ... in order. Which taps lie inside the image
// is worked out once a column, so an image costs a load a tap and kGroup of dy, no division. (A
// thread a row at a time, dividing twice a row and testing every tap's bounds, ran about 340
// instructions a row for lenet's conv1: 42.5 us on an H200 for 35 million multiply-adds.)
template <int kMax, int kGroup, bool kRows>
__global__ void __launch_bounds__(cuda::kThreads)
    direct_filter_grad_kernel(ConvShape s, cuda::Divider pixels, cuda::Divider ow, int residues, const float* x,
                              const float* dy, float* partial) {
  __shared__ Taps taps;
  __shared__ float warp_sums[kWarps][kGroup][kTaps + 1];
  fill_taps(s, taps);
  __syncthreads();
  const int ch0 = int(blockIdx.x) * kGroup, slice = int(blockIdx.y), slices = int(gridDim.y);
  const int threads = slices * int(blockDim.x);
  const int p = pixels.divisor(), rows = s.n * p, crs = s.c * s.kh * s.kw, image = s.c * s.h * s.w;
  float acc[kGroup][kMax + 1];  // the taps', then the bias'
#pragma unroll
  for (int g = 0; g < kGroup; ++g)
#pragma unroll
    for (int t = 0; t <= kMax; ++t) acc[g][t] = 0.0f;
  for (int c = slice * int(blockDim.x) + int(threadIdx.x); c < p * residues; c += threads) {
    int r = 0, q = 0, qy = 0, qx = 0;
    pixels.divmod(c, r, q);
    ow.divmod(q, qy, qx);
    const int top = qy - s.pad, left = qx - s.pad;
    uint32_t inside = 0u;  // bit t: tap t lies inside the image
#pragma unroll
    for (int t = 0; t < kMax; ++t) {
      const int yy = top + taps.u[t], xx = left + taps.v[t];
      inside |= uint32_t(yy >= 0 && yy < s.h && xx >= 0 && xx < s.w) << t;
    }
    for (int n = r; n < s.n; n += residues) {
      const int corner = n * image + top * s.w + left;  // tap t at corner + its offset, where inside
      float xv[kMax];
#pragma unroll
      for (int t = 0; t < kMax; ++t) xv[t] = inside >> t & 1u ? x[corner + taps.offset[t]] : 0.0f;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const int ch = ch0 + g;
        if (ch >= s.k) break;
        const float d = kRows ? dy[ch * rows + n * p + q] : dy[(n * s.k + ch) * p + q];
#pragma unroll
        for (int t = 0; t < kMax; ++t) acc[g][t] = fmaf(d, xv[t], acc[g][t]);
        acc[g][kMax] += d;
      }
    }
  }
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
#pragma unroll
  for (int g = 0; g < kGroup; ++g)
#pragma unroll
    for (int t = 0; t <= kMax; ++t) {
      if (t >= crs && t != kMax) continue;
      float v = acc[g][t];
      for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
      if (lane == 0) warp_sums[warp][g][t < crs ? t : kTaps] = v;
    }
  __syncthreads();
  for (int e = int(threadIdx.x); e < kGroup * (kTaps + 1); e += int(blockDim.x)) {
    const int g = e / (kTaps + 1), t = e % (kTaps + 1);
    if (ch0 + g >= s.k || (t >= crs && t != kTaps)) continue;
    float total = 0.0f;
    for (int wi = 0; wi < kWarps; ++wi) total += warp_sums[wi][g][t];
    partial[(int64_t(ch0 + g) * slices + slice) * (kTaps + 1) + t] = total;
  }
}

// dw (K, C KH KW) and db (K): one warp per (channel, slot), its lanes taking every 32nd slice in
// order, then the warp's shuffles.
__global__ void direct_filter_total_kernel(int k, int crs, int slices, const float* partial, float* dw, float* db) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t e = int64_t(blockIdx.x) * kWarps + int(threadIdx.x) / 32;
  if (e >= int64_t(k) * (crs + 1)) return;  // the whole warp
  const int ch = int(e / (crs + 1)), t = int(e % (crs + 1)), slot = t == crs ? kTaps : t;
  float v = 0.0f;
  for (int slice = lane; slice < slices; slice += 32) v += partial[(int64_t(ch) * slices + slice) * (kTaps + 1) + slot];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (lane != 0) return;
  if (t == crs)
    db[ch] = v;
  else
    dw[int64_t(ch) * crs + t] = v;
}

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

}  // namespace

bool CudaOps::direct(const ConvShape& s) {
  return s.col_rows() <= kDirectTaps && int64_t(s.k) * s.col_rows() <= kDirectWeights &&
         int64_t(s.n) * s.k * s.out_h() * s.out_w() < INT32_MAX && int64_t(s.n) * s.c * s.h * s.w < INT32_MAX;
}

size_t CudaOps::direct_partial_floats(const ConvShape& s) { return size_t(s.k) * kDirectSlices * (kDirectTaps + 1); }

void CudaOps::direct_forward(const ConvShape& s, const float* x, const float* w, float* y) {
  const int pixels = s.out_h() * s.out_w(), rows = s.n * pixels, crs = int(s.col_rows());
  const unsigned blocks = unsigned((int64_t(rows) + cuda::kThreads - 1) / cuda::kThreads);
  const size_t weight_bytes = sizeof(float) * size_t(s.k) * size_t(crs);
  const cuda::Divider by_pixels(pixels), by_ow(s.out_w());
  with_tap_bound(crs, [&]<int kMax>() {
    direct_forward_kernel<kMax><<<blocks, cuda::kThreads, weight_bytes, stream_>>>(rows, s, by_pixels, by_ow, x, w, y);
  });
  DP_CUDA_LAUNCH_CHECK("direct_forward_kernel");
}

void CudaOps::direct_filter_grad(const ConvShape& s, const float* x, const float* dy, bool rows, float* dw, float* db,
                                 float* workspace) {
  const int p = s.out_h() * s.out_w(), crs = int(s.col_rows());
  const cuda::Divider pixels(p), ow(s.out_w());
  // residues: as many as the group's threads hold a column each of (every image its own, at most)
  const int residues = std::clamp(kDirectSlices * cuda::kThreads / p, 1, s.n);
  with_tap_bound(crs, [&]<int kMax>() {
    constexpr int kGroup = kMax <= 9 ? 4 : kMax <= 16 ? 2 : 1;  // within the registers kMax leaves
    const dim3 grid(unsigned((s.k + kGroup - 1) / kGroup), kDirectSlices);
    if (rows)
      direct_filter_grad_kernel<kMax, kGroup, true>
          <<<grid, cuda::kThreads, 0, stream_>>>(s, pixels, ow, residues, x, dy, workspace);
    else
      direct_filter_grad_kernel<kMax, kGroup, false>
          <<<grid, cuda::kThreads, 0, stream_>>>(s, pixels, ow, residues, x, dy, workspace);
  });
  DP_CUDA_LAUNCH_CHECK("direct_filter_grad_kernel");
  const int64_t sums = int64_t(s.k) * (crs + 1);
  direct_filter_total_kernel<<<unsigned((sums + kWarps - 1) / kWarps), cuda::kThreads, 0, stream_>>>(
      s.k, crs, kDirectSlices, workspace, dw, db);
  DP_CUDA_LAUNCH_CHECK("direct_filter_total_kernel");
}

}  // namespace dp
