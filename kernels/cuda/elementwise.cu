// SGD, Adam, the reduction add, fill, the finiteness check and gradient clipping over flat buffers.
// Twin of kernels/cpu/elementwise.cpp; the optimizers and the clip coefficient go through kernels/math.h
// like the CPU's. The sum of squares is float, per thread in grid-stride order, per block a fixed tree,
// then the blocks' partials in block order by the last block to finish (as softmax_xent.cu's
// statistics): the same bits every run, though not the CPU's (which sums in double).
#include <algorithm>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"
#include "kernels/math.h"

namespace dp {
namespace {

// The optimizers check each gradient as they read it (Ops::sgd_step): a thread that sees a NaN or an
// infinity raises the flag, where there is one; they all write the same value.
__device__ __forceinline__ float checked(float g, float* nonfinite) {
  if (nonfinite && !isfinite(g)) *nonfinite = 1.0f;
  return g;
}

// The scalars are read from device memory as the kernel runs (a replayed graph's step takes its own).
__global__ void sgd_kernel(int64_t n, float* w, const float* g, float* v, const math::SgdStep* step, float* nonfinite) {
  cuda::await_previous();
  const math::SgdStep s = *step;
  DP_GRID_STRIDE(i, n) { math::sgd_update(w[i], v[i], checked(g[i], nonfinite), s.lr, s.momentum, s.weight_decay); }
}

// momentum 0: no buffer (the optimizer category stays empty), as the CPU twin
__global__ void sgd_no_momentum_kernel(int64_t n, float* w, const float* g, const math::SgdStep* step,
                                       float* nonfinite) {
  cuda::await_previous();
  const math::SgdStep s = *step;
  DP_GRID_STRIDE(i, n) {
    float none = 0.0f;
    math::sgd_update(w[i], none, checked(g[i], nonfinite), s.lr, 0.0f, s.weight_decay);
  }
}

__global__ void adam_kernel(int64_t n, float* w, const float* g, float* m, float* v, const math::AdamStep* step,
                            float* nonfinite) {
  cuda::await_previous();
  const math::AdamStep s = *step;
  DP_GRID_STRIDE(i, n) { math::adam_update(w[i], m[i], v[i], checked(g[i], nonfinite), s); }
}

__global__ void sum_squares_kernel(int64_t n, const float* x, float* sum, CudaOps::Scratch* scratch) {
  cuda::await_previous();
  __shared__ float tree[cuda::kThreads];
  __shared__ bool last;
  float s = 0.0f;
  DP_GRID_STRIDE(i, n) { s += x[i] * x[i]; }
  tree[threadIdx.x] = s;
  __syncthreads();
  for (int half = cuda::kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) tree[threadIdx.x] += tree[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    scratch->squares_partials[blockIdx.x] = tree[0];
    last = cuda::last_block_done(&scratch->squares_done);
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    const volatile float* partials = scratch->squares_partials;
    float total = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) total += partials[b];
    *sum += total;
  }
}

__global__ void clip_scale_kernel(int64_t n, const float* sum_squares, float max_norm, float* x) {
  cuda::await_previous();
  const float c = math::clip_coefficient(*sum_squares, max_norm);
  DP_GRID_STRIDE(i, n) { x[i] *= c; }
}

__global__ void add_kernel(int64_t n, const float* x, float* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { y[i] += x[i]; }
}

__global__ void narrow_kernel(DType t, int64_t n, const float* x, uint16_t* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { y[i] = math::narrow(t, x[i]); }
}

__global__ void widen_kernel(DType t, int64_t n, const uint16_t* x, float* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { y[i] = math::widen(t, x[i]); }
}

__global__ void add16_kernel(DType t, int64_t n, const uint16_t* x, uint16_t* y) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { y[i] = math::add16(t, x[i], y[i]); }
}

__global__ void fill_kernel(int64_t n, float value, float* x) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) { x[i] = value; }
}

