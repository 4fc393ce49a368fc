// The CPU reference kernels as templates over the scalar type T: float is what dp trains with (the
// reference backend, kernels/cpu/reference_ops.h, calls these), double is what the finite-difference
// gradient checks in tests/ run in. Plain loops over shape-commented buffers, GEMM on BLIS. Each
// op is defined in its own file in this directory, with explicit instantiations for float and double.
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace dp::cpu {

// Row-major C = alpha * op(A) * op(B) + beta * C (cblas_sgemm / cblas_dgemm). k == 0 is an empty
// sum: C = beta * C, and C = 0 when beta == 0 whatever C held.
template <class T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha,
          const T* a,  // (m, k), or (k, m) when trans_a
          const T* b,  // (k, n), or (n, k) when trans_b
          T beta,
          T* c);  // (m, n)

// Scratch elements of T that conv2d needs: col and dcol of one image.
int64_t conv2d_workspace_size(const ConvShape& s);

template <class T>
void conv2d_forward(const ConvShape& s,
                    const T* x,     // (N, C, H, W)
                    const T* w,     // (K, C, KH, KW)
                    const T* b,     // (K)
                    T* y,           // (N, K, OH, OW)
                    T* workspace);  // (conv2d_workspace_size(s))
// dx may be null (first layer). dw and db are overwritten, not accumulated.
template <class T>
void conv2d_backward(const ConvShape& s,
                     const T* x,     // (N, C, H, W)
                     const T* w,     // (K, C, KH, KW)
                     const T* dy,    // (N, K, OH, OW)
                     T* dx,          // (N, C, H, W) or null
                     T* dw,          // (K, C, KH, KW)
                     T* db,          // (K)
                     T* workspace);  // (conv2d_workspace_size(s))

// Window and stride s.k; rows and columns past OH*k, OW*k are not read (PyTorch's floor mode).
template <class T>
void avgpool_forward(const PoolShape& s,
                     const T* x,  // (N, C, H, W)
                     T* y);       // (N, C, OH, OW)
template <class T>
void avgpool_backward(const PoolShape& s,
                      const T* dy,  // (N, C, OH, OW)
                      T* dx);       // (N, C, H, W), overwritten
// argmax holds the index of each maximum within its (H, W) plane; the first maximum wins.
template <class T>
void maxpool_forward(const PoolShape& s,
                     const T* x,        // (N, C, H, W)
                     T* y,              // (N, C, OH, OW)
                     int32_t* argmax);  // (N, C, OH, OW)
template <class T>
void maxpool_backward(const PoolShape& s,
                      const T* dy,            // (N, C, OH, OW)
                      const int32_t* argmax,  // (N, C, OH, OW)
                      T* dx);                 // (N, C, H, W), overwritten

template <class T>
void activation_forward(Activation a, int64_t n,
                        const T* x,  // (n)
                        T* y);       // (n)
// From the activation's output y (both relu and sigmoid derivatives are functions of y).
template <class T>
void activation_backward(Activation a, int64_t n,
                         const T* y,   // (n)
                         const T* dy,  // (n)
                         T* dx);       // (n)

// nn.Linear: y = x W^T + b.
template <class T>
void linear_forward(int n, int in, int out,
                    const T* x,  // (N, IN)
                    const T* w,  // (OUT, IN)
                    const T* b,  // (OUT)
                    T* y);       // (N, OUT)
// dx may be null. dw, db overwritten.
template <class T>
void linear_backward(int n, int in, int out,
                     const T* x,   // (N, IN)
                     const T* w,   // (OUT, IN)
                     const T* dy,  // (N, OUT)
                     T* dx,        // (N, IN) or null
                     T* dw,        // (OUT, IN)
                     T* db);       // (OUT)

