// ReLU and sigmoid, forward and backward, through the shared per-element math (kernels/math.h).
// Twin of kernels/cpu/activation.cpp.
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"
#include "kernels/math.h"

namespace dp {
namespace {

__global__ void relu_forward_kernel(int64_t n, const float* x, float* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { y[i] = math::relu(x[i]); }
}
__global__ void sigmoid_forward_kernel(int64_t n, const float* x, float* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { y[i] = math::sigmoid(x[i]); }
}
__global__ void relu_backward_kernel(int64_t n, const float* y, const float* dy, float* dx) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { dx[i] = math::relu_grad(y[i], dy[i]); }
}
__global__ void sigmoid_backward_kernel(int64_t n, const float* y, const float* dy, float* dx) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { dx[i] = math::sigmoid_grad(y[i], dy[i]); }
}

}  // namespace

void CudaOps::activation_forward(Activation a, int64_t n, const float* x, float* y) {
  if (n == 0) return;
  if (a == Activation::relu) {
    cuda::launch("relu_forward_kernel", relu_forward_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n, x, y);
  } else {
    cuda::launch("sigmoid_forward_kernel", sigmoid_forward_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n,
                 x, y);
  }
}

void CudaOps::activation_backward(Activation a, int64_t n, const float* y, const float* dy, float* dx) {
  if (n == 0) return;
  if (a == Activation::relu) {
    cuda::launch("relu_backward_kernel", relu_backward_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n, y,
                 dy, dx);
  } else {
    cuda::launch("sigmoid_backward_kernel", sigmoid_backward_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n,
                 y, dy, dx);
  }
}

}  // namespace dp
