// Convolution (NCHW float, cross-correlation as PyTorch's Conv2d, stride 1, symmetric padding): the
// forward pass on cuDNN; the backward pass dp's own, im2col and cuBLAS GEMMs (conv_backward says
// why); the bias and its gradient small kernels here (conv_act_pool.cu folds the bias, the activation
// and the pooling into one kernel each way for the fused op). Shapes of few taps (C KH KW, LeNet's
// first layer) run forward and their dw and db on conv_direct.cu's kernels instead, and under
// DP_CUDA_CONV=implicit the others on conv_implicit.cu's implicit GEMMs. Twin of kernels/cpu/conv2d.cpp.
//
// cuDNN 9 still ships the legacy convolution API (cudnn_cnn.h: cudnnConvolutionForward, the *_v7
// heuristics), marked deprecated but only warned about under CUDNN_WARN_DEPRECATED; it is the short
// path for a few fixed convolutions.
//
// cuDNN's forward algorithm is chosen once per shape from cuDNN's heuristics (the *_v7 queries, which run nothing
// and allocate nothing, unlike cudnnFind*, which times candidates in memory of its own and may pick
// differently from run to run). Among the candidates, in cuDNN's order of preference, the first is
// taken that
//   - is deterministic (the same bits every run: the golden trajectories depend on it),
//   - is a GEMM-like summation (not FFT or Winograd), so every output is a plain sum of products
//     whose error the tests bound element by element (tests/test_ops_conv.cpp),
//   - runs in FP32 FMA math, never TF32 tensor cores (CUDNN_FMA_MATH on the descriptor), which
//     would round the inputs to 10 mantissa bits,
//   - needs no more workspace than allowed.
// Only when none qualifies is the first supported candidate of any kind taken: FFT, Winograd or a
// non-deterministic algorithm, whose results may leave the tests' bounds and differ from run to run
// (a resume is then no longer bit-exact). That fallback is never silent: every choice is kept
// (CudaOps::conv_choices) and a shape that needed one gets a warning on stderr, once per process.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/divider.h"
#include "kernels/cuda/launch.h"

