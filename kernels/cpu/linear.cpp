// nn.Linear: y = x W^T + b, W stored (out, in).
#include <cstring>

#include "kernels/cpu/cpu_ops.h"

namespace dp {

void CpuOps::linear_forward(int n, int in, int out, const float* x, const float* w, const float* b,
                            float* y) {
  for (int i = 0; i < n; ++i) std::memcpy(y + int64_t(i) * out, b, sizeof(float) * out);  // (N, OUT)
  gemm(false, true, n, out, in, 1.0f, x, w, 1.0f, y);
}

void CpuOps::linear_backward(int n, int in, int out, const float* x, const float* w,
                             const float* dy, float* dx, float* dw, float* db) {
  gemm(true, false, out, in, n, 1.0f, dy, x, 0.0f, dw);  // (OUT, IN) = dy^T x
  for (int o = 0; o < out; ++o) db[o] = 0.0f;
  for (int i = 0; i < n; ++i)
    for (int o = 0; o < out; ++o) db[o] += dy[int64_t(i) * out + o];
  if (dx) gemm(false, false, n, in, out, 1.0f, dy, w, 0.0f, dx);  // (N, IN) = dy W
}

}  // namespace dp
