// ReLU and sigmoid, forward and backward, through the shared per-element math.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/math.h"

namespace dp {

void CpuOps::activation_forward(Activation a, int64_t n, const float* x, float* y) {
  if (a == Activation::relu)
    for (int64_t i = 0; i < n; ++i) y[i] = math::relu(x[i]);
  else
    for (int64_t i = 0; i < n; ++i) y[i] = math::sigmoid(x[i]);
}

void CpuOps::activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) {
  if (a == Activation::relu)
    for (int64_t i = 0; i < n; ++i) dx[i] = math::relu_grad(y[i], dy[i]);
  else
    for (int64_t i = 0; i < n; ++i) dx[i] = math::sigmoid_grad(y[i], dy[i]);
}

}  // namespace dp