namespace dp {
namespace {

// The backward pass's kernels index in 32 bits (make_plan keeps a chunk's arrays under 2^31 elements):
// 64-bit division is several times slower, and these kernels are mostly index arithmetic.

// dyt(K, R)[k, r] = dy(nb, K, P)[r / P, k, r % P], R = nb P: the images' gradient rows side by side.
__global__ void dy_rows_kernel(int64_t total, int k, int p, int r, const float* dy, float* dyt) {
  DP_GRID_STRIDE(i64, total) {
    const int i = int(i64), ch = i / r, row = i - ch * r, img = row / p;
    dyt[i] = dy[(img * k + ch) * p + (row - img * p)];
  }
}

// col(R, C KH KW)[n P + q, (c KH + u) KW + v] = x(nb, C, H, W)[n, c, qy + u - pad, qx + v - pad], zero
// outside the image, (qy, qx) the output pixel q: im2col with one row per output pixel. A block fills
// kColRows rows: their images and pixels worked out once, in shared memory, and each thread's taps
// (c, u, v) once, so the inner loop divides nothing (six divisions an element made it the step's
// slowest kernel on an H200: 72 us, now 46). Neighbouring threads write neighbouring floats of a row.
constexpr int kColRows = 32;
const dim3 kColThreads(32, 8);  // (taps, rows)
__global__ void im2col_rows_kernel(int rows, ConvShape s, const float* x, float* col) {
  __shared__ int image_at[kColRows], top[kColRows], left[kColRows];
  const int ow = s.w + 2 * s.pad - s.kw + 1, pixels = (s.h + 2 * s.pad - s.kh + 1) * ow;  // out_h, out_w: host code
  const int khw = s.kh * s.kw, crs = s.c * khw, row0 = int(blockIdx.x) * kColRows;
  const int t = int(threadIdx.y * blockDim.x + threadIdx.x);
  if (t < kColRows && row0 + t < rows) {
    const int row = row0 + t, img = row / pixels, q = row - img * pixels, qy = q / ow;
    image_at[t] = img * s.c * s.h * s.w, top[t] = qy - s.pad, left[t] = q - qy * ow - s.pad;
  }
  __syncthreads();
  const int last = rows - row0 < kColRows ? rows - row0 : kColRows;
  for (int j = int(threadIdx.x); j < crs; j += int(blockDim.x)) {
    const int ch = j / khw, tap = j - ch * khw, u = tap / s.kw, v = tap - u * s.kw;
    for (int r = int(threadIdx.y); r < last; r += int(blockDim.y)) {
      const int y = top[r] + u, xx = left[r] + v;
      col[(row0 + r) * crs + j] =
          (y >= 0 && y < s.h && xx >= 0 && xx < s.w) ? x[image_at[r] + (ch * s.h + y) * s.w + xx] : 0.0f;
    }
  }
}

// dx(nb, C, H, W)[n, c, y, x] = the sum, over the taps (u, v) in order whose output pixel (y + pad - u,
// x + pad - v) exists, of cols(C KH KW, R)[(c KH + u) KW + v, n P + that pixel]: col2im as a gather,
// every input pixel one thread, a fixed order, no atomics. Its coordinates come from Dividers.
__global__ void col2im_rows_kernel(int total, ConvShape s, int r, cuda::Divider width, cuda::Divider height,
                                   cuda::Divider channels, const float* cols, float* dx) {
  const int oh = s.h + 2 * s.pad - s.kh + 1, ow = s.w + 2 * s.pad - s.kw + 1;
  DP_GRID_STRIDE(i64, total) {
    int rest = 0, xx = 0, y = 0, img = 0, ch = 0;
    width.divmod(int(i64), rest, xx);
    height.divmod(rest, rest, y);
    channels.divmod(rest, img, ch);
    const int base = img * oh * ow;
    float sum = 0.0f;
    for (int u = 0; u < s.kh; ++u) {
      const int qy = y + s.pad - u;
      if (qy < 0 || qy >= oh) continue;
      for (int v = 0; v < s.kw; ++v) {
        const int qx = xx + s.pad - v;
        if (qx >= 0 && qx < ow) sum += cols[int64_t((ch * s.kh + u) * s.kw + v) * r + base + qy * ow + qx];
      }
    }
    dx[i64] = sum;
  }
}

// Largest workspace one algorithm may ask for when the caller is about to allocate it.
constexpr size_t kMaxWorkspaceBytes = size_t(64) << 20;

// y(N, K, P) += b(K)
__global__ void bias_add_kernel(int64_t total, int k, int64_t p, const float* b, float* y) {
  DP_GRID_STRIDE(i, total) { y[i] += b[(i / p) % k]; }
}

// db(K)[k] = sum over n, p of dy(N, K, P)[n, k, p], in two fixed-order passes, so the result is the
// same bits every run (no atomics). One block per channel would leave an H100 idle (LeNet has 20 to
// 50 channels, the H100 132 SMs), so each channel's N * P values are cut into kBiasSlices contiguous
// slices, one block each, whose totals (a fixed tree in shared memory) go to the workspace; then
// one thread per channel adds its slices in order. Any order of additions keeps the sum within
// gamma(N P) of the exact one, the bound the tests hold db to (tests/test_ops_conv.cpp).
constexpr int kBiasSlices = 32;

// partial(K, kBiasSlices): grid (K, kBiasSlices), kThreads threads. Channel ch's j-th value, j = n P + p,
// is dy(N, K, P)[n, ch, p], or with kRows dyt(K, N P)[ch, j] (dy's rows, as the fused op writes them):
// the same values in the same order, so the same bits.
template <bool kRows>
__global__ void bias_grad_partial_kernel(int n, int k, int64_t p, const float* dy, float* partial) {
  __shared__ float s[cuda::kThreads];
  const int ch = blockIdx.x, slice = blockIdx.y;
  const int64_t per_channel = int64_t(n) * p;
  const int64_t begin = per_channel * slice / kBiasSlices, end = per_channel * (slice + 1) / kBiasSlices;
  float acc = 0.0f;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x)  // neighbours read neighbours
    acc += kRows ? dy[ch * per_channel + j] : dy[(j / p * k + ch) * p + j % p];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[int64_t(ch) * kBiasSlices + slice] = s[0];
}

// db(K) = the sum of each channel's kBiasSlices partials, in slice order.
__global__ void bias_grad_total_kernel(int k, const float* partial, float* db) {
  DP_GRID_STRIDE(ch, k) {
    float total = 0.0f;
    for (int slice = 0; slice < kBiasSlices; ++slice) total += partial[ch * kBiasSlices + slice];
    db[ch] = total;
  }
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
// cuDNN's enum names less "CUDNN_CONVOLUTION_" (and less "FWD_ALGO_" for the forward ones, whose
// names say what they are), as ConvChoice reports them.
const char* algo_name(cudnnConvolutionFwdAlgo_t a) {
  switch (a) {
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM:
      return "IMPLICIT_GEMM";
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM:
      return "IMPLICIT_PRECOMP_GEMM";
    case CUDNN_CONVOLUTION_FWD_ALGO_GEMM:
      return "GEMM";
    case CUDNN_CONVOLUTION_FWD_ALGO_DIRECT:
      return "DIRECT";
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT:
      return "FFT";
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING:
      return "FFT_TILING";
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD:
      return "WINOGRAD";
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED:
      return "WINOGRAD_NONFUSED";
    default:
      return "FWD_ALGO_?";
  }
}
const char* math_name(cudnnMathType_t m) {
  switch (m) {
    case CUDNN_DEFAULT_MATH:
      return "DEFAULT";
    case CUDNN_TENSOR_OP_MATH:
      return "TENSOR_OP";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION:
      return "TENSOR_OP_ALLOW_CONVERSION";
    case CUDNN_FMA_MATH:
      return "FMA";
    default:
      return "?";
  }
}

// The first acceptable candidate (see the top of the file), described for conv_choices; false when
// none is. `bytes_of` asks cuDNN for an algorithm's workspace and returns false when cuDNN does not
// support it for this shape.
template <class Perf, class Algo, class BytesOf>
bool choose(const std::vector<Perf>& perf, int returned, size_t limit, BytesOf bytes_of, Algo& algo, size_t& bytes,
            ConvChoice& chosen) {
  for (int strict = 1; strict >= 0; --strict) {
    for (int i = 0; i < returned; ++i) {
      const Perf& p = perf[size_t(i)];
      if (p.status != CUDNN_STATUS_SUCCESS || is_tensor_op(p.mathType)) continue;
      if (strict && (p.determinism != CUDNN_DETERMINISTIC || !gemm_like(p.algo))) continue;
      size_t need = 0;
      if (!bytes_of(p.algo, need) || need > limit) continue;
      algo = p.algo;
      bytes = need;
      chosen.algo = algo_name(p.algo);
      chosen.math = math_name(p.mathType);
      chosen.workspace_bytes = need;
      chosen.deterministic = p.determinism == CUDNN_DETERMINISTIC;
      chosen.strict = strict == 1;
      return true;
    }
  }
  return false;
}

// One line on stderr for a plan that fell back in any pass, once per shape in this process (devices
// share shapes; a shape planned again for a smaller workspace is not reported twice).
void warn_fallback(const ConvPlan& p, const std::string& shape) {
  static std::mutex mu;
  static std::set<std::string> warned;
  std::string passes;
  for (const ConvChoice& c : p.choices)
    if (!c.strict)
      passes += (passes.empty() ? "" : ", ") + c.pass + " uses " + c.algo + " (" +
                (c.deterministic ? "deterministic" : "non-deterministic") + ", " + c.math + ")";
  if (passes.empty()) return;
  std::lock_guard lock(mu);
  if (!warned.insert(shape).second) return;
  std::fprintf(stderr,
               "dp: warning: %s: no deterministic GEMM-like cuDNN algorithm within the workspace, so %s; its "
               "results may not be bit-repeatable from run to run\n",
               shape.c_str(), passes.c_str());
}

}  // namespace

// The algorithms and the bias gradient's partials use the workspace one after another on the stream.
size_t ConvPlan::workspace_floats() const {
  size_t most = std::max({fwd_bytes, bwd_data_bytes, bwd_filter_bytes});
  return std::max((most + sizeof(float) - 1) / sizeof(float), bias_floats);
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
    return DeviceError(cuda::current_device(), std::string("no ") + pass + " for " + describe(s) +
                                                   " fits a workspace of " + std::to_string(limit) +
                                                   " bytes (conv2d_workspace_floats sizes the workspace)");
  };
  int max_count = 0, got = 0;
  p->bias_floats = size_t(s.k) * kBiasSlices;
  const char* passes[3] = {"forward", "backward-data", "backward-filter"};
  for (size_t i = 0; i < 3; ++i) {
    p->choices[i].shape = s;
    p->choices[i].pass = passes[i];
  }

