// BatchNorm (PyTorch's BatchNorm1d/2d, affine) on (N, C, HW) tensors. Twin of
// kernels/cpu/batchnorm.cpp: the same per-element formulas (math::bn_*), the channel sums in double.
//
// The sums run one block per channel: each thread accumulates a fixed strided subset of the channel's
// N * HW values in order, then the block adds the threads' partials in a fixed tree. No atomics, so
// the same inputs give the same bits on every run (dp's bit-exact resume), and in double the result
// is the float rounding of a nearly exact sum, as on the CPU (they differ only where the two double
// summation orders round across a float boundary). One block per channel leaves most of an H100 idle
// for LeNet's 20 to 128 channels, but these are a few microseconds next to the convolutions; a
// split over more blocks would need a workspace for the partials, which the interface does not have.
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"
#include "kernels/math.h"

namespace dp {
namespace {

constexpr int kSumThreads = 512;  // per channel: enough loads in flight with only C blocks running

// The block's total of v over its threads, in a fixed tree (deterministic); every thread gets it.
// s: (kSumThreads) shared doubles, free again on return.
__device__ double block_sum(double v, double* s) {
  const int t = threadIdx.x;
  s[t] = v;
  __syncthreads();
  for (int stride = kSumThreads / 2; stride > 0; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    __syncthreads();
  }
  const double total = s[0];
  __syncthreads();
  return total;
}

// Walks one thread's share of a channel: values j = threadIdx.x, + kSumThreads, ... of the channel's
// (N, HW), as sample i and position p, without a division per step.
struct ChannelWalk {
  int64_t i, p;            // the current sample and position
  int64_t step_i, step_p;  // kSumThreads values on, as samples and positions
  int hw;                  // > 0
  __device__ explicit ChannelWalk(int hw_)
      : i(threadIdx.x / hw_), p(threadIdx.x % hw_), step_i(kSumThreads / hw_), step_p(kSumThreads % hw_), hw(hw_) {}
  __device__ void next() {
    i += step_i, p += step_p;
    if (p >= hw) p -= hw, ++i;
  }
};

// out (C): per-channel sums of x (N, C, HW), or of (x - mean)^2 when mean is given. One block per
// channel. (HW = 1, BatchNorm1d: a warp's loads are C floats apart, uncoalesced; at LeNet's sizes,
// (N, 128), that is a few kilobytes.)
__global__ void __launch_bounds__(kSumThreads)
    bn_channel_sums_kernel(int n, int c, int hw, const float* x, const float* mean, float scale, float* out) {
  cuda::await_previous();
  __shared__ double s[kSumThreads];
  const int ch = blockIdx.x;
  const bool deviation = mean != nullptr;
  const double m = deviation ? double(mean[ch]) : 0.0;
  double acc = 0.0;
  for (ChannelWalk w(hw); w.i < n; w.next())
    acc += math::bn_sum_term(double(x[(w.i * c + ch) * hw + w.p]), m, deviation);
  const double total = block_sum(acc, s);
  if (threadIdx.x == 0) out[ch] = float(total * double(scale));
}

// sums (2, C): sum of dy and of dy * xhat per channel, xhat in double. One block per channel.
__global__ void __launch_bounds__(kSumThreads)
    bn_backward_sums_kernel(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                            const float* dy, float* sums) {
  cuda::await_previous();
  __shared__ double s[kSumThreads];
  const int ch = blockIdx.x;
  const double m = mean[ch], inv_std = math::bn_inv_std(double(var[ch]), double(eps));
  double sum_dy = 0.0, sum_dy_xhat = 0.0;
  for (ChannelWalk w(hw); w.i < n; w.next()) {
    const int64_t at = (w.i * c + ch) * hw + w.p;
    const double g = dy[at];
    sum_dy += g;
    sum_dy_xhat += g * math::bn_xhat(double(x[at]), m, inv_std);
  }
  sum_dy = block_sum(sum_dy, s);
  sum_dy_xhat = block_sum(sum_dy_xhat, s);
  if (threadIdx.x == 0) {
    sums[ch] = float(sum_dy);           // d beta
    sums[c + ch] = float(sum_dy_xhat);  // d gamma
  }
}

// One thread per element of (N, C, HW).
__global__ void bn_normalize_kernel(int64_t total, int c, int hw, const float* x, const float* mean, const float* var,
                                    const float* gamma, const float* beta, float eps, float* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, total) {
    const int ch = int(i / hw % c);
    y[i] = math::bn_normalize(x[i], mean[ch], math::bn_inv_std(var[ch], eps), gamma[ch], beta[ch]);
  }
}

__global__ void bn_backward_dx_kernel(int64_t total, int c, int hw, const float* x, const float* mean, const float* var,
                                      float eps, const float* gamma, const float* dy, const float* sums, int64_t count,
                                      float* dx) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, total) {
    const int ch = int(i / hw % c);
    dx[i] = math::bn_backward_dx(x[i], mean[ch], math::bn_inv_std(var[ch], eps), gamma[ch], dy[i],
                                 math::bn_mean_of(sums[ch], count), math::bn_mean_of(sums[c + ch], count));
  }
}

