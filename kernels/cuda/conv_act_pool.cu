// conv2d, an activation and k x k average pooling as one op (Ops::conv2d_act_pool_forward and
// _backward: every conv layer of LeNet and LeNet-5). The convolutions are conv2d.cu's; what lies
// between them and the pooling, four to six passes over the convolution's output in the unfused op
// (bias, activation and pooling forward; pooling's and the activation's backward, then dy's rows for
// the GEMMs), is one kernel each way here. Each does the same float operations in the same order as
// the separate kernels (conv2d.cu's bias, activation.cu, pool.cu), so the results are the same bits
// (tests/test_ops_conv.cpp holds the fused op to the unfused one's bits). Shapes of few taps (LeNet's
// conv1) go further on conv_direct.cu's kernels: the convolution too in the forward kernel, and for a
// first layer the way back inside the weight gradient's kernel.
//
// Their index arithmetic divides by the shapes' sizes with cuda::Divider (a multiply-high and a shift).
// Sizes: the tensors here hold fewer than 2^31 floats (make_plan's chunks keep theirs so too).
#include <algorithm>

#include "kernels/cuda/bias_grad.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/divider.h"
#include "kernels/cuda/launch.h"
#include "kernels/math.h"

namespace dp {
namespace {

// y (N K, OH, OW) holds the convolution without its bias: y = act(y + b) in place, and y_pool = the
// sum of each k x k window of y, row by row, times 1 / k^2 (the last row and column of pixels where k
// does not divide OH or OW are activated, not pooled, as in pool.cu). Each block takes `per_block`
// whole planes: first every pixel, neighbouring threads on neighbouring floats, each activated value
// also kept in shared memory; then the windows' sums from there. A thread loads kPoolBatch pixels
// before it activates the first, so their loads wait for memory together (both layers' kernels on an
// H200: 29.7 us a step one pixel at a time, 17.9 so).
constexpr int kPoolBatch = 4;
template <Activation A>
__global__ void bias_act_pool_kernel(int planes, int per_block, cuda::Divider pixels, cuda::Divider channels,
                                     cuda::Divider pooled, cuda::Divider pw, int ow, int k, float inv, const float* b,
                                     float* y, float* y_pool) {
  cuda::await_previous();
  extern __shared__ float tile[];  // per_block planes
  const int first = int(blockIdx.x) * per_block, count = planes - first < per_block ? planes - first : per_block;
  const int p = pixels.divisor(), ch0 = channels.mod(first);
  float* yb = y + int64_t(first) * p;
  const int total = count * p, stride = int(blockDim.x);
  for (int e0 = int(threadIdx.x); e0 < total; e0 += kPoolBatch * stride) {
    float in[kPoolBatch];  // loaded together, then activated in turn
#pragma unroll
    for (int i = 0; i < kPoolBatch; ++i) in[i] = e0 + i * stride < total ? yb[e0 + i * stride] : 0.0f;
#pragma unroll
    for (int i = 0; i < kPoolBatch; ++i) {
      const int e = e0 + i * stride;
      if (e >= total) break;
      const float v = math::activate<A>(in[i] + b[channels.mod(ch0 + pixels.div(e))]);  // the plane's channel
      yb[e] = v;
      tile[e] = v;
    }
  }
  __syncthreads();
  const int pp = pooled.divisor();
  for (int o = int(threadIdx.x); o < count * pp; o += int(blockDim.x)) {
    int plane = 0, cell = 0, i = 0, j = 0;
    pooled.divmod(o, plane, cell);
    pw.divmod(cell, i, j);
    const float* t = tile + plane * p + i * k * ow + j * k;
    float acc = 0.0f;
    for (int a = 0; a < k; ++a)
      for (int c = 0; c < k; ++c) acc += t[a * ow + c];
    y_pool[int64_t(first) * pp + o] = acc * inv;
  }
}

// From dy_pool (N K, OH/k, OW/k): each pixel's share of its window's gradient (zero outside the
// windows), through the activation's derivative at y_act, written as dy's rows, dyt (K, N OH OW)[ch,
// n OH OW + pixel], the layout the backward pass's GEMMs read. One thread per pixel, in y_act's order.
template <Activation A>
__global__ void act_pool_backward_rows_kernel(int total, int n, cuda::Divider pixels, cuda::Divider channels,
                                              cuda::Divider ow, cuda::Divider k, int ph, int pw, float inv,
                                              const float* y_act, const float* dy_pool, float* dyt) {
  cuda::await_previous();
  DP_GRID_STRIDE(i64, total) {
    const int i = int(i64);
    int plane = 0, q = 0, img = 0, ch = 0, yy = 0, xx = 0;
    pixels.divmod(i, plane, q);
    channels.divmod(plane, img, ch);
    ow.divmod(q, yy, xx);
    const int wi = k.div(yy), wj = k.div(xx);
    const float* window = wi < ph && wj < pw ? dy_pool + (int64_t(plane) * ph + wi) * pw + wj : nullptr;
    dyt[(int64_t(ch) * n + img) * pixels.divisor() + q] = math::act_pool_grad<A>(y_act[i], window, inv);
  }
}

// The same rows, and db on the way where the backward pass would sum it from them (the im2col path):
// block b of (K, kBiasSlices) writes its slice of row ch (kernels/cuda/bias_grad.h) and adds the values
// as conv2d.cu's bias_grad_partial_kernel adds them when it reads them back (add_rn: a value computed
// in registers is not fused into the sum), so db has the separate kernels' bits; the last block to
// finish adds each channel's partials in slice order, as bias_grad_total_kernel.
template <Activation A>
__global__ void act_pool_backward_rows_db_kernel(int n, int k, cuda::Divider pixels, cuda::Divider ow,
                                                 cuda::Divider window, int ph, int pw, float inv, const float* y_act,
                                                 const float* dy_pool, float* dyt, float* partial, unsigned* done,
                                                 float* db) {
  cuda::await_previous();
  const int p = pixels.divisor();
  const int64_t per_channel = int64_t(n) * p;
  const cuda::bias::Slice sl = cuda::bias::slice_of(per_channel);
  float acc = 0.0f;
  for (int64_t j = sl.begin + threadIdx.x; j < sl.end; j += blockDim.x) {
    int img = 0, q = 0, yy = 0, xx = 0;
    pixels.divmod(int(j), img, q);
    ow.divmod(q, yy, xx);
    const int wi = window.div(yy), wj = window.div(xx), plane = img * k + sl.ch;
    const float* cell = wi < ph && wj < pw ? dy_pool + (int64_t(plane) * ph + wi) * pw + wj : nullptr;
    const float v = math::act_pool_grad<A>(y_act[int64_t(plane) * p + q], cell, inv);
    dyt[sl.ch * per_channel + j] = v;
    acc = math::add_rn(acc, v);
  }
  cuda::bias::write_partial(acc, partial);
  __shared__ bool last;
  if (threadIdx.x == 0) last = cuda::last_block_done(done);
  __syncthreads();
  if (!last) return;
  __threadfence();  // every thread reads other blocks' partials, not only the one whose count said so
  for (int ch = int(threadIdx.x); ch < k; ch += int(blockDim.x)) db[ch] = cuda::bias::total(partial, ch);
}

// Planes per block of bias_act_pool_kernel: about 2,048 pixels (eight a thread), at least one plane,
// within the shared memory any kernel may take without asking (48 KiB).
constexpr int kPoolTilePixels = 2048;
constexpr size_t kMaxPoolTileBytes = size_t(48) << 10;

// The kernels index in 32 bits; a larger output (2^31 floats, 8 GiB) takes the three ops.
bool indexable(const ConvShape& s) { return int64_t(s.n) * s.k * s.out_h() * s.out_w() < INT32_MAX; }

}  // namespace

void CudaOps::conv2d_act_pool_forward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                      const float* b, float* y_act, float* y_pool, float* workspace) {
  if (s.n == 0) return;
  const int oh = s.out_h(), ow = s.out_w(), pixels = oh * ow;
  const int per_block = std::max(1, kPoolTilePixels / pixels), pooled = (oh / k) * (ow / k);
  const size_t tile_bytes = sizeof(float) * size_t(per_block) * size_t(pixels);
  // one kernel (no tile: any plane), where the taps are few and the windows tile the output
  if (pooled > 0 && fuse_wanted() && direct_act_pool(s, k) && plan(s).direct)
    return direct_act_pool_forward(s, a, x, w, b, y_act, y_pool);
  // a plane larger than a tile, or a window larger than the plane (nothing pooled): the three ops
  if (tile_bytes > kMaxPoolTileBytes || pooled == 0 || !indexable(s))
    return Ops::conv2d_act_pool_forward(s, a, k, x, w, b, y_act, y_pool, workspace);
  const int planes = s.n * s.k;
  convolve(s, x, w, y_act, workspace);
  const unsigned blocks = unsigned((planes + per_block - 1) / per_block);
  const cuda::Divider by_pixels(pixels), by_channels(s.k), by_pooled(std::max(pooled, 1)), by_pw(std::max(ow / k, 1));
  const float inv = 1.0f / float(k * k);  // as avgpool_forward
  math::with_activation(a, [&]<Activation A>() {
    cuda::launch("bias_act_pool_kernel", bias_act_pool_kernel<A>, blocks, cuda::kThreads, tile_bytes, stream_, planes,
                 per_block, by_pixels, by_channels, by_pooled, by_pw, ow, k, inv, b, y_act, y_pool);
  });
}

