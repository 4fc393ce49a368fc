// Convolution on cuDNN (NCHW float, cross-correlation as PyTorch's Conv2d, stride 1, symmetric
// padding), with the bias and its gradient as small kernels here. Twin of kernels/cpu/conv2d.cpp.
//
// cuDNN 9 still ships the legacy convolution API (cudnn_cnn.h: cudnnConvolutionForward,
// BackwardData, BackwardFilter, the *_v7 heuristics), marked deprecated but only warned about under
// CUDNN_WARN_DEPRECATED; it is the short path for three fixed convolutions.
//
// Algorithms are chosen once per shape from cuDNN's heuristics (the *_v7 queries, which run nothing
// and allocate nothing, unlike cudnnFind*, which times candidates in memory of its own and may pick
// differently from run to run). Among the candidates, in cuDNN's order of preference, the first is
// taken that
//   - is deterministic (the same bits every run: the golden trajectories depend on it),
//   - is a GEMM-like summation (not FFT or Winograd), so every output is a plain sum of products
//     whose error the tests bound element by element (tests/test_ops_conv.cpp),
//   - runs in FP32 FMA math, never TF32 tensor cores (CUDNN_FMA_MATH on the descriptor), which
//     would round the inputs to 10 mantissa bits,
//   - needs no more workspace than allowed.
// Only when none qualifies is the first supported candidate of any kind taken.
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launch.h"

namespace dp {
namespace {

// Largest workspace one algorithm may ask for when the caller is about to allocate it.
constexpr size_t kMaxWorkspaceBytes = size_t(64) << 20;

// y(N, K, P) += b(K)
__global__ void bias_add_kernel(int64_t total, int k, int64_t p, const float* b, float* y) {
  DP_GRID_STRIDE(i, total) { y[i] += b[(i / p) % k]; }
}

// db(K)[k] = sum over n, p of dy(N, K, P)[n, k, p]: one block per channel, a fixed-order tree in
// shared memory, so the result is the same bits every run.
__global__ void bias_grad_kernel(int n, int k, int64_t p, const float* dy, float* db) {
  __shared__ float partial[cuda::kThreads];
  const int ch = blockIdx.x;
  const int64_t per_channel = int64_t(n) * p;
  float acc = 0.0f;
  for (int64_t j = threadIdx.x; j < per_channel; j += blockDim.x) {
    const int64_t img = j / p, pix = j % p;
    acc += dy[(img * k + ch) * p + pix];
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[ch] = partial[0];
}

std::string describe(const ConvShape& s) {
  return "conv (N " + std::to_string(s.n) + ", C " + std::to_string(s.c) + ", H " + std::to_string(s.h) + ", W " +
         std::to_string(s.w) + ") * (K " + std::to_string(s.k) + ", " + std::to_string(s.kh) + "x" +
         std::to_string(s.kw) + ", pad " + std::to_string(s.pad) + ")";
}

bool is_tensor_op(cudnnMathType_t m) { return m == CUDNN_TENSOR_OP_MATH || m == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION; }

bool gemm_like(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM || a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_GEMM || a == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT;
}
bool gemm_like(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
}
bool gemm_like(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
}

// The first acceptable candidate (see the top of the file); `bytes_of` asks cuDNN for an
// algorithm's workspace and returns false when cuDNN does not support it for this shape.
template <class Perf, class Algo, class BytesOf>
bool choose(const std::vector<Perf>& perf, int returned, size_t limit, BytesOf bytes_of, Algo& algo, size_t& bytes) {
  for (int strict = 1; strict >= 0; --strict) {
    for (int i = 0; i < returned; ++i) {
      const Perf& p = perf[size_t(i)];
      if (p.status != CUDNN_STATUS_SUCCESS || is_tensor_op(p.mathType)) continue;
      if (strict && (p.determinism != CUDNN_DETERMINISTIC || !gemm_like(p.algo))) continue;
      size_t need = 0;
      if (!bytes_of(p.algo, need) || need > limit) continue;
      algo = p.algo;
      bytes = need;
      return true;
    }
  }
  return false;
}

}  // namespace

size_t ConvPlan::workspace_floats() const {
  size_t most = std::max({fwd_bytes, bwd_data_bytes, bwd_filter_bytes});
  return (most + sizeof(float) - 1) / sizeof(float);
}

ConvPlan& CudaOps::make_plan(const ConvShape& s, size_t limit) {
  auto p = std::make_unique<ConvPlan>();
  const int oh = s.out_h(), ow = s.out_w();
  p->x = cuda::make_tensor_desc(s.n, s.c, s.h, s.w);
  p->y = cuda::make_tensor_desc(s.n, s.k, oh, ow);
  p->w = cuda::make_filter_desc(s.k, s.c, s.kh, s.kw);
  cudnnConvolutionDescriptor_t cd = nullptr;
  DP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&cd));
  p->conv = cuda::ConvDesc(cd);
  DP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(cd, s.pad, s.pad, /*stride*/ 1, 1, /*dilation*/ 1, 1,
                                                 CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(cd, CUDNN_FMA_MATH));