  p->direct = direct(s) && direct_partial_floats(s) * sizeof(float) <= limit;  // its partials fit
  p->implicit = !p->direct && implicit(s) && implicit_partial_floats(s) * sizeof(float) <= limit;
  if (p->direct || p->implicit) {  // conv_direct.cu, conv_implicit.cu: forward and backward-filter, no cuDNN
    p->bias_floats = p->direct ? direct_partial_floats(s) : implicit_partial_floats(s);
    for (size_t i : {size_t(0), size_t(2)}) {
      p->choices[i].algo = p->direct ? "DP_DIRECT" : "DP_IMPLICIT_GEMM";
      p->choices[i].math = "FMA";
      p->choices[i].workspace_bytes = i == 2 ? p->bias_floats * sizeof(float) : 0;
      p->choices[i].deterministic = p->choices[i].strict = true;
    }
  } else {
    DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(cudnn_, &max_count));
    std::vector<cudnnConvolutionFwdAlgoPerf_t> fwd(size_t(std::max(max_count, 1)));
    DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(cudnn_, p->x.get(), p->w.get(), cd, p->y.get(), max_count,
                                                          &got, fwd.data()));
    auto fwd_bytes = [&](cudnnConvolutionFwdAlgo_t a, size_t& b) {
      return cudnnGetConvolutionForwardWorkspaceSize(cudnn_, p->x.get(), p->w.get(), cd, p->y.get(), a, &b) ==
             CUDNN_STATUS_SUCCESS;
    };
    if (!choose(fwd, got, limit, fwd_bytes, p->fwd, p->fwd_bytes, p->choices[0])) throw fail("cuDNN forward algorithm");
  }

  // The backward pass is dp's own (see conv2d_backward), over as many images at a time as the limit
  // holds and 32-bit indices reach: per image, dy's rows and the im2col (or its transpose, for dx).
  const size_t image_floats = size_t(oh) * ow * size_t(s.col_rows() + s.k);
  const size_t index_cap = size_t(INT32_MAX) / std::max(image_floats, size_t(s.c) * s.h * s.w);
  if (image_floats * sizeof(float) > limit || index_cap == 0)
    throw fail("chunk of the backward pass (an image's rows and im2col)");
  p->backward_images = int(std::min({size_t(s.n), limit / (image_floats * sizeof(float)), index_cap}));
  p->bwd_data_bytes = p->bwd_filter_bytes = image_floats * sizeof(float) * size_t(p->backward_images);
  // dx as an implicit GEMM: the flipped weights in the workspace, nothing else (conv_implicit.cu)
  p->implicit_dx = p->implicit && implicit_dx(s) && size_t(s.k) * size_t(s.col_rows()) * sizeof(float) <= limit;
  if (p->implicit_dx) {
    p->choices[1].algo = "DP_IMPLICIT_GEMM";
    p->choices[1].math = "FMA";
    p->choices[1].workspace_bytes = size_t(s.k) * size_t(s.col_rows()) * sizeof(float);
    p->choices[1].deterministic = p->choices[1].strict = true;
  }
  for (size_t i : {size_t(1), size_t(2)}) {
    if ((p->direct || p->implicit) && i == 2) continue;
    if (p->implicit_dx && i == 1) continue;
    p->choices[i].algo = "DP_IM2COL_GEMM";
    p->choices[i].math = "FMA";  // cuBLAS's default math: FP32, never TF32 (cuda_device.cpp)
    p->choices[i].workspace_bytes = p->bwd_filter_bytes;
    p->choices[i].deterministic = p->choices[i].strict = true;
  }
  warn_fallback(*p, describe(s));

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
  if (b == budget_floats_.end())  // a workspace of unknown size: it may not even hold db's partials
    throw DeviceError(cuda::current_device(), describe(s) + " runs, but conv2d_workspace_floats was never asked " +
                                                  "about its geometry, at any batch size");
  const size_t budget = b->second;
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

