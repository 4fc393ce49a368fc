// nn.Linear: y = x W^T + b, W stored (out, in). Twin of kernels/cpu/linear.cpp; the GEMMs are the
// row-major cuBLAS wrapper, the bias and its gradient kernels here; a layer of few outputs (LeNet's
// last) runs each way on one kernel of its own (CudaOps::fuse_wanted).
#include <algorithm>

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
// `block`: which 32 columns (blockIdx.x in its own kernel).
constexpr int kSumRows = 256;
__device__ void column_sums_block(int block, int n, int out, const float* dy, float* db) {
  __shared__ float tile[kSumRows][32];
  const int c0 = block * 32, lane = int(threadIdx.x) % 32;
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
__global__ void column_sums_kernel(int n, int out, const float* dy, float* db) {
  cuda::await_previous();
  column_sums_block(int(blockIdx.x), n, out, dy, db);
}

// Layers of at most kFewOutputs outputs (LeNet's last, 10): each pass on one kernel here. cuBLAS's
// heuristics give such skinny products split-K kernels and their reductions: on an H200, fc2 at
// batch 256 took 54 us for dw (a 10 x 128 result) and 8 for dx; then 5.5 for dw, 4.3 for dx and 4.7
// for db on three kernels here, one after another, and 2.5 + 6.2 forward (the bias, cuBLAS's GEMM).
constexpr int kFewOutputs = 16;

// y (N, OUT) = x W^T + b, a warp a row: lane l adds x[r, i] W[o, i] for i = l, l + 32, ... in turn,
// for every o at once (x's row read once, coalesced, as are W's rows), then the warp's 32 sums are
// added by a fixed butterfly and the bias last: the same bits every run, within the GEMM's bound. (A
// thread per output, each walking its 128 products, waited on memory a load at a time: 12.0 us on an
// H200 with the caches flushed, against the bias kernel and cuBLAS's GEMM's 11.6.)
__global__ void few_outputs_forward_kernel(int n, int in, int out, const float* x, const float* w, const float* b,
                                           float* y) {
  cuda::await_previous();
  const int lane = int(threadIdx.x) % 32, warps = int(gridDim.x * blockDim.x / 32);
  for (int r = int((blockIdx.x * blockDim.x + threadIdx.x) / 32); r < n; r += warps) {
    float acc[kFewOutputs] = {};
    const float* xr = x + int64_t(r) * in;
#pragma unroll 4
    for (int i = lane; i < in; i += 32) {
      const float xv = xr[i];
#pragma unroll
      for (int o = 0; o < kFewOutputs; ++o)
        if (o < out) acc[o] = fmaf(xv, w[int64_t(o) * in + i], acc[o]);
    }
    float mine = 0.0f;  // lane o's output (every lane ends a butterfly with the warp's sum)
#pragma unroll
    for (int o = 0; o < kFewOutputs; ++o) {
      if (o >= out) break;  // the same for the whole warp
      float sum = acc[o];
#pragma unroll
      for (int step = 16; step > 0; step /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, step);
      if (lane == o) mine = sum;
    }
    if (lane < out) y[int64_t(r) * out + lane] = mine + b[lane];
  }
}

// dw (OUT, IN) = dy^T x. A block takes 32 consecutive weights e = o IN + i, a lane each; its warps
// take contiguous slices of the rows, each summed in order, then the slices are added in order:
// every weight's sum a fixed tree over the N rows. Neighbouring lanes read neighbouring floats of x.
__device__ void few_outputs_dw_block(int block, int n, int in, int out, const float* x, const float* dy, float* dw) {
  constexpr int kWarps = cuda::kThreads / 32;
  __shared__ float sums[kWarps][32];
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int64_t e = int64_t(block) * 32 + lane;
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

// dx (N, IN) = dy W: dx[r, i] adds dy[r, o] W[o, i] in o's order; `block` of `blocks` strides over it.
__device__ void few_outputs_dx_blocks(int block, int blocks, int n, int in, int out, const float* dy, const float* w,
                                      float* dx) {
  const int64_t total = int64_t(n) * in, stride = int64_t(blocks) * blockDim.x;
  for (int64_t e = int64_t(block) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t r = e / in;
    const int i = int(e % in);
    float acc = 0.0f;
    for (int o = 0; o < out; ++o) acc = fmaf(dy[r * out + o], w[int64_t(o) * in + i], acc);
    dx[e] = acc;
  }
}

// Each part as a kernel of its own (DP_CUDA_FUSE=0; column_sums_kernel above): what the one below replaced.
__global__ void few_outputs_dw_kernel(int n, int in, int out, const float* x, const float* dy, float* dw) {
  cuda::await_previous();
  few_outputs_dw_block(int(blockIdx.x), n, in, out, x, dy, dw);
}
__global__ void few_outputs_dx_kernel(int n, int in, int out, const float* dy, const float* w, float* dx) {
  cuda::await_previous();
  few_outputs_dx_blocks(int(blockIdx.x), int(gridDim.x), n, in, out, dy, w, dx);
}

// The backward pass of a layer of few outputs in one launch: its first `dw_blocks` blocks compute dw,
// the next `db_blocks` db (column_sums_block), the last `dx_blocks` dx, each part as its own kernel
// would (the same bits), side by side rather than one after another. Every branch is a whole block's.
// The column sums' registers (186 for sm_90) give a block an SM to itself, so dx takes few blocks:
// LeNet's fc2 at batch 256 is then 40 + 1 + 64 blocks, one wave of an A100, H100 or H200.
constexpr int kFewOutputsDxBlocks = 64;
__global__ void few_outputs_backward_kernel(int n, int in, int out, const float* x, const float* w, const float* dy,
                                            float* dx, float* dw, float* db, int dw_blocks, int db_blocks,
                                            int dx_blocks) {
  cuda::await_previous();
  const int block = int(blockIdx.x);
  if (block < dw_blocks)
    few_outputs_dw_block(block, n, in, out, x, dy, dw);
  else if (block < dw_blocks + db_blocks)
    column_sums_block(block - dw_blocks, n, out, dy, db);
  else
    few_outputs_dx_blocks(block - dw_blocks - db_blocks, dx_blocks, n, in, out, dy, w, dx);
}

}  // namespace

void CudaOps::linear_forward(int n, int in, int out, const float* x, const float* w, const float* b, float* y) {
  const int64_t total = int64_t(n) * out;  // y (N, OUT)
  if (total == 0) return;
  if (out <= kFewOutputs && fuse_wanted()) {
    cuda::launch("few_outputs_forward_kernel", few_outputs_forward_kernel, cuda::blocks_for(int64_t(n) * 32),
                 cuda::kThreads, 0, stream_, n, in, out, x, w, b, y);  // a warp a row
    return;
  }
  cuda::launch("broadcast_rows_kernel", broadcast_rows_kernel, cuda::blocks_for(total), cuda::kThreads, 0, stream_,
               total, out, b, y);
  gemm(false, true, n, out, in, 1.0f, x, w, 1.0f, y);
}

// A layer of few outputs: one kernel (fuse_wanted). Others, and such a layer under DP_CUDA_FUSE=0 on the
// three kernels that one does side by side: dw and db on the side lane (streams_wanted), dx on the
// stream meanwhile.
void CudaOps::linear_backward(int n, int in, int out, const float* x, const float* w, const float* dy, float* dx,
                              float* dw, float* db) {
  const bool few = out > 0 && out <= kFewOutputs;
  const int64_t weights = int64_t(out) * in, inputs = int64_t(n) * in;
  if (few && fuse_wanted()) {
    const int dw_blocks = int((weights + 31) / 32), db_blocks = (out + 31) / 32;
    const int dx_blocks = dx && inputs > 0 ? int(std::min<int64_t>(cuda::blocks_for(inputs), kFewOutputsDxBlocks)) : 0;
    cuda::launch("few_outputs_backward_kernel", few_outputs_backward_kernel,
                 unsigned(dw_blocks + db_blocks + dx_blocks), cuda::kThreads, 0, stream_, n, in, out, x, w, dy, dx, dw,
                 db, dw_blocks, db_blocks, dx_blocks);
    return;
  }
  Forked forked(*this, dx != nullptr);
  const Lane lane = dx ? side_ : main();
  if (!few)
    gemm(lane, true, false, out, in, n, 1.0f, dy, x, 0.0f, dw);  // dw (OUT, IN) = dy^T x; zero when n == 0
  else if (weights > 0)
    cuda::launch("few_outputs_dw_kernel", few_outputs_dw_kernel, unsigned((weights + 31) / 32), cuda::kThreads, 0,
                 lane.stream, n, in, out, x, dy, dw);
  if (out > 0)
    cuda::launch("column_sums_kernel", column_sums_kernel, unsigned((out + 31) / 32), cuda::kThreads, 0, lane.stream, n,
                 out, dy, db);  // db (OUT)
  if (!dx) return;
  if (!few)
    gemm(false, false, n, in, out, 1.0f, dy, w, 0.0f, dx);  // dx (N, IN) = dy W; zero when out == 0
  else if (inputs > 0)
    cuda::launch("few_outputs_dx_kernel", few_outputs_dx_kernel, cuda::blocks_for(inputs), cuda::kThreads, 0, stream_,
                 n, in, out, dy, w, dx);
  forked.join();
}

}  // namespace dp
