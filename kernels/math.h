// Per-element math shared by the CPU kernels and their CUDA twins: one definition of every formula,
// compiled for host and device, so the two backends cannot drift apart. Templates over the scalar:
// the kernels run in float; the CPU reference also instantiates double for the gradient checks.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DP_HD __host__ __device__ __forceinline__
#else
#define DP_HD inline
#endif

namespace dp::math {

// exp that picks expf for float in device code as well as on the host.
DP_HD float exp_(float x) { return expf(x); }
DP_HD double exp_(double x) { return ::exp(x); }

template <class T>
DP_HD T relu(T x) {
  return x > T(0) ? x : T(0);
}
// Derivative from the output: relu'(x) = [y > 0], as PyTorch's threshold_backward.
template <class T>
DP_HD T relu_grad(T y, T dy) {
  return y > T(0) ? dy : T(0);
}

// Stable in both tails: never evaluates exp of a large positive number.
template <class T>
DP_HD T sigmoid(T x) {
  if (x >= T(0)) return T(1) / (T(1) + exp_(-x));
  T z = exp_(x);
  return z / (T(1) + z);
}
template <class T>
DP_HD T sigmoid_grad(T y, T dy) {
  return dy * y * (T(1) - y);
}

// PyTorch's SGD (torch.optim.SGD, dampening 0, nesterov off):
//   d <- g + wd * w ;  v <- momentum * v + d  (v <- d on the first step) ;  w <- w - lr * v
// PyTorch initialises the buffer to d on the first step; dp keeps zero-initialised buffers, and
// momentum * 0 + d == d exactly in floating point, so one formula covers both.
template <class T>
DP_HD void sgd_update(T& w, T& v, T g, T lr, T momentum, T weight_decay) {
  T d = g + weight_decay * w;
  if (momentum != T(0)) {
    v = momentum * v + d;
    d = v;
  }
  w = w - lr * d;
}

// Cross-entropy of one row from its maximum m and log_sum = log(sum_j exp(z_j - m)):
//   loss = log_sum - (z_label - m)
template <class T>
DP_HD T xent_loss(T z_label, T row_max, T log_sum) {
  return log_sum - (z_label - row_max);
}
// d loss / d z_j = softmax_j - [j == label], times `scale` (1/B for a mean over the global batch).
template <class T>
DP_HD T xent_grad(T z, T row_max, T log_sum, bool is_label, T scale) {
  T p = exp_(z - row_max - log_sum);
  return (p - (is_label ? T(1) : T(0))) * scale;
}

}  // namespace dp::math