void CudaOps::convolve(const ConvShape& s, const float* x, const float* w, float* y, float* workspace) {
  ConvPlan& p = plan(s);
  if (p.direct) return direct_forward(s, x, w, y);
  if (p.implicit) return implicit_forward(s, x, w, y);
  const float one = 1.0f, zero = 0.0f;
  DP_CUDNN_CHECK(cudnnConvolutionForward(cudnn_, &one, p.x.get(), x, p.w.get(), w, p.conv.get(), p.fwd, workspace,
                                         p.fwd_bytes, &zero, p.y.get(), y));
}

void CudaOps::conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* b, float* y,
                             float* workspace) {
  if (s.n == 0) return;
  convolve(s, x, w, y, workspace);
  const int64_t pixels = int64_t(s.out_h()) * s.out_w();
  const int64_t total = int64_t(s.n) * s.k * pixels;  // y (N, K, OH, OW)
  bias_add_kernel<<<cuda::blocks_for(total), cuda::kThreads, 0, stream_>>>(total, s.k, pixels, b, y);
  DP_CUDA_LAUNCH_CHECK("bias_add_kernel");
}

void CudaOps::conv2d_backward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,
                              float* db, float* workspace) {
  conv_backward(s, x, w, dy, /*rows*/ false, dx, dw, db, workspace);
}

