// Softmax cross-entropy, numerically stable (shifted by the row maximum), fused with its gradient.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/math.h"

namespace dp {

void CpuOps::softmax_xent(int n, int classes, const float* logits, const int32_t* labels,
                          float scale, float* dlogits, float* stats) {
  float loss = 0.0f, correct = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float* z = logits + int64_t(i) * classes;  // (C)
    float* dz = dlogits + int64_t(i) * classes;      // (C)
    int best = 0;
    for (int j = 1; j < classes; ++j)
      if (z[j] > z[best]) best = j;
    float m = z[best], sum = 0.0f;
    for (int j = 0; j < classes; ++j) sum += expf(z[j] - m);
    float log_sum = logf(sum);
    loss += math::xent_loss(z[labels[i]], m, log_sum);
    for (int j = 0; j < classes; ++j) dz[j] = math::xent_grad(z[j], m, log_sum, j == labels[i], scale);
    correct += best == labels[i] ? 1.0f : 0.0f;
  }
  stats[0] += loss * scale;
  stats[1] += correct;
}

}  // namespace dp
