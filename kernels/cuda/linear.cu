// nn.Linear: y = x W^T + b, W stored (out, in). Twin of kernels/cpu/linear.cpp; the GEMMs are the
// row-major cuBLAS wrapper (but the backward GEMMs of layers of few outputs), the bias and its gradient
// are kernels here.
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"

namespace dp {
namespace {

// y (N, OUT) = b broadcast over rows
__global__ void broadcast_rows_kernel(int64_t total, int out, const float* b, float* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, total) { y[i] = b[i % out]; }
}

// db (OUT) = column sums of dy (N, OUT), one thread per column, rows in order: the CPU's summation
// order, so the same bits. A block takes 32 columns: all its threads stage kSumRows rows of them in
// shared memory at once (neighbouring threads on neighbouring floats of a row), then one warp adds
// them up, a lane a column. (One thread a column loading its own rows, 32 at a time, waited on
// memory: 11 to 13 us a call on an H200, for 256 rows.)
constexpr int kSumRows = 256;
__global__ void column_sums_kernel(int n, int out, const float* dy, float* db) {
  cuda::await_previous();
  __shared__ float tile[kSumRows][32];
  const int c0 = int(blockIdx.x) * 32, lane = int(threadIdx.x) % 32;
  float acc = 0.0f;
  for (int r0 = 0; r0 < n; r0 += kSumRows) {
    const int rows = n - r0 < kSumRows ? n - r0 : kSumRows;
    constexpr int kPerThread = kSumRows * 32 / cuda::kThreads;  // all loaded before any is stored
    float v[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int e = int(threadIdx.x) + k * cuda::kThreads, r = e / 32, c = c0 + e % 32;
      v[k] = r < rows && c < out ? dy[int64_t(r0 + r) * out + c] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int e = int(threadIdx.x) + k * cuda::kThreads;
      tile[e / 32][e % 32] = v[k];
    }
    __syncthreads();
    if (threadIdx.x < 32)
      for (int r = 0; r < rows; ++r) acc += tile[r][lane];
    __syncthreads();  // before the next rows overwrite the tile
  }
  if (threadIdx.x < 32 && c0 + lane < out) db[c0 + lane] = acc;
}

// Layers of at most kFewOutputs outputs (LeNet's last, 10): their dw and dx on kernels here. cuBLAS's
// heuristics give such skinny products split-K kernels and their reductions: on an H200, fc2 at
// batch 256 took 54 us for dw (a 10 x 128 result) and 8 for dx.
constexpr int kFewOutputs = 16;

// dw (OUT, IN) = dy^T x. A block takes 32 consecutive weights e = o IN + i, a lane each; its warps
// take contiguous slices of the rows, each summed in order, then the slices are added in order:
// every weight's sum a fixed tree over the N rows. Neighbouring lanes read neighbouring floats of x.
__global__ void few_outputs_dw_kernel(int n, int in, int out, const float* x, const float* dy, float* dw) {
  cuda::await_previous();
  constexpr int kWarps = cuda::kThreads / 32;
  __shared__ float sums[kWarps][32];
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int64_t e = int64_t(blockIdx.x) * 32 + lane;
  const bool mine = e < int64_t(out) * in;
  const int o = mine ? int(e / in) : 0, i = mine ? int(e % in) : 0;
  const int begin = int(int64_t(n) * warp / kWarps), end = int(int64_t(n) * (warp + 1) / kWarps);
  float acc = 0.0f;
  if (mine) {
#pragma unroll 8
    for (int r = begin; r < end; ++r) acc = fmaf(dy[int64_t(r) * out + o], x[int64_t(r) * in + i], acc);
  }
  sums[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && mine) {
    float total = 0.0f;
    for (int wi = 0; wi < kWarps; ++wi) total += sums[wi][lane];
    dw[e] = total;
  }
}

// dx (N, IN) = dy W: dx[r, i] adds dy[r, o] W[o, i] in o's order.
__global__ void few_outputs_dx_kernel(int n, int in, int out, const float* dy, const float* w, float* dx) {
  cuda::await_previous();
  DP_GRID_STRIDE(e, int64_t(n) * in) {
    const int64_t r = e / in;
    const int i = int(e % in);
    float acc = 0.0f;
    for (int o = 0; o < out; ++o) acc = fmaf(dy[r * out + o], w[int64_t(o) * in + i], acc);
    dx[e] = acc;
  }
}

}  // namespace

void CudaOps::linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) {
  const int64_t total = int64_t(n) * out;  // y (N, OUT)
  if (total == 0) return;
  cuda::launch("broadcast_rows_kernel", broadcast_rows_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_,
               total, out, b, y);
  gemm(false, true, n, out, in, 1.0f, x, w, 1.0f, y);
}

// dw and db on the side lane (streams_wanted), dx on the stream meanwhile.
void CudaOps::linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx,
                              float* dw, float* db) {
  const bool few = out > 0 && out <= kFewOutputs;
  const int64_t weights = int64_t(out) * in, inputs = int64_t(n) * in;
  if (dx) fork();
  const Lane lane = dx ? side_ : main();
  if (!few) {
    gemm(lane, true, false, out, in, n, 1.0f, dy, x, 0.0f, dw);  // dw (OUT, IN) = dy^T x; zero when n == 0
  } else if (weights > 0) {
    cuda::launch("few_outputs_dw_kernel", few_outputs_dw_kernel, unsigned((weights + 31) / 32), cuda::kThreads, 0,
                 lane.stream, n, in, out, x, dy, dw);
  }
  if (out > 0) {
    cuda::launch("column_sums_kernel", column_sums_kernel, unsigned((out + 31) / 32), cuda::kThreads, 0, lane.stream, n,
                 out, dy, db);  // db (OUT)
  }
  if (!dx) return;
  if (!few) {
    gemm(false, false, n, in, out, 1.0f, dy, w, 0.0f, dx);  // dx (N, IN) = dy W
  } else if (inputs > 0) {
    cuda::launch("few_outputs_dx_kernel", few_outputs_dx_kernel, cuda::blocks_for(inputs), cuda::kThreads, 0, stream_,
                 n, in, out, dy, w, dx);
  }
  join();
}

}  // namespace dp