void CudaOps::conv2d_act_pool_backward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                       const float* y_act, const float* dy_pool, float* scratch, float* dx, float* dw,
                                       float* db, float* workspace) {
  if (!indexable(s))
    return Ops::conv2d_act_pool_backward(s, a, k, x, w, y_act, dy_pool, scratch, dx, dw, db, workspace);
  if (s.n == 0) return conv_backward(s, x, w, scratch, /*rows*/ true, dx, dw, db, workspace);
  const ConvPlan& p = plan(s);
  // A first layer of few taps (lenet's conv1): dw and db read dy_pool and y_act themselves, so dy's rows
  // (a pass over the layer's output each way: 14 MB for lenet's conv1 at batch 256) are never written.
  if (!dx && p.direct && fuse_wanted())
    return direct_act_pool_filter_grad(s, a, k, x, y_act, dy_pool, dw, db, workspace);
  // scratch: dy's rows; on the im2col path db too, through its partials at the workspace's start
  const bool with_db = !p.direct && !p.implicit && fuse_wanted();
  const int oh = s.out_h(), ow = s.out_w(), total = s.n * s.k * oh * ow;
  const cuda::Divider by_pixels(oh * ow), by_channels(s.k), by_ow(ow), by_k(k);
  const float inv = 1.0f / float(k * k);
  math::with_activation(a, [&]<Activation A>() {
    if (with_db)
      cuda::launch("act_pool_backward_rows_db_kernel", act_pool_backward_rows_db_kernel<A>, unsigned(s.k) * kBiasSlices,
                   cuda::kThreads, 0, stream_, s.n, s.k, by_pixels, by_ow, by_k, oh / k, ow / k, inv, y_act, dy_pool,
                   scratch, workspace, &scratch_->bias_done, db);
    else
      cuda::launch("act_pool_backward_rows_kernel", act_pool_backward_rows_kernel<A>, cuda::blocks_for(total),
                   cuda::kThreads, 0, stream_, total, s.n, by_pixels, by_channels, by_ow, by_k, oh / k, ow / k, inv,
                   y_act, dy_pool, scratch);
  });
  conv_backward(s, x, w, scratch, /*rows*/ true, dx, dw, with_db ? nullptr : db, workspace);
}

}  // namespace dp