void CudaOps::conv_backward(const ConvShape& s, const float* x, const float* w, const float* dy, bool rows, float* dx,
                            float* dw, float* db, float* workspace) {
  const size_t dw_bytes = sizeof(float) * size_t(s.k) * size_t(s.col_rows());  // dw (K, C, KH, KW)
  if (s.n == 0) {  // no samples: zero gradients, nothing for cuDNN (it rejects N = 0)
    DP_CUDA_CHECK(cudaMemsetAsync(dw, 0, dw_bytes, stream_));
    DP_CUDA_CHECK(cudaMemsetAsync(db, 0, sizeof(float) * size_t(s.k), stream_));
    return;
  }
  const ConvPlan& p = plan(s);
  const int64_t pixels = int64_t(s.out_h()) * s.out_w();
  // db (and with a direct or implicit plan dw) through partials at the start of the workspace, which the rest
  // overwrites only after, in stream order
  if (p.direct || p.implicit) {  // dw and db at once (conv_direct.cu, conv_implicit.cu), then only dx below
    if (p.direct)
      direct_filter_grad(s, x, dy, rows, dw, db, workspace);
    else
      implicit_filter_grad(s, x, dy, rows, dw, db, workspace);
    if (!dx) return;
    if (p.implicit_dx) return implicit_data_grad(s, w, dy, rows, dx, workspace);  // after the partials' total
  } else {  // db through (K, kBiasSlices) partials
    const dim3 slices(unsigned(s.k), kBiasSlices);
    if (rows)
      bias_grad_partial_kernel<true><<<slices, cuda::kThreads, 0, stream_>>>(s.n, s.k, pixels, dy, workspace);
    else
      bias_grad_partial_kernel<false><<<slices, cuda::kThreads, 0, stream_>>>(s.n, s.k, pixels, dy, workspace);
    DP_CUDA_LAUNCH_CHECK("bias_grad_partial_kernel");
    bias_grad_total_kernel<<<cuda::blocks_for(s.k), cuda::kThreads, 0, stream_>>>(s.k, workspace, db);
    DP_CUDA_LAUNCH_CHECK("bias_grad_total_kernel");
  }
  // Per chunk of images (all of them, where the workspace holds them): dy's rows side by side,
  // dyt (K, R), R = chunk P (in the workspace, or already so in dy with `rows`), then the chunk's
  // im2col in the workspace, col (R, C KH KW). Then
  //   dw (K, C KH KW) = dyt col, one GEMM (later chunks add to dw, beta 1);
  //   dx: cols (C KH KW, R) = w^T dyt into col's place, one GEMM, and col2im gathers each pixel's taps.
  // cuDNN's BWD_FILTER_ALGO_1, the one deterministic GEMM-like filter-gradient algorithm it offers,
  // gave other last bits from run to run on an H200 (cuDNN 9.14, lenet's second convolution, 16 or more
  // images) and took 60% of a LeNet step's GPU time; its data gradient then took the most (170 of 778 us).
  const int64_t crs = s.col_rows(), chunk_max = p.backward_images, image = int64_t(s.c) * s.h * s.w;
  for (int64_t n0 = 0; n0 < s.n; n0 += chunk_max) {
    const int64_t nb = std::min<int64_t>(chunk_max, s.n - n0), r = nb * pixels;
    const float* dyt = dy + n0 * pixels;  // dy's rows: (K, N P), this chunk's columns
    int64_t ld = s.n * pixels;
    float* col = workspace + s.k * r;  // (R, C KH KW), then cols (C KH KW, R)
    if (!rows) {
      dy_rows_kernel<<<cuda::blocks_for(s.k * r), cuda::kThreads, 0, stream_>>>(s.k * r, s.k, int(pixels), int(r),
                                                                                dy + n0 * s.k * pixels, workspace);
      DP_CUDA_LAUNCH_CHECK("dy_rows_kernel");
      dyt = workspace, ld = r;
    }
    if (!p.direct && !p.implicit) {
      im2col_rows_kernel<<<unsigned((r + kColRows - 1) / kColRows), kColThreads, 0, stream_>>>(int(r), s,
                                                                                               x + n0 * image, col);
      DP_CUDA_LAUNCH_CHECK("im2col_rows_kernel");
      gemm_ld(false, false, s.k, int(crs), int(r), 1.0f, dyt, int(ld), col, int(crs), n0 == 0 ? 0.0f : 1.0f, dw);
    }
    if (!dx) continue;
    gemm_ld(true, false, int(crs), int(r), s.k, 1.0f, w, int(crs), dyt, int(ld), 0.0f, col);
    col2im_rows_kernel<<<cuda::blocks_for(nb * image), cuda::kThreads, 0, stream_>>>(
        int(nb * image), s, int(r), cuda::Divider(s.w), cuda::Divider(s.h), cuda::Divider(s.c), col, dx + n0 * image);
    DP_CUDA_LAUNCH_CHECK("col2im_rows_kernel");
  }
}

std::vector<ConvChoice> CudaOps::conv_choices() const {
  std::lock_guard lock(conv_mu_);
  std::vector<ConvChoice> out;
  for (const auto& [key, plan] : plans_) out.insert(out.end(), plan->choices.begin(), plan->choices.end());
  return out;
}

}  // namespace dp