  int dims[4] = {0, 0, 0, 0};
  DP_CUDNN_CHECK(
      cudnnGetConvolution2dForwardOutputDim(cd, p->x.get(), p->w.get(), &dims[0], &dims[1], &dims[2], &dims[3]));
  if (dims[0] != s.n || dims[1] != s.k || dims[2] != oh || dims[3] != ow)
    throw DeviceError(cuda::current_device(), "cuDNN disagrees about the output shape of " + describe(s));

  auto fail = [&](const char* pass) {
    return DeviceError(cuda::current_device(), std::string("no cuDNN ") + pass + " algorithm for " + describe(s) +
                                                   " fits a workspace of " + std::to_string(limit) +
                                                   " bytes (conv2d_workspace_floats sizes the workspace)");
  };
  int max_count = 0, got = 0;

  DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(cudnn_, &max_count));
  std::vector<cudnnConvolutionFwdAlgoPerf_t> fwd(size_t(std::max(max_count, 1)));
  DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(cudnn_, p->x.get(), p->w.get(), cd, p->y.get(), max_count, &got,
                                                        fwd.data()));
  auto fwd_bytes = [&](cudnnConvolutionFwdAlgo_t a, size_t& b) {
    return cudnnGetConvolutionForwardWorkspaceSize(cudnn_, p->x.get(), p->w.get(), cd, p->y.get(), a, &b) ==
           CUDNN_STATUS_SUCCESS;
  };
  if (!choose(fwd, got, limit, fwd_bytes, p->fwd, p->fwd_bytes)) throw fail("forward");

  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(cudnn_, &max_count));
  std::vector<cudnnConvolutionBwdDataAlgoPerf_t> bwd_data(size_t(std::max(max_count, 1)));
  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnn_, p->w.get(), p->y.get(), cd, p->x.get(), max_count,
                                                             &got, bwd_data.data()));
  auto data_bytes = [&](cudnnConvolutionBwdDataAlgo_t a, size_t& b) {
    return cudnnGetConvolutionBackwardDataWorkspaceSize(cudnn_, p->w.get(), p->y.get(), cd, p->x.get(), a, &b) ==
           CUDNN_STATUS_SUCCESS;
  };
  if (!choose(bwd_data, got, limit, data_bytes, p->bwd_data, p->bwd_data_bytes)) throw fail("backward-data");

  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(cudnn_, &max_count));
  std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> bwd_filter(size_t(std::max(max_count, 1)));
  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(cudnn_, p->x.get(), p->y.get(), cd, p->w.get(),
                                                               max_count, &got, bwd_filter.data()));
  auto filter_bytes = [&](cudnnConvolutionBwdFilterAlgo_t a, size_t& b) {
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(cudnn_, p->x.get(), p->y.get(), cd, p->w.get(), a, &b) ==
           CUDNN_STATUS_SUCCESS;
  };
  if (!choose(bwd_filter, got, limit, filter_bytes, p->bwd_filter, p->bwd_filter_bytes)) throw fail("backward-filter");

  auto& slot = plans_[ShapeKey{s.n, s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad}];
  slot = std::move(p);
  return *slot;
}

