// Convolution (NCHW float, cross-correlation as PyTorch's Conv2d, stride 1, symmetric padding): the
// forward pass on cuDNN; the backward pass dp's own, im2col and cuBLAS GEMMs (conv_backward says
// why); the bias and its gradient small kernels here (conv_act_pool.cu folds the bias, the activation
// and the pooling into one kernel each way for the fused op). Shapes of few taps (C KH KW, LeNet's
// first layer) run forward and their dw and db on conv_direct.cu's kernels instead, and under
// DP_CUDA_CONV=implicit the others on conv_implicit.cu's implicit GEMMs; which, for a shape, is its
// plan's choice (conv_plan.cpp). Twin of kernels/cpu/conv2d.cpp.
#include <algorithm>

#include "kernels/cuda/bias_grad.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/divider.h"
#include "kernels/cuda/launch.h"

namespace dp {
namespace {

// The backward pass's kernels index in 32 bits (make_plan keeps a chunk's arrays under 2^31 elements):
// 64-bit division is several times slower, and these kernels are mostly index arithmetic.

// dyt(K, R)[k, r] = dy(nb, K, P)[r / P, k, r % P], R = nb P: the images' gradient rows side by side.
__global__ void dy_rows_kernel(int64_t total, int k, int p, int r, const float* dy, float* dyt) {
  cuda::await_previous();
  DP_GRID_STRIDE(i64, total) {
    const int i = int(i64), ch = i / r, row = i - ch * r, img = row / p;
    dyt[i] = dy[(img * k + ch) * p + (row - img * p)];
  }
}

// col(R, C KH KW)[n P + q, (c KH + u) KW + v] = x(nb, C, H, W)[n, c, qy + u - pad, qx + v - pad], zero
// outside the image, (qy, qx) the output pixel q: im2col with one row per output pixel. A block fills
// kColRows rows and kColTaps taps of them: the rows' images and pixels worked out once, in shared
// memory, and each thread's taps (c, u, v) once, so the inner loop divides nothing (six divisions an
// element made it the step's slowest kernel on an H200: 72 us, then 46). Neighbouring threads write
// neighbouring floats of a row. Each thread loads its kColRows / 8 values of a tap before it stores
// them, so their loads wait for memory together, not one after another (a block of 32 rows and every
// tap, each thread's loads one by one, took 30 us for lenet's second convolution: 512 blocks, half the
// H200's threads, each waiting on 64 loads in turn; so, 19.1 us). KH, KW: the kernel's size where the
// launch knows it (the taps' division then a multiply), 0 for the shape's at run time.
constexpr int kColRows = 32, kColTaps = 64;
const dim3 kColThreads(32, 8);  // (taps, rows)
template <int KH, int KW>
__global__ void im2col_rows_kernel(int rows, ConvShape s, const float* x, float* col) {
  cuda::await_previous();
  constexpr int kRowsEach = kColRows / 8, kTapsEach = kColTaps / 32;
  __shared__ int image_at[kColRows], top[kColRows], left[kColRows];
  const int kh = KH ? KH : s.kh, kw = KW ? KW : s.kw;
  const int ow = s.w + 2 * s.pad - kw + 1, pixels = (s.h + 2 * s.pad - kh + 1) * ow;  // out_h, out_w: host code
  const int khw = kh * kw, crs = s.c * khw, row0 = int(blockIdx.x) * kColRows;
  const int t = int(threadIdx.y * blockDim.x + threadIdx.x);
  if (t < kColRows && row0 + t < rows) {
    const int row = row0 + t, img = row / pixels, q = row - img * pixels, qy = q / ow;
    image_at[t] = img * s.c * s.h * s.w, top[t] = qy - s.pad, left[t] = q - qy * ow - s.pad;
  }
  __syncthreads();
  const int last = rows - row0 < kColRows ? rows - row0 : kColRows;
#pragma unroll
  for (int a = 0; a < kTapsEach; ++a) {
    const int j = int(blockIdx.y) * kColTaps + a * 32 + int(threadIdx.x);
    if (j >= crs) break;
    const int ch = j / khw, tap = j - ch * khw, u = tap / kw, v = tap - u * kw;
    float value[kRowsEach];
#pragma unroll
    for (int b = 0; b < kRowsEach; ++b) {
      const int r = int(threadIdx.y) + 8 * b;
      value[b] = 0.0f;
      if (r >= last) continue;
      const int y = top[r] + u, xx = left[r] + v;
      if (y >= 0 && y < s.h && xx >= 0 && xx < s.w) value[b] = x[image_at[r] + (ch * s.h + y) * s.w + xx];
    }
#pragma unroll
    for (int b = 0; b < kRowsEach; ++b) {
      const int r = int(threadIdx.y) + 8 * b;
      if (r < last) col[(row0 + r) * crs + j] = value[b];
    }
  }
}

// dx(nb, C, H, W)[n, c, y, x] = the sum, over the taps (u, v) in order whose output pixel (y + pad - u,
// x + pad - v) exists, of cols(C KH KW, R)[(c KH + u) KW + v, n P + that pixel]: col2im as a gather,
// every input pixel one thread, a fixed order, no atomics. Its coordinates come from Dividers. Where
// the launch knows the kernel's size (KH, KW; 0: the shape's at run time) the taps' loop unrolls, and
// a thread's loads wait for memory together (one after another, lenet's took 33.5 us on an H200; so,
// 23.2).
template <int KH, int KW>
__global__ void col2im_rows_kernel(int total, ConvShape s, int r, cuda::Divider width, cuda::Divider height,
                                   cuda::Divider channels, const float* cols, float* dx) {
  cuda::await_previous();
  const int kh = KH ? KH : s.kh, kw = KW ? KW : s.kw;
  const int oh = s.h + 2 * s.pad - kh + 1, ow = s.w + 2 * s.pad - kw + 1;
  DP_GRID_STRIDE(i64, total) {
    int rest = 0, xx = 0, y = 0, img = 0, ch = 0;
    width.divmod(int(i64), rest, xx);
    height.divmod(rest, rest, y);
    channels.divmod(rest, img, ch);
    const float* taps = cols + int64_t(ch * kh * kw) * r + img * oh * ow;  // tap (c, 0, 0), image n
    float sum = 0.0f;
#pragma unroll
    for (int u = 0; u < kh; ++u) {
      const int qy = y + s.pad - u;
#pragma unroll
      for (int v = 0; v < kw; ++v) {
        const int qx = xx + s.pad - v;
        if (qy >= 0 && qy < oh && qx >= 0 && qx < ow) sum += taps[int64_t(u * kw + v) * r + qy * ow + qx];
      }
    }
    dx[i64] = sum;
  }
}

// f.template operator()<KH, KW>() with the kernel's size fixed where it is lenet's (5 x 5) or 3 x 3,
// else <0, 0>: the shape's at run time (as conv_direct.cu's with_tap_bound).
template <class F>
void with_kernel_size(const ConvShape& s, F&& f) {
  if (s.kh == 5 && s.kw == 5)
    f.template operator()<5, 5>();
  else if (s.kh == 3 && s.kw == 3)
    f.template operator()<3, 3>();
  else
    f.template operator()<0, 0>();
}

// im2col of x (r rows of output pixels) into col (R, C KH KW).
void im2col(cudaStream_t stream, const ConvShape& s, int r, const float* x, float* col) {
  const dim3 grid(unsigned((r + kColRows - 1) / kColRows), unsigned((s.col_rows() + kColTaps - 1) / kColTaps));
  with_kernel_size(s, [&]<int KH, int KW>() {
    cuda::launch("im2col_rows_kernel", im2col_rows_kernel<KH, KW>, grid, kColThreads, 0, stream, r, s, x, col);
  });
}

// col2im of cols (C KH KW, R), R = nb P, into dx (nb, C, H, W).
void col2im(cudaStream_t stream, const ConvShape& s, int r, int nb, const float* cols, float* dx) {
  const int total = nb * s.c * s.h * s.w;
  const cuda::Divider width(s.w), height(s.h), channels(s.c);
  with_kernel_size(s, [&]<int KH, int KW>() {
    cuda::launch("col2im_rows_kernel", col2im_rows_kernel<KH, KW>, cuda::blocks_for(total), cuda::kThreads, 0, stream,
                 total, s, r, width, height, channels, cols, dx);
  });
}

// y(N, K, P) += b(K)
__global__ void bias_add_kernel(int64_t total, int k, int64_t p, const float* b, float* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, total) { y[i] += b[(i / p) % k]; }
}

// db (K) from dy (N, K, P), or with kRows its rows dyt (K, N P), through (K, kBiasSlices) partials
// (kernels/cuda/bias_grad.h): channel ch's j-th value, j = n P + p, is dy[n, ch, p] or dyt[ch, j], the
// same values in the same order, so the same bits.
template <bool kRows>
__global__ void bias_grad_partial_kernel(int n, int k, int64_t p, const float* dy, float* partial) {
  cuda::await_previous();
  const int64_t per_channel = int64_t(n) * p;
  const cuda::bias::Slice sl = cuda::bias::slice_of(per_channel);
  float acc = 0.0f;
  for (int64_t j = sl.begin + threadIdx.x; j < sl.end; j += blockDim.x)  // neighbours read neighbours
    acc += kRows ? dy[sl.ch * per_channel + j] : dy[(j / p * k + sl.ch) * p + j % p];
  cuda::bias::write_partial(acc, partial);
}

__global__ void bias_grad_total_kernel(int k, const float* partial, float* db) {
  cuda::await_previous();
  DP_GRID_STRIDE(ch, k) { db[ch] = cuda::bias::total(partial, int(ch)); }
}

// db (K) from dy, or with `rows` dy's rows, through (K, kBiasSlices) partials in `partial`.
void bias_grad(cudaStream_t stream, const ConvShape& s, bool rows, const float* dy, float* partial, float* db) {
  const int64_t pixels = int64_t(s.out_h()) * s.out_w();
  const unsigned blocks = unsigned(s.k) * cuda::bias::kSlices;
  if (rows)
    cuda::launch("bias_grad_partial_kernel", bias_grad_partial_kernel<true>, blocks, cuda::kThreads, 0, stream, s.n,
                 s.k, pixels, dy, partial);
  else
    cuda::launch("bias_grad_partial_kernel", bias_grad_partial_kernel<false>, blocks, cuda::kThreads, 0, stream, s.n,
                 s.k, pixels, dy, partial);
  cuda::launch("bias_grad_total_kernel", bias_grad_total_kernel, cuda::blocks_for(s.k), cuda::kThreads, 0, stream, s.k,
               partial, db);
}

}  // namespace

