// nn.Linear: y = x W^T + b, W stored (out, in). Twin of kernels/cpu/linear.cpp; the GEMMs are the
// row-major cuBLAS wrapper, the bias and its gradient are kernels here.
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"

namespace dp {
namespace {

// y (N, OUT) = b broadcast over rows
__global__ void broadcast_rows_kernel(int64_t total, int out, const float* b, float* y) {
  DP_GRID_STRIDE(i, total) { y[i] = b[i % out]; }
}

// db (OUT) = column sums of dy (N, OUT), one thread per column, rows in order: the CPU's summation
// order, so the same bits. Neighbouring threads read neighbouring floats of a row. LeNet's layers
// have 10 to 500 columns, so a few warps do it all, and each waits on memory, not on arithmetic: it
// loads kBatch rows at once, then adds them in order (8 at a time, it took 15 us a call on an H200).
__global__ void column_sums_kernel(int n, int out, const float* dy, float* db) {
  constexpr int kBatch = 32;
  DP_GRID_STRIDE(o, out) {
    float acc = 0.0f;
    int i = 0;
    for (; i + kBatch <= n; i += kBatch) {
      float v[kBatch];
#pragma unroll
      for (int t = 0; t < kBatch; ++t) v[t] = dy[int64_t(i + t) * out + o];
#pragma unroll
      for (int t = 0; t < kBatch; ++t) acc += v[t];
    }
    for (; i < n; ++i) acc += dy[int64_t(i) * out + o];
    db[o] = acc;
  }
}

}  // namespace

void CudaOps::linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) {
  const int64_t total = int64_t(n) * out;  // y (N, OUT)
  if (total == 0) return;
  broadcast_rows_kernel<<<cuda::blocks_for(total), cuda::kThreads, 0, stream_>>>(total, out, b, y);
  DP_CUDA_LAUNCH_CHECK("broadcast_rows_kernel");
  gemm(false, true, n, out, in, 1.0f, x, w, 1.0f, y);
}

void CudaOps::linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx,
                              float* dw, float* db) {
  gemm(true, false, out, in, n, 1.0f, dy, x, 0.0f, dw);  // dw (OUT, IN) = dy^T x; zero when n == 0
  if (out > 0) {
    column_sums_kernel<<<cuda::blocks_for(out), cuda::kThreads, 0, stream_>>>(n, out, dy, db);  // db (OUT)
    DP_CUDA_LAUNCH_CHECK("column_sums_kernel");
  }
  if (dx) gemm(false, false, n, in, out, 1.0f, dy, w, 0.0f, dx);  // dx (N, IN) = dy W
}

}  // namespace dp
