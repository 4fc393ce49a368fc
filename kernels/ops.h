// The kernel interface: every op dp runs, once per backend (kernels/cpu/, kernels/cuda/), with the
// same signature. Pointers are device memory of the backend that runs them; shapes are explicit.
// CUDA implementations enqueue on their device's stream; CPU ones run to completion.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/math.h"  // math::AdamStep, Activation

namespace dp {

struct ConvShape {
  int n = 0;                // images
  int c = 0, h = 0, w = 0;  // input channels, height, width
  int k = 0;                // output channels
  int kh = 0, kw = 0;       // kernel
  int pad = 0;              // symmetric zero padding; stride is 1 throughout LeNet
  int out_h() const { return h + 2 * pad - kh + 1; }
  int out_w() const { return w + 2 * pad - kw + 1; }
  int64_t col_rows() const { return int64_t(c) * kh * kw; }        // im2col rows
  int64_t col_cols() const { return int64_t(out_h()) * out_w(); }  // im2col columns per image
};

struct PoolShape {
  int n = 0, c = 0, h = 0, w = 0;
  int k = 2;  // window and stride (non-overlapping, PyTorch's default stride = kernel)
  int out_h() const { return h / k; }
  int out_w() const { return w / k; }
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual const char* backend() const = 0;
  // Which implementation of the backend: the CPU's instruction set ("reference", "avx2", "avx512").
  virtual const char* variant() const { return backend(); }
  // Samples per chunk in which a network should run its per-sample layers so that a chunk's
  // activations stay in cache from one layer to the next (engine/network.h); 0: the whole batch.
  virtual int preferred_chunk() const { return 0; }

  // Row-major C(m,n) = alpha * op(A) * op(B) + beta * C, op(A) is (m,k), op(B) is (k,n).
  virtual void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, const float* b,
                    float beta, float* c) = 0;