void CudaOps::convolve(const ConvShape& s, const float* x, const float* w, float* y, float* workspace) {
  ConvPlan& p = plan(s);
  if (p.direct) return direct_forward(s, x, w, y);
  if (p.implicit) return implicit_forward(s, x, w, y);
  const float one = 1.0f, zero = 0.0f;
  DP_CUDNN_CHECK(cudnnConvolutionForward(cudnn_, &one, p.x.get(), x, p.w.get(), w, p.conv.get(), p.fwd, workspace,
                                         p.fwd_bytes, &zero, p.y.get(), y));
}

void CudaOps::conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                             float* workspace) {
  if (s.n == 0) return;
  convolve(s, x, w, y, workspace);
  const int64_t pixels = int64_t(s.out_h()) * s.out_w();
  const int64_t total = int64_t(s.n) * s.k * pixels;  // y (N, K, OH, OW)
  cuda::launch("bias_add_kernel", bias_add_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_, total, s.k,
               pixels, b, y);
}

void CudaOps::conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                              float* db, float* workspace) {
  conv_backward(s, x, w, dy, /*rows*/ false, dx, dw, db, workspace);
}

void CudaOps::conv_backward(const ConvShape& s, const float* x, const float* w, const float* dy, bool rows, float* dx,
                            float* dw, float* db, float* workspace) {
  const size_t dw_bytes = sizeof(float) * size_t(s.k) * size_t(s.col_rows());  // dw (K, C, KH, KW)
  if (s.n == 0) {  // no samples: zero gradients, nothing for cuDNN (it rejects N = 0)
    DP_CUDA_CHECK(cudaMemsetAsync(dw, 0, dw_bytes, stream_));
    DP_CUDA_CHECK(cudaMemsetAsync(db, 0, sizeof(float) * size_t(s.k), stream_));
    return;
  }
  const ConvPlan& p = plan(s);
  const int64_t pixels = int64_t(s.out_h()) * s.out_w();
  // The workspace: db's (and with a direct or implicit plan dw's) partials, then a chunk's dyt and col,
  // and with two lanes its cols too (conv_plan.cpp's plan_backward sizes it).
  float* const chunk_space = workspace + p.bias_floats;
  if (p.direct || p.implicit) {  // dw and db at once (conv_direct.cu, conv_implicit.cu), then only dx below
    if (p.direct)
      direct_filter_grad(s, x, dy, rows, dw, db, workspace);
    else
      implicit_filter_grad(s, p.slices, x, dy, rows, dw, db, workspace);
    if (!dx) return;
    if (p.implicit_dx) return implicit_data_grad(s, w, dy, rows, dx, workspace);  // after the partials' total
  }
  // Per chunk of images (all of them, where the workspace holds them): dy's rows side by side,
  // dyt (K, R), R = chunk P (in the workspace, or already so in dy with `rows`). Then, on the side lane
  // where there is one (streams_wanted), db in the first chunk and dw (K, C KH KW) = dyt col, one GEMM
  // over the chunk's im2col col (R, C KH KW) (later chunks add to dw, beta 1); on the stream meanwhile
  // dx: cols (C KH KW, R) = w^T dyt, one GEMM, and col2im gathers each pixel's taps. cols takes col's
  // place with one lane (dw's GEMM has read col by then), a place of its own with two.
  // cuDNN's BWD_FILTER_ALGO_1, the one deterministic GEMM-like filter-gradient algorithm it offers,
  // gave other last bits from run to run on an H200 (cuDNN 9.14, lenet's second convolution, 16 or more
  // images) and took 60% of a LeNet step's GPU time; its data gradient then took the most (170 of 778 us).
  const bool im2col_dw = !p.direct && !p.implicit, split = p.side_dw && dx;
  const Lane dw_lane = split ? side_ : main();
  const int64_t crs = s.col_rows(), chunk_max = p.backward_images, image = int64_t(s.c) * s.h * s.w;
  for (int64_t n0 = 0; n0 < s.n; n0 += chunk_max) {
    const int64_t nb = std::min<int64_t>(chunk_max, s.n - n0), r = nb * pixels;
    const float* dyt = dy + n0 * pixels;  // dy's rows: (K, N P), this chunk's columns
    int64_t ld = s.n * pixels;
    float* col = chunk_space + s.k * r;         // (R, C KH KW)
    float* cols = split ? col + r * crs : col;  // (C KH KW, R)
    if (!rows) {
      cuda::launch("dy_rows_kernel", dy_rows_kernel, cuda::blocks_for(s.k * r), cuda::kThreads, 0, stream_, s.k * r,
                   s.k, int(pixels), int(r), dy + n0 * s.k * pixels, chunk_space);
      dyt = chunk_space, ld = r;
    }
    Forked forked(*this, split);
    if (im2col_dw) {
      if (n0 == 0 && db) bias_grad(dw_lane.stream, s, rows, dy, workspace, db);  // none: done (conv_act_pool.cu)
      im2col(dw_lane.stream, s, int(r), x + n0 * image, col);
      gemm_ld(dw_lane, false, false, s.k, int(crs), int(r), 1.0f, dyt, int(ld), col, int(crs), n0 == 0 ? 0.0f : 1.0f,
              dw);
    }
    if (dx) {
      gemm_ld(main(), true, false, int(crs), int(r), s.k, 1.0f, w, int(crs), dyt, int(ld), 0.0f, cols);
      col2im(stream_, s, int(r), int(nb), cols, dx + n0 * image);
    }
    forked.join();  // before the next chunk's dyt and col take their places
  }
}

}  // namespace dp
