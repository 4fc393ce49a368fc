// Per-element math shared by the CPU kernels and their CUDA twins: one definition of every formula,
// compiled for host and device, so the two backends cannot drift apart.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DP_HD __host__ __device__ __forceinline__
#else
#define DP_HD inline
#endif

namespace dp::math {

DP_HD float relu(float x) { return x > 0.0f ? x : 0.0f; }
// Derivative from the output: relu'(x) = [y > 0]. PyTorch's threshold_backward also uses y > 0.
DP_HD float relu_grad(float y, float dy) { return y > 0.0f ? dy : 0.0f; }

// Stable in both tails: never evaluates exp of a large positive number.
DP_HD float sigmoid(float x) {
  if (x >= 0.0f) {
    float z = expf(-x);
    return 1.0f / (1.0f + z);
  }
  float z = expf(x);
  return z / (1.0f + z);
}
DP_HD float sigmoid_grad(float y, float dy) { return dy * y * (1.0f - y); }

// PyTorch's SGD (torch.optim.SGD, dampening 0, nesterov off):
//   g <- g + wd * w ;  v <- momentum * v + g  (v <- g on the first step) ;  w <- w - lr * v
// `first` marks the first step, where PyTorch initialises the buffer to g instead of scaling zeros;
// the two are equal in exact arithmetic and in float (0 * momentum + g == g), so dp keeps one formula
// and zero-initialised momentum buffers.
DP_HD void sgd_update(float& w, float& v, float g, float lr, float momentum, float weight_decay) {
  float d = g + weight_decay * w;
  if (momentum != 0.0f) {
    v = momentum * v + d;
    d = v;
  }
  w = w - lr * d;
}

// Cross-entropy of one row given its max and the log of its shifted partition sum:
//   loss = log(sum exp(z - m)) - (z_y - m)
DP_HD float xent_loss(float z_label, float row_max, float log_sum) { return log_sum - (z_label - row_max); }
// d loss / d z_j, times `scale` (1/B for a mean over the global batch).
DP_HD float xent_grad(float z, float row_max, float log_sum, bool is_label, float scale) {
  float p = expf(z - row_max - log_sum);
  return (p - (is_label ? 1.0f : 0.0f)) * scale;
}

}  // namespace dp::math
