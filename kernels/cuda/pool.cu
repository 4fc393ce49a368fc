// Average and max pooling with a k x k window and stride k. Twin of kernels/cpu/pool.cpp: the same
// summation order and the same first-maximum rule, so the results are the same bits.
//
// Windows never overlap (stride = window), so every input pixel belongs to at most one window and
// the backward kernels run one thread per input pixel: a gather, no atomics, no separate zeroing.
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"

namespace dp {
namespace {

// One thread per output: y (N*C, OH, OW) from x (N*C, H, W).
__global__ void avgpool_forward_kernel(int64_t total, int h, int w, int k, int oh, int ow, float inv, const float* x,
                                       float* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, total) {
    const int64_t plane = i / (int64_t(oh) * ow);
    const int r = int(i % (int64_t(oh) * ow)), oi = r / ow, oj = r % ow;
    const float* xp = x + plane * h * w;  // (H, W)
    float acc = 0.0f;
    for (int a = 0; a < k; ++a)
      for (int b = 0; b < k; ++b) acc += xp[(oi * k + a) * w + oj * k + b];
    y[i] = acc * inv;
  }
}

// One thread per input pixel: dx (N*C, H, W); pixels past the last full window get zero.
__global__ void avgpool_backward_kernel(int64_t total, int h, int w, int k, int oh, int ow, float inv, const float* dy,
                                        float* dx) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, total) {
    const int64_t plane = i / (int64_t(h) * w);
    const int r = int(i % (int64_t(h) * w)), oi = r / w / k, oj = r % w / k;
    dx[i] = oi < oh && oj < ow ? dy[plane * oh * ow + oi * ow + oj] * inv : 0.0f;
  }
}

// One thread per output; argmax holds the index within the (H, W) plane, first maximum wins.
__global__ void maxpool_forward_kernel(int64_t total, int h, int w, int k, int oh, int ow, const float* x, float* y,
                                       int32_t* argmax) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, total) {
    const int64_t plane = i / (int64_t(oh) * ow);
    const int r = int(i % (int64_t(oh) * ow)), oi = r / ow, oj = r % ow;
    const float* xp = x + plane * h * w;
    int best = (oi * k) * w + oj * k;
    for (int a = 0; a < k; ++a)
      for (int b = 0; b < k; ++b) {
        const int idx = (oi * k + a) * w + oj * k + b;
        if (xp[idx] > xp[best]) best = idx;
      }
    y[i] = xp[best];
    argmax[i] = best;
  }
}

// One thread per input pixel: its window's gradient if it was the window's maximum, else zero.
// 0.0f + dy reproduces the CPU's zero-then-accumulate exactly (including the sign of zero).
__global__ void maxpool_backward_kernel(int64_t total, int h, int w, int k, int oh, int ow, const float* dy,
                                        const int32_t* argmax, float* dx) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, total) {
    const int64_t plane = i / (int64_t(h) * w);
    const int r = int(i % (int64_t(h) * w)), oi = r / w / k, oj = r % w / k;
    float g = 0.0f;
    if (oi < oh && oj < ow) {
      const int64_t o = plane * oh * ow + oi * ow + oj;
      if (argmax[o] == r) g = 0.0f + dy[o];
    }
    dx[i] = g;
  }
}

}  // namespace

void CudaOps::avgpool_forward(const PoolShape& s, const float* x, float* y) {
  const int64_t total = int64_t(s.n) * s.c * s.out_h() * s.out_w();
  if (total == 0) return;
  cuda::launch("avgpool_forward_kernel", avgpool_forward_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_,
               total, s.h, s.w, s.k, s.out_h(), s.out_w(), 1.0f / float(s.k * s.k), x, y);
}

void CudaOps::avgpool_backward(const PoolShape& s, const float* dy, float* dx) {
  const int64_t total = int64_t(s.n) * s.c * s.h * s.w;
  if (total == 0) return;
  cuda::launch("avgpool_backward_kernel", avgpool_backward_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_,
               total, s.h, s.w, s.k, s.out_h(), s.out_w(), 1.0f / float(s.k * s.k), dy, dx);
}

void CudaOps::maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) {
  const int64_t total = int64_t(s.n) * s.c * s.out_h() * s.out_w();
  if (total == 0) return;
  cuda::launch("maxpool_forward_kernel", maxpool_forward_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_,
               total, s.h, s.w, s.k, s.out_h(), s.out_w(), x, y, argmax);
}

void CudaOps::maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) {
  const int64_t total = int64_t(s.n) * s.c * s.h * s.w;
  if (total == 0) return;
  cuda::launch("maxpool_backward_kernel", maxpool_backward_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_,
               total, s.h, s.w, s.k, s.out_h(), s.out_w(), dy, argmax, dx);
}

}  // namespace dp