// BatchNorm (PyTorch's BatchNorm1d/2d, affine) on (N, C, HW) tensors, the Ops interface's five ops
// (kernels/ops.h says what each computes). The channel sums accumulate in double whatever T, channel
// by channel, samples and positions in order; the per-element formulas are math::bn_*.
template <class T>
void bn_channel_sums(int n, int c, int hw,
                     const T* x,     // (N, C, HW)
                     const T* mean,  // (C) or null
                     T scale,        // applied to the double sum, before it is rounded to T
                     T* out);        // (C)
template <class T>
void bn_normalize(int n, int c, int hw,
                  const T* x,      // (N, C, HW)
                  const T* mean,   // (C)
                  const T* var,    // (C)
                  const T* gamma,  // (C)
                  const T* beta,   // (C)
                  T eps,
                  T* y);  // (N, C, HW), may be x
template <class T>
void bn_backward_sums(int n, int c, int hw,
                      const T* x,     // (N, C, HW)
                      const T* mean,  // (C)
                      const T* var,   // (C)
                      T eps,
                      const T* dy,  // (N, C, HW)
                      T* sums);     // (2, C): sum dy, sum dy * xhat
template <class T>
void bn_backward_dx(int n, int c, int hw,
                    const T* x,     // (N, C, HW)
                    const T* mean,  // (C)
                    const T* var,   // (C)
                    T eps,
                    const T* gamma,  // (C)
                    const T* dy,     // (N, C, HW)
                    const T* sums,   // (2, C), bn_backward_sums' (all-reduced for SyncBatchNorm)
                    int64_t count,
                    T* dx);  // (N, C, HW), may be dy
// count > 1, else std::invalid_argument.
template <class T>
void bn_update_running(int c,
                       const T* mean,  // (C)
                       const T* var,   // (C), biased
                       int64_t count, T momentum,
                       T* running_mean,  // (C)
                       T* running_var);  // (C)

// dlogits = (softmax - onehot) * scale; stats[0] += sum of per-row losses * scale, stats[1] += number
// of rows whose argmax (the first maximum) is the label.
template <class T>
void softmax_xent(int n, int classes,
                  const T* logits,        // (N, CLASSES)
                  const int32_t* labels,  // (N)
                  T scale,
                  T* dlogits,  // (N, CLASSES)
                  T* stats);   // (2)

// PyTorch's SGD over a flat buffer (math::sgd_update). v may be null when momentum is 0. Both
// optimizers set *nonfinite to 1 when a g is not finite, where nonfinite is not null (Ops::sgd_step).
template <class T>
void sgd_step(int64_t n,
              T* w,        // (n)
              const T* g,  // (n)
              T* v,        // (n) or null
              T lr, T momentum, T weight_decay,
              T* nonfinite);  // (1) or null

// PyTorch's Adam / AdamW over a flat buffer (math::adam_update).
template <class T>
void adam_step(int64_t n,
               T* w,        // (n)
               const T* g,  // (n)
               T* m,        // (n) exp_avg
               T* v,        // (n) exp_avg_sq
               const math::AdamStep& s,
               T* nonfinite);  // (1) or null

template <class T>
void add(int64_t n, const T* x /* (n) */, T* y /* (n) */);  // y += x
template <class T>
void fill(int64_t n, T value, T* x /* (n) */);
// --grad-dtype's conversions and add (Ops::narrow, widen, add_typed), t a 16-bit type.
void narrow(DType t, int64_t n, const float* x, uint16_t* y);
void widen(DType t, int64_t n, const uint16_t* x, float* y);
void add_typed(DType t, int64_t n, const uint16_t* x, uint16_t* y);
template <class T>
bool all_finite(int64_t n, const T* x /* (n) */);
template <class T>
void sum_squares(int64_t n, const T* x /* (n) */, T* sum /* (1): += the sum of x's squares */);
template <class T>  // x *= math::clip_coefficient(*sum_squares, max_norm)
void clip_scale(int64_t n, const T* sum_squares /* (1) */, T max_norm, T* x /* (n) */);

}  // namespace dp::cpu