__global__ void bn_update_running_kernel(int c, const float* mean, const float* var, int64_t count, float momentum,
                                         float* running_mean, float* running_var) {
  cuda::await_previous();
  DP_GRID_STRIDE(ch, c) {
    math::bn_update_running(running_mean[ch], running_var[ch], mean[ch], var[ch], count, momentum);
  }
}

}  // namespace

void CudaOps::bn_channel_sums(int n, int c, int hw, const float* x, const float* mean, float scale, float* out) {
  if (c == 0) return;
  if (hw == 0) n = 0, hw = 1;  // no values: the sums are zero
  cuda::launch("bn_channel_sums_kernel", bn_channel_sums_kernel, unsigned(c), kSumThreads, 0, stream_, n, c, hw, x,
               mean, scale, out);
}

void CudaOps::bn_normalize(int n, int c, int hw, const float* x, const float* mean, const float* var,
                           const float* gamma, const float* beta, float eps, float* y) {
  const int64_t total = int64_t(n) * c * hw;
  if (total == 0) return;
  cuda::launch("bn_normalize_kernel", bn_normalize_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_, total,
               c, hw, x, mean, var, gamma, beta, eps, y);
}

void CudaOps::bn_backward_sums(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                               const float* dy, float* sums) {
  if (c == 0) return;
  if (hw == 0) n = 0, hw = 1;  // no values: the sums are zero
  cuda::launch("bn_backward_sums_kernel", bn_backward_sums_kernel, unsigned(c), kSumThreads, 0, stream_, n, c, hw, x,
               mean, var, eps, dy, sums);
}

void CudaOps::bn_backward_dx(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                             const float* gamma, const float* dy, const float* sums, int64_t count, float* dx) {
  if (count < 1) throw std::invalid_argument("bn_backward_dx: count " + std::to_string(count) + " < 1");
  const int64_t total = int64_t(n) * c * hw;
  if (total == 0) return;
  cuda::launch("bn_backward_dx_kernel", bn_backward_dx_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_,
               total, c, hw, x, mean, var, eps, gamma, dy, sums, count, dx);
}

void CudaOps::bn_update_running(int c, const float* mean, const float* var, int64_t count, float momentum,
                                float* running_mean, float* running_var) {
  if (count < 2)
    throw std::invalid_argument("bn_update_running: count " + std::to_string(count) +
                                ": expected more than 1 value per channel when training (PyTorch's rule)");
  if (c == 0) return;
  cuda::launch("bn_update_running_kernel", bn_update_running_kernel, cuda::blocks_for(c), cuda::kThreads, 0, stream_, c,
               mean, var, count, momentum, running_mean, running_var);
}

}  // namespace dp
