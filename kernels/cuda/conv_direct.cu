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
// For the fused op (conv_act_pool.cu) a shape of at most 16 taps whose output 2 x 2 windows tile
// (LeNet's conv1) runs its whole forward pass in one kernel, a thread per window; and a first layer's
// weight gradient works dy out of the pooled gradient itself, so dy's rows are never written.
//
// Sums: each output of the forward pass is one FMA chain over its taps in (c, u, v) order, from 0
// (the bias is added after, as on cuDNN's path); dw and db are fixed trees (per thread in row order,
// then the warp's shuffles, the block's warps in order, the slices by a warp's shuffles): the same
// bits every run, within the tests' bounds for any tree (tests/test_ops_conv.cpp).
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/direct_taps.h"
#include "kernels/cuda/divider.h"
#include "kernels/cuda/launch.h"

namespace dp {
namespace {

using cuda::direct::kTaps;
using cuda::direct::Taps;
static_assert(kTaps == CudaOps::kDirectTaps && cuda::direct::kSlices == CudaOps::kDirectSlices &&
              cuda::direct::kBlock == cuda::kThreads);
constexpr int kWarps = cuda::kThreads / 32;

__device__ void fill_taps(const ConvShape& s, Taps& taps) {
  cuda::direct::fill_taps(s, taps, int(threadIdx.x), int(blockDim.x));
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
  cuda::await_previous();
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

// The fused op's forward pass (cuda::direct::forward_window): thread j takes pooling window j of every
// channel, the weights and the bias in shared memory. A thread has four pixels' work, so there are a
// quarter as many as pixels (43,264 for lenet's conv1 at batch 256): blocks of 128 spread them over
// more SMs than blocks of 256 would.
constexpr int kWindowThreads = 128;
template <int kMax, Activation A>
__global__ void __launch_bounds__(kWindowThreads)
    direct_act_pool_forward_kernel(int windows, ConvShape s, cuda::Divider cells, cuda::Divider pw, const float* x,
                                   const float* w, const float* b, float* y_act, float* y_pool) {
  cuda::await_previous();
  extern __shared__ float weights[];  // (K, C KH KW), then the bias (K)
  __shared__ Taps taps;
  fill_taps(s, taps);
  const int crs = s.c * s.kh * s.kw;
  for (int e = int(threadIdx.x); e < s.k * crs; e += int(blockDim.x)) weights[e] = w[e];
  for (int e = int(threadIdx.x); e < s.k; e += int(blockDim.x)) weights[s.k * crs + e] = b[e];
  __syncthreads();
  const int j = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  if (j >= windows) return;
  cuda::direct::forward_window<kMax, A>(s, taps, cells, pw, j, x, weights, weights + s.k * crs, y_act, y_pool);
}

// partial (K, slices, kTaps + 1): grid (K / kGroup rounded up, slices). Block (group, slice) sums, over
// the rows its threads take (cuda::direct::accumulate: a thread keeps an output pixel over the images), dy[n,
// ch, q] x[n, c, qy + u - pad, qx + v - pad] for every tap (slot t) and dy alone (slot kTaps, the
// bias), for the group's channels ch. Dy says where dy comes from (direct_taps.h): dy, its rows (the
// fused op's layout, conv_act_pool.cu) or the fused op's pooled gradient: the same values, the same
// bits. (A thread a row at a time, dividing twice a row and testing every tap's bounds, ran about 340
// instructions a row for lenet's conv1: 42.5 us on an H200 for 35 million multiply-adds.)
template <int kMax, int kGroup, class Dy>
__global__ void __launch_bounds__(cuda::kThreads)
    direct_filter_grad_kernel(ConvShape s, cuda::Divider pixels, cuda::Divider ow, int residues, const float* x, Dy dy,
                              float* partial) {
  cuda::await_previous();
  __shared__ Taps taps;
  __shared__ float warp_sums[kWarps][kGroup][kTaps + 1];
  fill_taps(s, taps);
  __syncthreads();
  const int ch0 = int(blockIdx.x) * kGroup, slice = int(blockIdx.y), slices = int(gridDim.y);
  const int crs = s.c * s.kh * s.kw;
  float acc[kGroup][kMax + 1];  // the taps', then the bias'
#pragma unroll
  for (int g = 0; g < kGroup; ++g)
#pragma unroll
    for (int t = 0; t <= kMax; ++t) acc[g][t] = 0.0f;
  cuda::direct::accumulate<kMax, kGroup>(s, taps, pixels, ow, residues, ch0, slice * int(blockDim.x) + int(threadIdx.x),
                                         slices * int(blockDim.x), x, dy, acc);
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
  cuda::await_previous();
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

using cuda::direct::with_tap_bound;

// dw and db through the partials in `workspace` (direct_partial_floats), dy from `dy`.
template <class Dy>
void filter_grad(cudaStream_t stream, const ConvShape& s, const float* x, const Dy& dy, float* dw, float* db,
                 float* workspace) {
  const int crs = int(s.col_rows());
  const cuda::Divider pixels(s.out_h() * s.out_w()), ow(s.out_w());
  const int residues = cuda::direct::residues(s);
  with_tap_bound(crs, [&]<int kMax>() {
    constexpr int kGroup = cuda::direct::kGroupOf<kMax>;
    const dim3 grid(unsigned((s.k + kGroup - 1) / kGroup), CudaOps::kDirectSlices);
    cuda::launch("direct_filter_grad_kernel", direct_filter_grad_kernel<kMax, kGroup, Dy>, grid, cuda::kThreads, 0,
                 stream, s, pixels, ow, residues, x, dy, workspace);
  });
  const int64_t sums = int64_t(s.k) * (crs + 1);
  cuda::launch("direct_filter_total_kernel", direct_filter_total_kernel, unsigned((sums + kWarps - 1) / kWarps),
               cuda::kThreads, 0, stream, s.k, crs, CudaOps::kDirectSlices, workspace, dw, db);
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
    cuda::launch("direct_forward_kernel", direct_forward_kernel<kMax>, blocks, cuda::kThreads, weight_bytes, stream_,
                 rows, s, by_pixels, by_ow, x, w, y);
  });
}

bool CudaOps::direct_act_pool(const ConvShape& s, int window) {
  return window == cuda::direct::kWindow && s.col_rows() <= cuda::direct::kWindowTaps && s.out_h() % window == 0 &&
         s.out_w() % window == 0;
}

void CudaOps::direct_act_pool_forward(const ConvShape& s, Activation a, const float* x, const float* w, const float* b,
                                      float* y_act, float* y_pool) {
  const int pw = s.out_w() / cuda::direct::kWindow, cells = s.out_h() / cuda::direct::kWindow * pw;
  const int windows = s.n * cells, crs = int(s.col_rows());
  const unsigned blocks = unsigned((windows + kWindowThreads - 1) / kWindowThreads);
  const size_t shared = sizeof(float) * size_t(s.k) * size_t(crs + 1);  // the weights, then the biases
  static_assert(2 * CudaOps::kDirectWeights * sizeof(float) <= 48 * 1024, "within what a kernel may take unasked");
  const cuda::Divider by_cells(cells), by_pw(pw);
  math::with_activation(a, [&]<Activation A>() {
    auto run = [&]<int kMax>() {
      cuda::launch("direct_act_pool_forward_kernel", direct_act_pool_forward_kernel<kMax, A>, blocks, kWindowThreads,
                   shared, stream_, windows, s, by_cells, by_pw, x, w, b, y_act, y_pool);
    };
    if (crs <= 9)  // 1 x 3 x 3, lenet's conv1
      run.template operator()<9>();
    else
      run.template operator()<cuda::direct::kWindowTaps>();
  });
}

void CudaOps::direct_filter_grad(const ConvShape& s, const float* x, const float* dy, bool rows, float* dw, float* db,
                                 float* workspace) {
  const int p = s.out_h() * s.out_w();
  if (rows)
    filter_grad(stream_, s, x, cuda::direct::DyRows{dy, s.n * p, p}, dw, db, workspace);
  else
    filter_grad(stream_, s, x, cuda::direct::DyPlanes{dy, s.k, p}, dw, db, workspace);
}

void CudaOps::direct_act_pool_filter_grad(const ConvShape& s, Activation a, int window, const float* x,
                                          const float* y_act, const float* dy_pool, float* dw, float* db,
                                          float* workspace) {
  const int oh = s.out_h(), ow = s.out_w();
  const float inv = 1.0f / float(window * window);  // as conv_act_pool.cu's backward
  math::with_activation(a, [&]<Activation A>() {
    const cuda::direct::DyActPool<A> dy{y_act, dy_pool, s.k, oh * ow, window, oh / window, ow / window, inv};
    filter_grad(stream_, s, x, dy, dw, db, workspace);
  });
}

}  // namespace dp