// Every caller has allocated at least the smallest workspace handed out for this geometry (the
// engine asks with its largest batch and runs smaller ones; another network on the same device may
// have asked with a different batch). A plan whose algorithms need more than that is made again
// within it, so no execution can overrun any caller's workspace.
ConvPlan& CudaOps::plan(const ConvShape& s) {
  std::lock_guard lock(conv_mu_);
  auto b = budget_floats_.find(GeometryKey{s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad});
  const size_t budget = b == budget_floats_.end() ? 0 : b->second;
  auto it = plans_.find(ShapeKey{s.n, s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad});
  if (it != plans_.end() && it->second->workspace_floats() <= budget) return *it->second;
  return make_plan(s, budget * sizeof(float));
}

size_t CudaOps::conv2d_workspace_floats(const ConvShape& s) {
  if (s.n == 0) return 0;
  std::lock_guard lock(conv_mu_);
  auto it = plans_.find(ShapeKey{s.n, s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad});
  const size_t floats = (it != plans_.end() ? *it->second : make_plan(s, kMaxWorkspaceBytes)).workspace_floats();
  auto [b, fresh] = budget_floats_.try_emplace(GeometryKey{s.c, s.h, s.w, s.k, s.kh, s.kw, s.pad}, floats);
  if (!fresh) b->second = std::min(b->second, floats);
  return floats;
}

void CudaOps::conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                             float* workspace) {
  if (s.n == 0) return;
  ConvPlan& p = plan(s);
  const float one = 1.0f, zero = 0.0f;
  DP_CUDNN_CHECK(cudnnConvolutionForward(cudnn_, &one, p.x.get(), x, p.w.get(), w, p.conv.get(), p.fwd, workspace,
                                         p.fwd_bytes, &zero, p.y.get(), y));
  const int64_t pixels = int64_t(s.out_h()) * s.out_w();
  const int64_t total = int64_t(s.n) * s.k * pixels;  // y (N, K, OH, OW)
  bias_add_kernel<<<cuda::blocks_for(total), cuda::kThreads, 0, stream_>>>(total, s.k, pixels, b, y);
  DP_CUDA_LAUNCH_CHECK("bias_add_kernel");
}

void CudaOps::conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                              float* db, float* workspace) {
  const size_t dw_bytes = sizeof(float) * size_t(s.k) * size_t(s.col_rows());  // dw (K, C, KH, KW)
  if (s.n == 0) {  // no samples: zero gradients, nothing for cuDNN (it rejects N = 0)
    DP_CUDA_CHECK(cudaMemsetAsync(dw, 0, dw_bytes, stream_));
    DP_CUDA_CHECK(cudaMemsetAsync(db, 0, sizeof(float) * size_t(s.k), stream_));
    return;
  }
  ConvPlan& p = plan(s);
  const float one = 1.0f, zero = 0.0f;
  const int64_t pixels = int64_t(s.out_h()) * s.out_w();
  bias_grad_kernel<<<unsigned(s.k), cuda::kThreads, 0, stream_>>>(s.n, s.k, pixels, dy, db);  // db (K)
  DP_CUDA_LAUNCH_CHECK("bias_grad_kernel");
  DP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(cudnn_, &one, p.x.get(), x, p.y.get(), dy, p.conv.get(), p.bwd_filter,
                                                workspace, p.bwd_filter_bytes, &zero, p.w.get(), dw));
  if (dx)  // dx (N, C, H, W)
    DP_CUDNN_CHECK(cudnnConvolutionBackwardData(cudnn_, &one, p.w.get(), w, p.y.get(), dy, p.conv.get(), p.bwd_data,
                                                workspace, p.bwd_data_bytes, &zero, p.x.get(), dx));
}

}  // namespace dp