  // Scratch floats conv needs (im2col buffers on the CPU; on CUDA cuDNN's algorithm workspace and the
  // bias gradient's partial sums). A caller asks for every shape it runs, at its largest batch, before
  // running it, and passes at least that many floats as `workspace`.
  virtual size_t conv2d_workspace_floats(const ConvShape& s) = 0;
  virtual void conv2d_forward(const ConvShape& s, const float* x,  // (N, C, H, W)
                              const float* w,                      // (K, C, KH, KW)
                              const float* b,                      // (K)
                              float* y,                            // (N, K, OH, OW)
                              float* workspace) = 0;
  // dx may be null (first layer). dw and db are overwritten, not accumulated.
  virtual void conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx,
                               float* dw, float* db, float* workspace) = 0;

  // conv2d, then an activation, then k x k average pooling (every conv layer of LeNet and LeNet-5),
  // as one op where a backend fuses them: the CPU backend does, so the convolution's output is
  // activated and pooled while it is still in cache. Writes the activation's output y_act
  // (N, K, OH, OW), which the backward reads, and y_pool (N, K, OH/k, OW/k); the convolution's own
  // output is not kept. The default runs the three ops, with y_act holding the convolution's output
  // first (the activation runs in place).
  virtual void conv2d_act_pool_forward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                       const float* b, float* y_act, float* y_pool, float* workspace) {
    conv2d_forward(s, x, w, b, y_act, workspace);
    activation_forward(a, int64_t(s.n) * s.k * s.col_cols(), y_act, y_act);
    avgpool_forward(conv_pool_shape(s, k), y_act, y_pool);
  }
  // Its backward from dy_pool (N, K, OH/k, OW/k), with dx, dw, db as conv2d_backward. scratch
  // (N, K, OH, OW) holds the convolution's output gradient in the default and on CUDA (its rows there);
  // the fast CPU backends need none (null).
  virtual void conv2d_act_pool_backward(const ConvShape& s, Activation a, int k, const float* x, const float* w,
                                        const float* y_act, const float* dy_pool, float* scratch, float* dx, float* dw,
                                        float* db, float* workspace) {
    avgpool_backward(conv_pool_shape(s, k), dy_pool, scratch);
    activation_backward(a, int64_t(s.n) * s.k * s.col_cols(), y_act, scratch, scratch);
    conv2d_backward(s, x, w, scratch, dx, dw, db, workspace);
  }
  static PoolShape conv_pool_shape(const ConvShape& s, int k) {
    return {.n = s.n, .c = s.k, .h = s.out_h(), .w = s.out_w(), .k = k};
  }

  virtual void avgpool_forward(const PoolShape& s, const float* x, float* y) = 0;
  virtual void avgpool_backward(const PoolShape& s, const float* dy, float* dx) = 0;
  virtual void maxpool_forward(const PoolShape& s, const float* x, float* y, int32_t* argmax) = 0;
  virtual void maxpool_backward(const PoolShape& s, const float* dy, const int32_t* argmax, float* dx) = 0;

  // Elementwise: x == y (in place) is allowed, as is dy == dx below.
  virtual void activation_forward(Activation a, int64_t n, const float* x, float* y) = 0;
  // From the activation's output y (both relu and sigmoid derivatives are functions of y).
  virtual void activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) = 0;

  // y(n,out) = x(n,in) * W(out,in)^T + b(out); PyTorch's nn.Linear layout.
  virtual void linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) = 0;
  // dx may be null. dw, db overwritten.
  virtual void linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx,
                               float* dw, float* db) = 0;

  // BatchNorm (PyTorch's BatchNorm1d/2d, affine; kernels/cpu/batchnorm.cpp, kernels/cuda/batchnorm.cu).
  // x, y, dy, dx: (N, C, HW) contiguous (HW = 1 for BatchNorm1d on (N, C)); per-channel buffers (C).
  // The engine composes the five, with an all-reduce of the per-channel sums between them for
  // SyncBatchNorm; `count` is the number of values per channel the statistics are over (N * HW on one
  // replica, the global count over all replicas for SyncBatchNorm). The channel sums are accumulated
  // in double and in a fixed order on every backend: deterministic, and exact to about one rounding.
  //
  // Per-channel sums over N and HW, times scale: of x when mean is null, else of (x - mean)^2. out (C)
  // overwritten (zeros when n == 0). scale 1/count makes them the mean and the biased variance; on
  // each replica, 1/(the global count) makes them partial sums that add up to the global ones.
  virtual void bn_channel_sums(int n, int c, int hw, const float* x, const float* mean, float scale, float* out) = 0;
  // y = (x - mean) / sqrt(var + eps) * gamma + beta, per channel (training: the batch's mean and biased
  // variance; evaluation: the running ones). y == x (in place) is allowed.
  virtual void bn_normalize(int n, int c, int hw, const float* x, const float* mean, const float* var,
                            const float* gamma, const float* beta, float eps, float* y) = 0;
  // sums (2, C) overwritten: [0] = sum of dy, [1] = sum of dy * xhat, xhat = (x - mean) / sqrt(var + eps).
  // These are d beta and d gamma.
  virtual void bn_backward_sums(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                                const float* dy, float* sums) = 0;
  // dx = gamma / sqrt(var + eps) * (dy - sums[0] / count - xhat * sums[1] / count), the training-mode
  // input gradient with batch statistics over `count` (>= 1) values per channel. dx == dy is allowed.
  virtual void bn_backward_dx(int n, int c, int hw, const float* x, const float* mean, const float* var, float eps,
                              const float* gamma, const float* dy, const float* sums, int64_t count, float* dx) = 0;
  // running_mean = (1 - momentum) * running_mean + momentum * mean; running_var likewise with the
  // unbiased var * count / (count - 1) (PyTorch's), for c channels. count > 1, as PyTorch requires
  // ("Expected more than 1 value per channel when training"); fewer throws std::invalid_argument.
  virtual void bn_update_running(int c, const float* mean, const float* var, int64_t count, float momentum,
                                 float* running_mean, float* running_var) = 0;

  // Softmax cross-entropy over n rows. dlogits = (softmax - onehot) * scale; stats[0] += sum of
  // per-row losses * scale, stats[1] += number of rows whose argmax is the label (device memory).
  virtual void softmax_xent(int n, int classes, const float* logits, const int32_t* labels, float scale, float* dlogits,
                            float* stats) = 0;

  // One SGD step over a flat buffer (PyTorch's rule, see math::sgd_update); v may be null when the
  // momentum is 0. Both optimizers read their scalars `s` from device memory when the op runs, not
  // when it is queued, so that a replayed step graph takes each step's own learning rate and bias
  // correction (PyTorch's capturable optimizers do the same). Both check the gradient as they read it:
  // where nonfinite (device memory) is not null they set it to 1 when an element of g is not finite and
  // leave it as it was otherwise, so a step's finiteness check costs no launch and no pass over the
  // gradient of its own, and travels in the step's one download of the stats.
  virtual void sgd_step(int64_t n, float* w, const float* g, float* v, const math::SgdStep* s, float* nonfinite) = 0;
  // One Adam or AdamW step over a flat buffer (PyTorch's rule, see math::adam_update): m and v are the
  // first and second moments (exp_avg, exp_avg_sq), s the step's coefficients (math::adam_coefficients).
  virtual void adam_step(int64_t n, float* w, const float* g, float* m, float* v, const math::AdamStep* s,
                         float* nonfinite) = 0;

  virtual void add(int64_t n, const float* x, float* y) = 0;  // y += x (the reduction kernel)
  virtual void fill(int64_t n, float value, float* x) = 0;
  // --grad-dtype (kernels/dtype.h): y (n elements of t) = x rounded to t (math::narrow); the reverse,
  // exact (math::widen); and the reduction kernel in t, y += x rounded to t (math::add16). For fp32
  // they are a copy, a copy and add().
  virtual void narrow(DType t, int64_t n, const float* x, void* y) = 0;
  virtual void widen(DType t, int64_t n, const void* x, float* y) = 0;
  virtual void add_typed(DType t, int64_t n, const void* x, void* y) = 0;
  // True when every element is finite. Synchronises with the host.
  virtual bool all_finite(int64_t n, const float* x) = 0;
  // Gradient clipping by the global norm (PyTorch's clip_grad_norm_): *sum (device memory) += the sum
  // of the squares of x, in a fixed order (the same bits every run); then x *= the clip coefficient of
  // the sum the pointer holds when the op runs (math::clip_coefficient), which a collective may have
  // added up across devices in between. Both queued like any op, no host wait.
  virtual void sum_squares(int64_t n, const float* x, float* sum) = 0;
  virtual void clip_scale(int64_t n, const float* sum_squares, float max_norm, float* x) = 0;
};

}  // namespace dp
