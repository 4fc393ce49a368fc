// SGD, the reduction add, fill and the finiteness check over flat buffers.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/math.h"

namespace dp {

void CpuOps::sgd_step(int64_t n, float* w, const float* g, float* v, float lr, float momentum,
                      float weight_decay) {
  if (!v) {  // momentum 0: no buffer (the optimizer category stays empty)
    float none = 0.0f;
    for (int64_t i = 0; i < n; ++i) math::sgd_update(w[i], none, g[i], lr, 0.0f, weight_decay);
    return;
  }
  for (int64_t i = 0; i < n; ++i) math::sgd_update(w[i], v[i], g[i], lr, momentum, weight_decay);
}

void CpuOps::add(int64_t n, const float* x, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void CpuOps::fill(int64_t n, float value, float* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

bool CpuOps::all_finite(int64_t n, const float* x) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

}  // namespace dp