// Any thread that sees a NaN or an infinity raises the flag; they all write the same value.
__global__ void nonfinite_kernel(int64_t n, const float* x, int32_t* flag) {
  cuda::await_previous();
  DP_GRID_STRIDE(i, n) {
    if (!isfinite(x[i])) *flag = 1;
  }
}

}  // namespace

void CudaOps::sgd_step(int64_t n, float* w, const float* g, float* v, const math::SgdStep* s, float* nonfinite) {
  if (n == 0) return;
  if (v) {
    cuda::launch("sgd_kernel", sgd_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n, w, g, v, s, nonfinite);
  } else {
    cuda::launch("sgd_no_momentum_kernel", sgd_no_momentum_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n,
                 w, g, s, nonfinite);
  }
}

void CudaOps::adam_step(int64_t n, float* w, const float* g, float* m, float* v, const math::AdamStep* s,
                        float* nonfinite) {
  if (n == 0) return;
  cuda::launch("adam_kernel", adam_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n, w, g, m, v, s,
               nonfinite);
}

void CudaOps::add(int64_t n, const float* x, float* y) {
  if (n == 0) return;
  cuda::launch("add_kernel", add_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n, x, y);
}

void CudaOps::fill(int64_t n, float value, float* x) {
  if (n == 0) return;
  cuda::launch("fill_kernel", fill_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n, value, x);
}

void CudaOps::narrow(DType t, int64_t n, const float* x, void* y) {
  if (n == 0) return;
  if (t == DType::fp32) {
    DP_CUDA_CHECK(cudaMemcpyAsync(y, x, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  cuda::launch("narrow_kernel", narrow_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, t, n, x,
               static_cast<uint16_t*>(y));
}

void CudaOps::widen(DType t, int64_t n, const void* x, float* y) {
  if (n == 0) return;
  if (t == DType::fp32) {
    DP_CUDA_CHECK(cudaMemcpyAsync(y, x, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  cuda::launch("widen_kernel", widen_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, t, n,
               static_cast<const uint16_t*>(x), y);
}

void CudaOps::add_typed(DType t, int64_t n, const void* x, void* y) {
  if (t == DType::fp32) return add(n, static_cast<const float*>(x), static_cast<float*>(y));
  if (n == 0) return;
  cuda::launch("add16_kernel", add16_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, t, n,
               static_cast<const uint16_t*>(x), static_cast<uint16_t*>(y));
}

bool CudaOps::all_finite(int64_t n, const float* x) {
  if (n == 0) return true;
  DP_CUDA_CHECK(cudaMemsetAsync(flag_, 0, sizeof(int32_t), stream_));
  cuda::launch("nonfinite_kernel", nonfinite_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n, x, flag_);
  int32_t raised = 0;
  DP_CUDA_CHECK(cudaMemcpyAsync(&raised, flag_, sizeof raised, cudaMemcpyDeviceToHost, stream_));
  DP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return raised == 0;
}

void CudaOps::sum_squares(int64_t n, const float* x, float* sum) {
  if (n == 0) return;
  const unsigned blocks = std::min(cuda::blocks_for(n), unsigned(kReduceBlocks));
  cuda::launch("sum_squares_kernel", sum_squares_kernel, blocks, cuda::kThreads, 0, stream_, n, x, sum, scratch_);
}

void CudaOps::clip_scale(int64_t n, const float* sum_squares, float max_norm, float* x) {
  if (n == 0) return;
  cuda::launch("clip_scale_kernel", clip_scale_kernel, cuda::blocks_for(n), cuda::kThreads, 0, stream_, n, sum_squares,
               max_norm, x);
}

namespace cuda {

int kernels_ptx_version() {
  cudaFuncAttributes attributes{};
  DP_CUDA_CHECK(cudaFuncGetAttributes(&attributes, sgd_kernel));
  return attributes.ptxVersion;
}

}  // namespace cuda
}  // namespace dp
